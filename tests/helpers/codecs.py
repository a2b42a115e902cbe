"""TensorInfo and optimizer binding for single-process codec and feedback tests."""
import warnings

import torch

from hvd_ext.compression.base import TensorInfo


def info(name="w", shape=(1000,), step=0, rank=0):
    return TensorInfo(name=name, shape=torch.Size(shape), step=step, rank=rank, size=2)


def bound(spec, optimizer):
    """A compressor from ``spec`` bound to ``optimizer`` as DistributedOptimizer binds it, and the
    warnings that raised."""
    import hvd_ext

    comp = hvd_ext.compression_from_spec(spec)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        comp.bind_optimizer(optimizer)
    return comp, [str(w.message) for w in caught]
