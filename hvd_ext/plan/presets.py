"""Named clusters and published models: the planner's inputs when nothing is measured (the codecs'
speeds: :mod:`hvd_ext.exchange.codec_speed`).

Every figure says where it comes from. They are starting points: ``python -m hvd_ext.plan --measure``
on the user's own cluster replaces the links and codec speeds (:mod:`hvd_ext.plan.calibration`).

Links are the bandwidth a ring collective achieves (the "bus bandwidth" of nccl-tests), not the
line rate: a NIC reaches about 90% of its line rate, a PCIe path without peer-to-peer copies
through the host about half of its nominal rate.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict

from ..exchange import codec_speed
from ..exchange.cost import LinkModel

GBIT = 1e9 / 8  # bytes per second in one Gbit/s


@dataclass(frozen=True)
class Cluster:
    """``gpus_per_node`` ranks per node; ``intra`` / ``inter`` the links inside and between nodes;
    ``device`` keys :data:`DEVICES`; ``source`` the published figures behind them."""

    name: str
    gpus_per_node: int
    intra: LinkModel
    inter: LinkModel
    device: str
    source: str


@dataclass(frozen=True)
class Device:
    """``copy_gbs``: memory copy bandwidth (GB/s); ``tflops``: dense fp16/bf16 tensor-core peak."""

    name: str
    copy_gbs: float
    tflops: float
    source: str


DEVICES: Dict[str, Device] = {
    "a100": Device("A100 80GB SXM", 2039.0, 312.0, "NVIDIA A100 datasheet (2021): 2,039 GB/s HBM2e, 312 TFLOPS bf16"),
    "v100": Device("V100 SXM2", codec_speed.GPU_COPY_GBS, 125.0,
                   "NVIDIA V100 datasheet (2020): 900 GB/s HBM2, 125 TFLOPS fp16"),
    "rtx3090": Device("GeForce RTX 3090", 936.0, 71.0,
                      "NVIDIA Ampere GA102 whitepaper (2020): 936 GB/s GDDR6X, 71 TFLOPS fp16 tensor"),
    "cpu": Device("one CPU core (this testbed)", codec_speed.CPU_COPY_GBS, 0.05,
                  "benchmarks/results/throughput.json: memcpy of 16M floats, 1 thread, AMD EPYC"),
}

CLUSTERS: Dict[str, Cluster] = {
    "dgx-a100": Cluster(
        "dgx-a100", 8,
        intra=LinkModel(alpha=5e-6, bandwidth=230e9),   # nccl-tests allreduce bus bandwidth on NVLink 3
        inter=LinkModel(alpha=5e-6, bandwidth=4 * 200 * GBIT * 0.9),
        device="a100",
        source="NVIDIA DGX A100 system architecture (2020): NVLink 3 / NVSwitch 600 GB/s per GPU; "
               "4 x 200 Gbit/s HDR InfiniBand per node as in the issue's preset; allreduce bus "
               "bandwidth ~230 GB/s inside a node (NCCL tests, nccl-tests README figures)"),
    "p3-v100-25gbe": Cluster(
        "p3-v100-25gbe", 8,
        intra=LinkModel(alpha=5e-6, bandwidth=130e9),   # NVLink 2 hybrid cube-mesh, ring allreduce
        inter=LinkModel(alpha=30e-6, bandwidth=25 * GBIT * 0.9),
        device="v100",
        source="AWS EC2 p3.16xlarge (8 x V100 with NVLink 2, 25 Gbit/s Ethernet); NVLink 2 ring "
               "allreduce ~130 GB/s bus bandwidth (Li et al., 'Evaluating modern GPU interconnect', "
               "IEEE TPDS 2020)"),
    "pcie-consumer-10gbe": Cluster(
        "pcie-consumer-10gbe", 8,
        intra=LinkModel(alpha=10e-6, bandwidth=6e9),    # PCIe 4.0 x16 without P2P: through host memory
        inter=LinkModel(alpha=50e-6, bandwidth=10 * GBIT * 0.9),
        device="rtx3090",
        source="8 consumer GPUs on PCIe without peer-to-peer (the commodity servers of CGX, Markov et al., "
               "Middleware 2022), 10 Gbit/s Ethernet between servers"),
}


@dataclass(frozen=True)
class PublishedModel:
    """``params``: trainable parameters; ``train_flops``: training FLOPs per sample (forward +
    backward); ``batch``: samples per GPU per step; ``mfu``: the fraction of the device's peak the
    step reaches. compute seconds = batch x train_flops / (tflops x 1e12 x mfu)."""

    name: str
    params: int
    train_flops: float
    batch: int
    mfu: float
    source: str


MODELS: Dict[str, PublishedModel] = {
    "resnet50": PublishedModel(
        "ResNet-50", 25_557_032, 3 * 4.1e9, 256, 0.10,
        "He et al. 2016 (25.6M parameters, 4.1 GFLOPs forward at 224x224); 3x forward for training; "
        "mfu 0.10: ~2,600 images/s per A100 with AMP (NVIDIA DeepLearningExamples RN50 v1.5; timm #1491)"),
    "bert-large": PublishedModel(
        "BERT-large", 340_000_000, 6 * 340e6 * 128, 64, 0.40,
        "Devlin et al. 2019 (340M parameters), sequence 128; 6 x params FLOPs per token (Kaplan et al. "
        "2020); mfu 0.40 (Narayanan et al., SC 2021, report 44-52% of peak for transformers)"),
    "gpt-1.3b": PublishedModel(
        "1.3B decoder", 1_300_000_000, 6 * 1.3e9 * 2048, 8, 0.40,
        "GPT-3 XL size (Brown et al. 2020: 1.3B parameters, context 2048); 6 x params FLOPs per token; "
        "mfu 0.40 as above"),
}

def compute_seconds(model: PublishedModel, device: str) -> float:
    """One step's forward + backward on one GPU of ``device`` (see :class:`PublishedModel`)."""
    return model.batch * model.train_flops / (DEVICES[device].tflops * 1e12 * model.mfu)
