"""hvd_ext.compression.base: the byte helpers of the codec contract."""
import pytest
import torch

from hvd_ext.compression.base import as_bytes, from_bytes


def test_bytes_helpers_alignment():
    idx = torch.arange(5, dtype=torch.int32)
    val = torch.randn(5)
    buf = as_bytes(idx, val)
    assert buf.numel() == 40
    odd = torch.cat([torch.zeros(1, dtype=torch.uint8), buf])  # misaligned by one byte
    got_idx, off = from_bytes(odd, 1, torch.int32, 5)
    got_val, _ = from_bytes(odd, off, torch.float32, 5)
    assert torch.equal(got_idx, idx) and torch.equal(got_val, val)
    with pytest.raises(ValueError):
        from_bytes(buf, 0, torch.float32, 11)
