"""The cast codecs fp16 and bf16 (hvd_ext.compression.fp16's CastCompressor; bf16.py)."""
import pytest
import torch

import hvd_ext

from helpers.codecs import info


@pytest.mark.parametrize("spec,dtype", [("fp16", torch.float16), ("bf16", torch.bfloat16)])
def test_cast_codecs_round_trip(spec, dtype):
    c = hvd_ext.compression_from_spec(spec)
    t = torch.randn(37, 3)
    payload, ctx = c.compress(t, info(shape=t.shape))
    # both ride on allreduce (Horovod has no bfloat16 collective: the Exchange sums bf16 itself)
    assert c.collective == "allreduce" and c.lossless
    assert payload.dtype == dtype and payload.numel() == t.numel()
    out = c.decompress(payload, ctx, info(shape=t.shape))
    assert out.dtype == torch.float32 and out.shape == t.shape
    tol = 1e-3 if dtype == torch.float16 else 1e-2
    assert torch.allclose(out, t, rtol=tol, atol=tol)
    assert c.wire_bytes(t.numel()) == 2 * t.numel()
