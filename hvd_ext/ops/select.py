"""Index selection on flat score tensors: the threshold mask, exact deterministic top-k.

Shared by the sparsifying codecs (``compression``) and the sparse reduce-scatter route
(``exchange.routes.sparse_rs``), so both select exactly the same entries.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from . import cpu_kernels as _cpu
from .device import on_host

FP16_MAX = 65504.0  # largest finite float16: values are clamped to it before a float16 cast


# ---- selection --------------------------------------------------------------------------

def _mask_ge(score, out, thr, *, strict: bool):
    # where(., 1., 0.) then uint8: inductor's bool -> uint8 conversion is a slow non-vector path
    out.copy_(torch.where(score > thr if strict else score >= thr, 1.0, 0.0).to(torch.uint8))


_MASK_GE = _cpu.Kernel(_mask_ge, "threshold mask")


# From this many elements the word scan beats ``nonzero`` on CPU; below it ``nonzero`` wins
# (benchmarks/throughput.py).
_WORD_SCAN_MIN = 1 << 21


def indices_where(score: torch.Tensor, thr, strict: bool = False) -> torch.Tensor:
    """Ascending int64 indices of ``score >= thr`` (``> thr`` with ``strict``) of a flat tensor.

    CPU: the comparison is one fused pass into a reused byte mask; the mask is then scanned eight
    bytes at a time (the non-zero 64-bit words, then the bytes of those words), so a sparse
    selection costs a pass over n/8 words instead of a ``nonzero`` over n elements."""
    n = score.numel()
    if score.device.type != "cpu" or n < _WORD_SCAN_MIN:
        m = score > thr if strict else score >= thr
        return m.nonzero().squeeze(1)
    buf = _cpu.codes_buffer("sparse/mask", n, score.device)
    t = thr if isinstance(thr, torch.Tensor) else torch.tensor(float(thr), dtype=score.dtype)
    _MASK_GE(n, score.device, score, buf[:n], t.to(score.dtype), strict=strict)
    words = buf.view(torch.int64)
    hit = (words != 0).nonzero().squeeze(1)
    if hit.numel() == 0:
        return hit
    nz = buf.view(-1, 8)[hit].nonzero()
    return hit[nz[:, 0]] * 8 + nz[:, 1]


_CANDIDATES_MIN = 1 << 16  # exact top-k through a candidate threshold from this many elements


def _topk_by_candidates(score: torch.Tensor, k: int) -> Optional[torch.Tensor]:
    """Exact :func:`topk_indices` of a large CPU score without a full ``torch.topk``: a threshold is
    read off an evenly strided sample a little below its expected k-th largest value, every
    element >= it becomes a candidate, and when there are at least k candidates the top-k of the
    candidates (ties to the lowest index) is exactly the top-k of the tensor. None when the sample
    missed (fewer than k candidates, also with NaN/inf scores): the caller takes the full path."""
    n = score.numel()
    if not bool(torch.isfinite(score.sum())):
        return None
    s = min(n, max(1 << 13, (64 * n) // max(k, 1)))  # ~64 k-th-largest hits expected in the sample
    samp = score[:: max(1, n // s)]
    s = samp.numel()
    expect = k * s / n
    for slack in (1.25, 2.0):
        j = min(s, int(math.ceil(expect * slack + 4 * math.sqrt(expect) + 8)))
        if j >= s:
            return None
        thr = torch.topk(samp, j, sorted=False).values.min()
        cand = indices_where(score, thr)
        if cand.numel() >= k:
            if cand.numel() > n // 2:
                return None
            return cand[topk_small(score[cand], k)]
    return None


def topk_indices(score: torch.Tensor, k: int) -> torch.Tensor:
    """Ascending indices of the k largest entries of a flat ``score``.

    Deterministic: among equal scores at the threshold the lowest indices win,
    so the result equals sorting by (score descending, index ascending).
    Large CPU scores go through :func:`_topk_by_candidates` (same result). On a device: ``torch.topk``
    and a sort, no read (ties at the threshold are then torch's choice)."""
    n = score.numel()
    if k >= n:
        return torch.arange(n, device=score.device)
    if k <= 0:
        return torch.empty(0, dtype=torch.long, device=score.device)
    if not on_host(score):
        return torch.topk(score, k, sorted=False).indices.sort().values
    if n >= _CANDIDATES_MIN and 8 * k <= n and score.device.type == "cpu":
        idx = _topk_by_candidates(score, k)
        if idx is not None:
            return idx
    return topk_small(score, k)


def topk_small(score: torch.Tensor, k: int) -> torch.Tensor:
    """:func:`topk_indices` by one ``torch.topk`` and a threshold scan (ties to the lowest index)."""
    n = score.numel()
    if k >= n:
        return torch.arange(n, device=score.device)
    if k <= 0:
        return torch.empty(0, dtype=torch.long, device=score.device)
    thr = torch.topk(score, k, sorted=False).values.min()
    gt = (score > thr).nonzero().squeeze(1)
    need = k - gt.numel()
    eq = (score == thr).nonzero().squeeze(1)[:max(need, 0)]
    if gt.numel() + eq.numel() != k:  # NaN scores: fall back to torch's own choice
        return torch.topk(score, k).indices.sort().values
    return torch.cat([gt, eq]).sort().values
