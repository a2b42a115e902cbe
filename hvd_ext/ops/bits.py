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

Implementation (written here only; ``ops.cpu_kernels`` runs the same word-level functions
compiled): 8 codes always fill exactly ``bits`` bytes. The 8 codes of a group are written one per
byte, zero-padded to a multiple of 8, so that the int64 view of those bytes holds the group, code t
in byte t (little-endian). :func:`squeeze_words` squeezes the low ``bits`` bits of those bytes
together (three shift-or-mask steps: pairs, quads, octets) into the group's ``8 * bits``-bit field
``c_0 | c_1 << bits | ... | c_7 << 7 bits``, whose low ``bits`` bytes are the group's bytes under the
contract; :func:`expand_words` runs the steps backwards. Every load and store is contiguous, so the
compiled loops vectorise (no per-element division, no gather). ``bits == 8`` is the identity.
"""
from __future__ import annotations

from typing import Callable

import torch

__all__ = ["pack_bits", "unpack_bits", "packed_bytes", "squeeze_words", "expand_words", "pack_words",
           "unpack_words", "words_to_bytes", "bytes_to_words", "WORD_DTYPE"]


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
    # only the low ``bits`` bits of a code are used (as in the CUDA kernel); with check=False an
    # out-of-range code cannot spill into its neighbours (squeeze_words masks the bytes of uint8 codes)
    buf = torch.zeros(8 * ((n + 7) // 8), dtype=torch.uint8, device=flat.device)
    buf[:n] = flat if flat.dtype == torch.uint8 else flat & ((1 << bits) - 1)
    return words_to_bytes(pack_words(buf.view(torch.int64), bits), bits, packed_bytes(n, bits))


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
    g = (n + 7) // 8

    def buffer(tag: str, numel: int) -> torch.Tensor:
        return torch.empty(numel, dtype=torch.uint8, device=flat.device)
    words = bytes_to_words(flat[:need], bits, g, buffer)
    return unpack_words(words, bits).view(torch.uint8)[:n]


# ---- word level: eight codes per 64-bit word (the packing arithmetic) ------------------------------

def _masks(bits: int):
    """(low ``bits`` of each byte, of each 16-bit lane; low 2*bits of each 32-bit lane; low 4*bits)."""
    return (0x0101010101010101 * ((1 << bits) - 1), 0x0001000100010001 * ((1 << bits) - 1),
            0x0000000100000001 * ((1 << 2 * bits) - 1), (1 << 4 * bits) - 1)


def squeeze_words(w: torch.Tensor, bits: int) -> torch.Tensor:
    """int64 words of 8 one-byte codes -> int64 words holding the 8*bits-bit packed group (bits < 8)."""
    m0, a, b, c = _masks(bits)
    w = w & m0
    w = (w & a) | (((w >> 8) & a) << bits)
    w = (w & b) | (((w >> 16) & b) << 2 * bits)
    return (w & c) | (((w >> 32) & c) << 4 * bits)


def expand_words(v: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of :func:`squeeze_words`: int64 packed groups -> int64 words of 8 one-byte codes."""
    m0, a, b, c = _masks(bits)
    v = (v & c) | (((v >> 4 * bits) & c) << 32)
    v = (v & b) | (((v >> 2 * bits) & b) << 16)
    return (v & a) | (((v >> bits) & a) << 8)


# a group of 1, 2 or 4 bytes is one word of this dtype; 3, 5, 6 or 7 bytes sit in an int64 word
WORD_DTYPE = {1: torch.uint8, 2: torch.int16, 4: torch.int32}


def pack_words(w: torch.Tensor, bits: int) -> torch.Tensor:
    """int64 words of 8 one-byte codes -> one packed word per group (:data:`WORD_DTYPE`, else int64)."""
    v = squeeze_words(w, bits)
    return v.to(WORD_DTYPE[bits]) if bits in WORD_DTYPE else v


def unpack_words(d: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of :func:`pack_words`: packed words (from :func:`bytes_to_words`) -> int64 words of 8
    one-byte codes."""
    return expand_words(d.to(torch.int64) & ((1 << 8 * bits) - 1), bits)


def words_to_bytes(v: torch.Tensor, bits: int, nbytes: int) -> torch.Tensor:
    """The first ``nbytes`` bytes of the stream of :func:`pack_words`' words ``v`` (uint8, a view of
    ``v`` when its groups are whole words)."""
    if bits in WORD_DTYPE:
        return v.view(torch.uint8)[:nbytes]
    return v.view(torch.uint8).view(-1, 8)[:, :bits].reshape(-1)[:nbytes]


def bytes_to_words(d: torch.Tensor, bits: int, g: int, buffer: Callable[[str, int], torch.Tensor]) -> torch.Tensor:
    """The packed stream ``d`` (uint8, 1-D) as the ``g`` words :func:`unpack_words` takes, zero past
    the stream. ``buffer(tag, numel)`` gives the uint8 temporaries (tags ``"/in"``, ``"/grid"``);
    ``d`` itself is viewed when it holds whole, aligned words."""
    nbytes = d.numel()
    if bits in WORD_DTYPE:
        if nbytes != g * bits or d.storage_offset() % bits or d.stride(0) != 1:
            pad = buffer("/in", g * bits)
            pad[nbytes:].zero_()
            pad[:nbytes].copy_(d)
            d = pad
        return d.view(WORD_DTYPE[bits])
    pad = buffer("/in", 8 * g)
    pad[nbytes:].zero_()  # bytes past the stream, then each group's bytes moved to an 8-byte slot
    pad[:nbytes].copy_(d)
    grid = buffer("/grid", 8 * g).view(g, 8)
    grid[:, bits:].zero_()
    grid[:, :bits].copy_(pad[:g * bits].view(g, bits))
    return grid.view(torch.int64).view(-1)
