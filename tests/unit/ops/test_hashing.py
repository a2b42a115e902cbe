"""The counter hash (``hvd_ext.ops.hashing``): its three forms (Python ints, int32 tensors, in place)
compute lowbias32, the function ``kernels/common.cuh`` writes as ``mix32``."""
from __future__ import annotations

import torch

from hvd_ext.ops import hashing as H


def _lowbias32_py(x):
    """lowbias32 as published (pins the constants; also written in kernels/common.cuh)."""
    x ^= x >> 16
    x = (x * 0x7FEB352D) % 2 ** 32
    x ^= x >> 15
    x = (x * 0x846CA68B) % 2 ** 32
    return x ^ (x >> 16)


_VALUES = [0, 1, 2, 0x7FFFFFFF, 0x80000000, 0x9E3779B9, 0xFFFFFFFE, 0xFFFFFFFF] + \
    [int(v) for v in torch.randint(0, 2 ** 32, (2000,), generator=torch.Generator().manual_seed(1))]


def test_python_int_form_is_lowbias32():
    assert [H.mix32_int(v) for v in _VALUES] == [_lowbias32_py(v) for v in _VALUES]
    assert H.mix32_int(2 ** 32 + 5) == _lowbias32_py(5)  # taken mod 2^32


def test_tensor_forms_agree_with_the_int_form():
    x = torch.tensor([H.signed32(v) for v in _VALUES], dtype=torch.int32)
    want = [H.mix32_int(v) for v in _VALUES]
    got = H.mix32(x)
    assert got.dtype == torch.int32
    assert (got.to(torch.int64) & H.M32).tolist() == want
    h = x.clone()
    assert torch.equal(H.mix32_(h, torch.empty_like(h)), got) and torch.equal(h, got)


def test_hash32_is_mix_of_index_xor_key():
    key = torch.tensor(H.signed32(0xDEADBEEF), dtype=torch.int32)
    i = torch.arange(1000, dtype=torch.int32)
    got = (H.hash32(i, key).to(torch.int64) & H.M32).tolist()
    assert got == [_lowbias32_py(j ^ 0xDEADBEEF) for j in range(1000)]


def test_signed32():
    assert [H.signed32(v) for v in (0, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFF, 2 ** 32 + 3, -1)] == \
        [0, 0x7FFFFFFF, -2 ** 31, -1, 3, -1]
