"""TensorInfo for single-process codec and feedback tests (size 2)."""
import torch

from hvd_ext.compression.base import TensorInfo


def info(name="w", shape=(1000,), step=0, rank=0):
    return TensorInfo(name=name, shape=torch.Size(shape), step=step, rank=rank, size=2)
