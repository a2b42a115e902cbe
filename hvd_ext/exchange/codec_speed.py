"""A codec's speed before anything has timed it: the planner's default and a job's route choice read it.

One codec round trip (compress, then decode-and-sum of two payloads) on one CPU core, per codec
family, from ``benchmarks/results/throughput.json``; a pass (one encode, or one decode) is a third
of it. On a GPU the codecs are bandwidth-bound passes over the gradient (``docs/gpu.md``): the CPU
figure scales with the device's copy bandwidth, at the kernels' target share of it. A calibration
file (``python -m hvd_ext.plan --measure``) replaces these with the job's own device.
"""
from __future__ import annotations

from typing import Dict, Optional, Tuple

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
# memory bandwidth (GB/s) by the name torch gives the device, first match wins (NVIDIA datasheets)
GPU_COPY_GBS: Tuple[Tuple[str, float], ...] = (
    ("H200", 4800.0), ("H100 PCIe", 2000.0), ("H100", 3350.0), ("A100-SXM4-80GB", 2039.0),
    ("A100 80GB PCIe", 1935.0), ("A100", 1555.0), ("V100", 900.0), ("RTX 3090", 936.0),
    ("L40", 864.0), ("A10", 600.0), ("T4", 320.0), ("L4", 300.0),
)
UNNAMED_GPU_COPY_GBS = 900.0  # a GPU the table does not name: priced as a V100


def round_trip_speed(family: str, gpu_gbs: Optional[float] = None) -> float:
    """Elements per second of one round trip of ``family`` on a CPU core, or on a GPU of ``gpu_gbs``
    GB/s copy bandwidth (its kernels reach :data:`GPU_KERNEL_FRACTION` of it)."""
    base = CPU_ROUND_TRIP.get(family, CPU_ROUND_TRIP["qsgd"])
    return base if gpu_gbs is None else base * gpu_gbs * GPU_KERNEL_FRACTION / CPU_COPY_GBS


def gpu_copy_gbs(device) -> Optional[float]:
    """The copy bandwidth of ``device`` (a ``torch.device`` or its name) where it is a GPU, by its name
    (:data:`GPU_COPY_GBS`); None for a CPU."""
    device = torch.device(device) if device is not None else torch.device("cpu")
    if device.type != "cuda":
        return None
    try:
        name = torch.cuda.get_device_name(device)
    except (RuntimeError, AssertionError):  # no driver here: the name cannot be read
        return UNNAMED_GPU_COPY_GBS
    return next((gbs for key, gbs in GPU_COPY_GBS if key in name), UNNAMED_GPU_COPY_GBS)


def pass_speed(family: str, device=None) -> float:
    """Elements per second of one pass of ``family``'s codec on ``device`` (default: a CPU core)."""
    return PASSES_PER_ROUND_TRIP * round_trip_speed(family, gpu_copy_gbs(device))
