"""The terngrad codec (hvd_ext.compression.terngrad)."""
import torch

from hvd_ext.spec import compression_from_spec as C

from helpers.quant import roundtrip


def test_terngrad_clip_bounds_scaler():
    x = torch.randn(1000)
    x[0] = 100.0
    _, d = roundtrip(C("terngrad:clip=2.5"), x)
    assert d.abs().max() <= 2.5 * x.std() + 1e-4
