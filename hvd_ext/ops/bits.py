"""Dense b-bit packing of integer codes into bytes: THE torch reference implementation.

This module is the single torch implementation of the bit-packing contract;
``hvd_ext.ops.cuda_kernels.pack_bits_reference`` / ``unpack_bits_reference`` delegate
here, and ``hvd_ext.ops.cuda_kernels.pack_bits`` / ``unpack_bits`` (which compressors
call) run the CUDA kernel for CUDA ``uint8`` tensors and this code otherwise.

``pack_bits(codes, bits)`` turns ``n`` codes (``uint8``, each ``< 2**bits``,
``bits`` in 1..8) into exactly ``ceil(n * bits / 8)`` bytes;
``unpack_bits(data, bits, n)`` inverts it.

Bit order contract (shared with the CUDA kernels in ``kernels/``): the bytes
form one little-endian bitstream; code ``i`` occupies stream bits
``[i*bits, (i+1)*bits)``, least-significant bit of the code first; stream bit
``j`` is bit ``j % 8`` (value ``1 << (j % 8)``) of byte ``j // 8``. Unused
high bits of the last byte are zero.

Wire bytes: ``packed_bytes(n, bits) = ceil(n * bits / 8)``.

Implementation: 8 codes always fill exactly ``bits`` bytes, so codes are
grouped in eights, combined into one 64-bit word (``bits * 8 <= 56`` bits for
bits < 8) and the word's low ``bits`` bytes are emitted little-endian.
``bits == 8`` is the identity.
"""
from __future__ import annotations

import torch

__all__ = ["pack_bits", "unpack_bits", "packed_bytes"]


def _check_bits(bits) -> int:
    if isinstance(bits, bool) or not isinstance(bits, int) or not 1 <= bits <= 8:
        raise ValueError(f"bits must be an int in 1..8, got {bits!r}")
    return bits


def packed_bytes(n: int, bits: int) -> int:
    """Exact number of bytes ``pack_bits`` produces for ``n`` codes."""
    _check_bits(bits)
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    return (n * bits + 7) // 8


def pack_bits(codes: torch.Tensor, bits: int, check: bool = True) -> torch.Tensor:
    """Pack integer codes (< 2**bits) densely into a flat ``uint8`` tensor of ceil(n*bits/8) bytes.

    ``check=True`` raises ValueError for codes outside [0, 2**bits); ``check=False`` skips the
    check (no device->host sync) and uses the low ``bits`` bits of each code."""
    _check_bits(bits)
    if not isinstance(codes, torch.Tensor):
        raise ValueError(f"codes must be a torch.Tensor, got {type(codes).__name__}")
    if codes.is_floating_point() or codes.is_complex() or codes.dtype == torch.bool:
        raise ValueError(f"codes must be an integer tensor, got {codes.dtype}")
    flat = codes.reshape(-1)
    n = flat.numel()
    if check and n and (int(flat.min()) < 0 or int(flat.max()) >= (1 << bits)):
        raise ValueError(f"codes must lie in [0, {1 << bits}) for bits={bits}")
    if bits == 8:
        return flat.to(torch.uint8).clone()
    groups = (n + 7) // 8
    c = torch.zeros(groups * 8, dtype=torch.int64, device=flat.device)
    # only the low ``bits`` bits of a code are used (as in the CUDA kernel); a no-op for codes
    # in range, and with check=False an out-of-range code cannot spill into its neighbours
    c[:n] = flat.to(torch.int64) & ((1 << bits) - 1)
    c = c.view(groups, 8)
    shifts = torch.arange(8, device=flat.device, dtype=torch.int64) * bits
    word = (c << shifts).sum(dim=1)  # disjoint bit fields: sum == bitwise or
    byte_shifts = torch.arange(bits, device=flat.device, dtype=torch.int64) * 8
    out = ((word.unsqueeze(1) >> byte_shifts) & 0xFF).to(torch.uint8).reshape(-1)
    return out[:packed_bytes(n, bits)].contiguous()


def unpack_bits(data: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: the first ``n`` codes (``uint8``) of a packed stream."""
    _check_bits(bits)
    if not isinstance(data, torch.Tensor) or data.dtype != torch.uint8:
        raise ValueError("data must be a uint8 torch.Tensor")
    need = packed_bytes(n, bits)
    flat = data.reshape(-1)
    if flat.numel() < need:
        raise ValueError(f"packed data too short: {flat.numel()} bytes for {n} codes of {bits} bits "
                         f"(need {need})")
    if bits == 8:
        return flat[:n].clone()
    groups = (n + 7) // 8
    b = torch.zeros(groups * bits, dtype=torch.int64, device=flat.device)
    b[:need] = flat[:need].to(torch.int64)
    b = b.view(groups, bits)
    byte_shifts = torch.arange(bits, device=flat.device, dtype=torch.int64) * 8
    word = (b << byte_shifts).sum(dim=1)
    shifts = torch.arange(8, device=flat.device, dtype=torch.int64) * bits
    codes = (word.unsqueeze(1) >> shifts) & ((1 << bits) - 1)
    return codes.reshape(-1)[:n].to(torch.uint8)
