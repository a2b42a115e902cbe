"""hvd_ext.ops.bits: bit packing and its bit-order contract."""
import math

import pytest
import torch

from hvd_ext.ops.bits import pack_bits, packed_bytes, unpack_bits


@pytest.mark.parametrize("bits", range(1, 9))
def test_pack_unpack_roundtrip(bits):
    g = torch.Generator().manual_seed(bits)
    for n in (0, 1, 7, 8, 9, 63, 1000):
        codes = torch.randint(0, 2 ** bits, (n,), generator=g, dtype=torch.int64).to(torch.uint8)
        if n:
            codes[0] = 2 ** bits - 1  # the largest code survives
        packed = pack_bits(codes, bits)
        assert packed.dtype == torch.uint8 and packed.numel() == packed_bytes(n, bits) == math.ceil(n * bits / 8)
        assert torch.equal(unpack_bits(packed, bits, n), codes)


def test_bit_order_contract():
    # 3-bit codes 1,2,3,4,5: stream bits (LSB of each code first)
    # 100 010 110 001 101 -> byte0 = bits 0..7 = 1,0,0,0,1,0,1,1 = 209; byte1 = 0,0,0,1,1,0,1,0 = 88
    assert pack_bits(torch.tensor([1, 2, 3, 4, 5], dtype=torch.uint8), 3).tolist() == [209, 88]
    assert pack_bits(torch.tensor([1, 0, 1, 1, 0, 0, 0, 0, 1], dtype=torch.uint8), 1).tolist() == [13, 1]
    assert pack_bits(torch.tensor([0x3, 0xA, 0xF], dtype=torch.uint8), 4).tolist() == [0xA3, 0x0F]
    assert pack_bits(torch.tensor([3, 1, 2, 0, 1], dtype=torch.uint8), 2).tolist() == [0b00100111, 0b01]
    # 7-bit: code0 = 0x7F fills bits 0..6, code1 = 1 sets stream bit 7
    assert pack_bits(torch.tensor([0x7F, 1], dtype=torch.uint8), 7).tolist() == [0xFF, 0x00]
    assert unpack_bits(torch.tensor([209, 88], dtype=torch.uint8), 3, 5).tolist() == [1, 2, 3, 4, 5]


def test_pack_bad_arguments():
    c = torch.tensor([1, 2], dtype=torch.uint8)
    for bad in (0, 9, 2.0, True):
        with pytest.raises(ValueError):
            pack_bits(c, bad)
    with pytest.raises(ValueError):
        pack_bits(torch.tensor([4], dtype=torch.uint8), 2)  # code >= 2**bits
    with pytest.raises(ValueError):
        pack_bits(torch.tensor([0.5]), 2)
    with pytest.raises(ValueError):
        unpack_bits(torch.tensor([1], dtype=torch.uint8), 3, 5)  # too short


@pytest.mark.parametrize("bits", range(1, 9))
def test_any_layout_of_the_stream_and_any_integer_codes(bits):
    """unpack_bits reads a strided, offset or longer stream; pack_bits with check=False uses the low
    ``bits`` bits of any integer dtype (as the CUDA kernel does)."""
    g = torch.Generator().manual_seed(10 + bits)
    for n in (0, 1, 5, 8, 13, 64, 333):
        codes = torch.randint(0, 2 ** bits, (n,), generator=g, dtype=torch.int64).to(torch.uint8)
        packed = pack_bits(codes, bits)
        wide = torch.zeros(2 * packed.numel() + 3, dtype=torch.uint8)
        wide[1::2][:packed.numel()] = packed
        for stream in (wide[1::2], torch.cat([torch.ones(1, dtype=torch.uint8), packed, packed])[1:]):
            assert torch.equal(unpack_bits(stream, bits, n), codes)
        noise = torch.randint(-300, 300, (n,), generator=g) * (1 << bits)  # high bits only
        for dtype in (torch.int64, torch.int32, torch.int16):
            assert torch.equal(pack_bits((noise + codes).to(dtype), bits, check=False), packed)
        assert torch.equal(pack_bits(codes | (0xFF ^ ((1 << bits) - 1)), bits, check=False), packed)
