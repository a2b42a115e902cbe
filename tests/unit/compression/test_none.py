"""The none codec (hvd_ext.compression.none)."""
import torch

import hvd_ext

from helpers.codecs import info


def test_none_codec_is_identity():
    c = hvd_ext.compression_from_spec("none")
    t = torch.randn(5, 4)
    p, ctx = c.compress(t, info(shape=t.shape))
    assert torch.equal(c.decompress(p, ctx, info(shape=t.shape)), t)
