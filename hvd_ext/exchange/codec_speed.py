"""A codec's speed before anything has timed it: the planner's default and a job's route choice read it.

One codec round trip (compress, then decode-and-sum of two payloads) on one CPU core, per codec
family, from ``benchmarks/results/throughput.json``; a pass (one encode, or one decode) is a third
of it. On a GPU the codecs are bandwidth-bound passes over the gradient (``docs/gpu.md``): the CPU
figure scales with the device's copy bandwidth, at the kernels' target share of it (a job: a
V100's). A calibration file (``python -m hvd_ext.plan --measure``) replaces these with the job's own
device.
"""
from __future__ import annotations

from typing import Dict, Optional

import torch

# elements per second of one round trip, one core (16M floats, 1 thread); unknown families: qsgd's
CPU_ROUND_TRIP: Dict[str, float] = {
    "none": float("inf"), "fp16": 2.04e9, "bf16": 2.04e9, "qsgd": 0.31e9, "int8": 0.85e9,
    "topk": 0.26e9, "dgc": 0.35e9, "randomk": 0.03e9, "sig": 0.18e9, "threshold": 0.84e9,
    "signsgd": 0.45e9, "efsignsgd": 0.48e9, "signum": 0.45e9, "onebit": 0.63e9, "terngrad": 0.38e9,
    "natural": 0.0055e9, "qdist": 0.17e9, "powersgd": 0.056e9,
}
PASSES_PER_ROUND_TRIP = 3.0
CPU_COPY_GBS = 12.96  # one core of the testbed: memcpy of 16M floats (benchmarks/results/throughput.json)
GPU_KERNEL_FRACTION = 0.5  # docs/gpu.md: each kernel's target share of the device's copy bandwidth
# A GPU whatever its model, priced as a V100 (900 GB/s HBM2, NVIDIA's datasheet; the slowest GPU of the
# planner's presets): every rank of a job takes the same figure, which its route choice needs (a
# rank-local one, such as the device's name, could part the ranks' routes on a mixed cluster).
GPU_COPY_GBS = 900.0


def round_trip_speed(family: str, gpu_gbs: Optional[float] = None) -> float:
    """Elements per second of one round trip of ``family`` on a CPU core, or on a GPU of ``gpu_gbs``
    GB/s copy bandwidth (its kernels reach :data:`GPU_KERNEL_FRACTION` of it)."""
    base = CPU_ROUND_TRIP.get(family, CPU_ROUND_TRIP["qsgd"])
    return base if gpu_gbs is None else base * gpu_gbs * GPU_KERNEL_FRACTION / CPU_COPY_GBS


def gpu_copy_gbs(device) -> Optional[float]:
    """The copy bandwidth :func:`round_trip_speed` takes for ``device`` (a ``torch.device`` or its name):
    :data:`GPU_COPY_GBS` for a GPU, None for a CPU."""
    device = torch.device(device) if device is not None else torch.device("cpu")
    return GPU_COPY_GBS if device.type == "cuda" else None


def pass_speed_at(family: str, gpu_gbs: Optional[float] = None) -> float:
    """Elements per second of one pass of ``family``'s codec on a CPU core, or on a GPU of ``gpu_gbs``
    GB/s (the planner's default for a named device)."""
    return PASSES_PER_ROUND_TRIP * round_trip_speed(family, gpu_gbs)


def pass_speed(family: str, device=None) -> float:
    """Elements per second of one pass of ``family``'s codec on ``device`` (default: a CPU core)."""
    return pass_speed_at(family, gpu_copy_gbs(device))
