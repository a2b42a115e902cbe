"""Quantizing codecs driven in one process: a TensorInfo (size left at its default), one
compress/decode round trip, and a heavy-tailed layer gradient."""
import torch

from hvd_ext.compression.base import TensorInfo


def info(name, shape, step=0, rank=0):
    return TensorInfo(name=name, shape=torch.Size(shape), step=step, rank=rank)


def roundtrip(comp, x, step=0, name="w", rank=0):
    i = info(name, x.shape, step, rank)
    payload, ctx = comp.compress(x, i)
    return payload, comp.decode(payload, ctx, i)


def _heavy_tailed(n=65536, rows=256, seed=12):
    """Rows (output channels) with log-normal scales and Student-t(3) entries: a heavy-tailed
    layer gradient whose magnitude varies inside the layer, like real ones."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(n, generator=g)
    chi = torch.randn(n, 3, generator=g).pow(2).sum(1)  # chi^2 with 3 degrees of freedom
    t = z / (chi / 3).sqrt()
    row_scale = torch.exp(1.5 * torch.randn(rows, generator=g)).repeat_interleave(n // rows)
    return 1e-3 * t * row_scale
