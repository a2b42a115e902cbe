"""Helpers shared by the quantizing compressors (not a compressor itself)."""
from __future__ import annotations

import zlib

import torch


def generator(seed: int, step: int, name: str, rank: int, device=None) -> torch.Generator:
    """Counter-based torch.Generator from (seed, step, crc32(name), rank): reproducible runs and
    exact checkpoint/resume without storing RNG state."""
    key = ((seed * 1_000_003 + step) * 1_000_033 + zlib.crc32(name.encode()) * 8191 + rank * 131) \
        & 0x7FFF_FFFF_FFFF_FFFF
    dev = torch.device("cpu") if device is None else torch.device(device)
    g = torch.Generator(device=dev)
    g.manual_seed(key)
    return g


def uniform(n: int, gen: torch.Generator, device) -> torch.Tensor:
    return torch.rand(n, generator=gen, device=gen.device).to(device)


def chunks(numel: int, chunk: int) -> int:
    """Number of chunks of ``chunk`` elements (chunk 0 = the whole tensor, one chunk)."""
    if numel == 0:
        return 0
    if chunk <= 0:
        return 1
    return (numel + chunk - 1) // chunk


def padded_view(flat: torch.Tensor, chunk: int, fill: float = 0.0) -> torch.Tensor:
    """(chunks, chunk) view of ``flat``, padded with ``fill`` at the end."""
    n = flat.numel()
    c = chunk if chunk > 0 else max(n, 1)
    k = chunks(n, c) if n else 0
    if k * c == n:
        return flat.reshape(k, c)
    out = torch.full((k * c,), fill, dtype=flat.dtype, device=flat.device)
    out[:n] = flat
    return out.view(k, c)


def chunk_counts(n: int, chunk: int, device=None) -> torch.Tensor:
    """Elements in each chunk of ``padded_view(flat, chunk)`` (the last one may be short), float32."""
    size = chunk if chunk > 0 else max(n, 1)
    k = chunks(n, chunk)
    counts = torch.full((k,), float(size), device=device)
    if k:
        counts[-1] = n - size * (k - 1)
    return counts


def chunk_means(values: torch.Tensor, chunk: int) -> torch.Tensor:
    """Mean of each chunk of ``chunk`` consecutive elements of the flat ``values``."""
    return padded_view(values, chunk).sum(1) / chunk_counts(values.numel(), chunk, values.device)


def expand_chunks(per_chunk: torch.Tensor, n: int, chunk: int) -> torch.Tensor:
    """Repeat one value per chunk back to ``n`` elements."""
    return per_chunk.repeat_interleave(chunk if chunk > 0 else n)[:n]
