"""Shared machinery of the sparsification family (topk, threshold, dgc, sig).

Selection (deterministic, ties broken by the lowest index):

* :func:`topk_indices` -- exact top-k of a score (Aji & Heafield 2017; Stich et al. 2018);
* :func:`sampled_indices` -- DGC-style threshold estimated on a random sample
  of the score (Lin et al., ICLR 2018), one pass over the tensor plus at most
  one refinement when the count is far off.

Wire format of one tensor's payload (little endian, one flat ``uint8`` tensor)::

    i32 k | [i32 count per 65536-chunk]  (only in "chunk" format)
          | k values (fp32, or fp16 when values=fp16)
          | k indices, ascending: u16 ("u16" format, n <= 65536),
                                  u16 low 16 bits ("chunk" format, the chunk counts give the high bits),
                                  i32 ("i32" format, when that is smaller than "chunk")

The format is a function of (n, k) only, so the exact byte count is
``payload_bytes(n, k, value_bytes)``. Values come before indices so the fp32
values are 4-byte aligned; the exchange pads every payload to 4 bytes.

GPU kernels (``hvd_ext.kernels``; the torch code here runs on CPU, or when
``HVD_EXT_KERNELS=reference`` / ``kernels.use_reference(True)``):

* ``aggregate`` always goes through ``kernels.sparse_scatter_add`` (one launch
  for all ranks on CUDA; its torch path is the same ``index_add_`` per rank);
* ``mode=sampled`` selection on a CUDA float32 score uses
  ``kernels.select_threshold`` (sampled threshold, histogram refinement and a
  block-scan compaction: no sort, no top-k of the tensor), seeded by
  ``derive_seed(seed, name, rank) ^ step``, then trimmed to the exact top-k of
  the selected when it holds more than 1.3k, so the [k/2, 1.3k] count of the
  torch path holds on both. The torch path draws its sample with a
  ``torch.Generator``, the kernel with a counter hash: CPU and GPU select by
  the same rule but not the same sample.
"""
from __future__ import annotations

import math
import zlib
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from .. import kernels as _K
from . import _fast
from .base import Compressor, from_bytes

CHUNK = 1 << 16
FP16_MAX = 65504.0
_VALUE_DTYPES = {"fp32": torch.float32, "fp16": torch.float16}


def count_for(ratio: float, numel: int) -> int:
    """k = ceil(ratio * n), at least 1 for a non-empty tensor, at most n."""
    return min(numel, max(1, math.ceil(ratio * numel))) if numel else 0


# ---- wire format -----------------------------------------------------------------------

def index_format(n: int, k: int) -> str:
    if n <= CHUNK:
        return "u16"
    nchunks = -(-n // CHUNK)
    return "i32" if 4 * k <= 4 * nchunks + 2 * k else "chunk"


def index_bytes(n: int, k: int) -> int:
    fmt = index_format(n, k)
    if fmt == "u16":
        return 2 * k
    if fmt == "i32":
        return 4 * k
    return 4 * (-(-n // CHUNK)) + 2 * k


def payload_bytes(n: int, k: int, value_bytes: int) -> int:
    """Exact size of a payload carrying k of n coordinates."""
    return 4 + index_bytes(n, k) + k * value_bytes


def pack(idx: torch.Tensor, vals: torch.Tensor, n: int, vdtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``idx``: ascending int64 indices (unique); ``vals``: their float values."""
    k = int(idx.numel())
    dev = vals.device
    fmt = index_format(n, k)
    if vdtype == torch.float16:
        vals = vals.float().clamp(-FP16_MAX, FP16_MAX).to(torch.float16)
    else:
        vals = vals.to(torch.float32)
    parts = [torch.tensor([k], dtype=torch.int32).view(torch.uint8).to(dev)]
    if fmt == "chunk":
        nchunks = -(-n // CHUNK)
        counts = torch.bincount(idx >> 16, minlength=nchunks).to(torch.int32)
        parts.append(counts.view(torch.uint8))
    parts.append(vals.contiguous().view(torch.uint8))
    if fmt == "i32":
        parts.append(idx.to(torch.int32).view(torch.uint8))
    elif k:
        # low 16 bits as uint16: int32 -> keep the low half of every element
        low = (idx & 0xFFFF).to(torch.int32)
        low = torch.where(low >= 32768, low - 65536, low).to(torch.int16)
        parts.append(low.view(torch.uint8))
    return torch.cat([p.reshape(-1) for p in parts])


def unpack(data: torch.Tensor, n: int, vdtype: torch.dtype = torch.float32) -> Tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`pack`: (int64 indices, float32 values). Raises ValueError on a bad payload."""
    if data.numel() < 4:
        raise ValueError(f"sparse payload of {data.numel()} bytes is shorter than its 4-byte header")
    k = int(from_bytes(data, 0, torch.int32, 1)[0].item())
    vbytes = vdtype.itemsize
    if not 0 <= k <= n or data.numel() != payload_bytes(n, k, vbytes):
        raise ValueError(f"sparse payload of {data.numel()} bytes does not hold k={k} of n={n} coordinates "
                         f"({'-' if not 0 <= k <= n else payload_bytes(n, k, vbytes)} bytes expected)")
    fmt = index_format(n, k)
    off = 4
    counts = None
    if fmt == "chunk":
        counts, off = from_bytes(data, off, torch.int32, -(-n // CHUNK))
    vals, off = from_bytes(data, off, vdtype, k)
    if fmt == "i32":
        idx, off = from_bytes(data, off, torch.int32, k)
        idx = idx.long()
    else:
        low, off = from_bytes(data, off, torch.int16, k)
        idx = low.long() & 0xFFFF
        if counts is not None:
            counts = counts.long()
            if int(counts.sum().item()) != k:
                raise ValueError("sparse payload: chunk counts do not add up to k")
            hi = torch.repeat_interleave(torch.arange(counts.numel(), device=data.device), counts)
            idx = idx + (hi << 16)
    return idx, vals.float()


# ---- selection --------------------------------------------------------------------------

def _mask_ge(score, out, thr, *, strict: bool):
    # where(., 1., 0.) then uint8: inductor's bool -> uint8 conversion is a slow non-vector path
    out.copy_(torch.where(score > thr if strict else score >= thr, 1.0, 0.0).to(torch.uint8))


_MASK_GE = _fast.Kernel(_mask_ge, "threshold mask")


# From this many elements the word scan beats ``nonzero`` (one thread: 4M 8.2 vs 9.6 ms, 16M 23.6 vs
# 27.7 ms; below it ``nonzero`` wins: 0.3M 0.57 vs 1.05 ms, 0.7M 1.48 vs 2.71 ms).
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
    buf = _fast.codes_buffer("sparse/mask", n, score.device)
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
            return cand[_topk_small(score[cand], k)]
    return None


def topk_indices(score: torch.Tensor, k: int) -> torch.Tensor:
    """Ascending indices of the k largest entries of a flat ``score``.

    Deterministic: among equal scores at the threshold the lowest indices win,
    so the result equals sorting by (score descending, index ascending).
    Large CPU scores go through :func:`_topk_by_candidates` (same result)."""
    n = score.numel()
    if k >= n:
        return torch.arange(n, device=score.device)
    if k <= 0:
        return torch.empty(0, dtype=torch.long, device=score.device)
    if n >= _CANDIDATES_MIN and 8 * k <= n and score.device.type == "cpu":
        idx = _topk_by_candidates(score, k)
        if idx is not None:
            return idx
    return _topk_small(score, k)


def _topk_small(score: torch.Tensor, k: int) -> torch.Tensor:
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


def generator(seed: int, step: int, name: str, rank: int) -> torch.Generator:
    """Counter-based generator: the same (seed, step, name, rank) draws the same sample."""
    g = torch.Generator()
    key = (seed * 1_000_003 + step) * 1_000_033 + zlib.crc32(name.encode()) * 8191 + rank
    g.manual_seed(key & 0x7FFF_FFFF_FFFF_FFFF)
    return g


# Refinement bounds for the sampled threshold: keep the count in [LOW*k, HIGH*k].
SAMPLED_LOW = 0.5
SAMPLED_HIGH = 1.3
_MIN_SAMPLED_HITS = 32  # sample so that about this many sampled entries lie above the threshold


def sampled_indices(score: torch.Tensor, k: int, gen: torch.Generator, sample: float = 0.01) -> torch.Tensor:
    """Ascending indices of about k large entries, by a threshold estimated on a sample (DGC).

    Draws ``max(sample * n, 32 n / k)`` entries (with replacement), takes the
    threshold that keeps k*s/n of them, and selects ``score >= threshold`` in
    one pass. One refinement when the count is far off: more than 1.3k ->
    exact top-k among the candidates (k of them, ties to the lowest index);
    fewer than k/2 -> a lower threshold from the same sample, trimmed to k if it
    then overshoots. Falls back to exact top-k when the sample would be at
    least half the tensor."""
    n = score.numel()
    if k >= n or k <= 0:
        return topk_indices(score, k)
    s = max(math.ceil(sample * n), math.ceil(_MIN_SAMPLED_HITS * n / k))
    if 2 * s >= n:
        return topk_indices(score, k)
    pos = torch.randint(0, n, (s,), generator=gen).to(score.device)
    samp = score[pos]
    ks = max(1, min(s, round(k * s / n)))
    vals = torch.topk(samp, min(s, 4 * ks), sorted=True).values  # enough to lower the threshold once

    def pick(j: int) -> torch.Tensor:
        thr = vals[min(j, vals.numel()) - 1]
        return indices_where(score, thr)

    cand = pick(ks)
    c = cand.numel()
    if c < SAMPLED_LOW * k:
        # lower the threshold in proportion to the shortfall (at most 4x more sampled hits)
        cand = pick(min(vals.numel(), math.ceil(ks * k / max(c, 1))))
        c = cand.numel()
    if c > SAMPLED_HIGH * k:
        cand = cand[_topk_small(score[cand], k)]
    return cand


def bucket_abs(items) -> Tuple[torch.Tensor, List[int]]:
    """(|u| of a bucket's tensors concatenated as float32, their sizes): on CPU from 64k elements
    written straight into a reused buffer (valid until the next call on this thread), instead of one
    fresh |u| per tensor and a fresh concatenation."""
    sizes = [u.numel() for u, _ in items]
    total = sum(sizes)
    dev = items[0][0].device if items else torch.device("cpu")
    if dev.type != "cpu" or total < (1 << 16):
        parts = [u.reshape(-1).float().abs() for u, _ in items]
        return (torch.cat(parts) if parts else torch.empty(0)), sizes
    out = _fast.scratch("sparse/bucket-score", total, torch.float32, dev)
    off = 0
    for (u, _), n in zip(items, sizes):
        torch.abs(u.reshape(-1).float(), out=out[off:off + n])
        off += n
    return out, sizes


def abs_score(flat: torch.Tensor) -> torch.Tensor:
    """|flat| as a selection score; for large CPU tensors in a reused buffer (valid until the next
    call on this thread), which saves mapping a fresh dense tensor every step."""
    n = flat.numel()
    if flat.device.type != "cpu" or n < (1 << 16):
        return flat.abs()
    return torch.abs(flat, out=_fast.scratch("sparse/score", n, flat.dtype, flat.device))


def split_budget(total: int, weights: Sequence[float], sizes: Sequence[int]) -> List[int]:
    """Split ``total`` coordinates over layers in proportion to ``weights``, each at most its size.

    Water-filling: layers whose share exceeds their size are filled and the
    rest is re-split; the final integer split uses largest remainders (ties to
    the earlier layer). Non-positive or non-finite total weight -> split by size."""
    L = len(sizes)
    alloc = [0] * L
    w = [float(x) if math.isfinite(float(x)) and float(x) > 0 else 0.0 for x in weights]
    free = [i for i in range(L) if sizes[i] > 0]
    rem = min(int(total), sum(int(s) for s in sizes))
    while rem > 0 and free:
        wsum = sum(w[i] for i in free)
        ww = {i: (w[i] if wsum > 0 else float(sizes[i])) for i in free}
        wsum = sum(ww.values())
        q = {i: rem * ww[i] / wsum for i in free}
        capped = [i for i in free if q[i] >= sizes[i] - alloc[i]]
        if capped:
            for i in capped:
                rem -= sizes[i] - alloc[i]
                alloc[i] = sizes[i]
            free = [i for i in free if i not in capped]
            continue
        fl = {i: int(math.floor(q[i])) for i in free}
        for i in free:
            alloc[i] += fl[i]
        left = rem - sum(fl.values())
        for i in sorted(free, key=lambda i: (-(q[i] - fl[i]), i))[:left]:
            alloc[i] += 1
        rem = 0
    return alloc


# ---- the compressor base ----------------------------------------------------------------------

class SparseCompressor(Compressor):
    """Base of the index+value sparsifiers: subclasses implement :meth:`select`.

    ``prepare_bucket`` (called by the pipeline with every (u, info) of a bucket
    before any ``compress``) may plan per-tensor selections for budgets that
    span layers; ``compress`` uses a planned selection when there is one."""

    exchange = "allgather"
    default_feedback = "residual"
    fixed_size = False
    sparse = True

    def __init__(self, **kw):
        super().__init__(**kw)
        self._plan: Dict[Tuple[str, int], torch.Tensor] = {}

    @property
    def value_dtype(self) -> torch.dtype:
        return _VALUE_DTYPES[getattr(self, "values", "fp32")]

    @property
    def value_bytes(self) -> int:
        return 2 if self.value_dtype == torch.float16 else 4

    def select(self, flat: torch.Tensor, info) -> torch.Tensor:
        """Ascending int64 indices of the coordinates of ``flat`` (float32) to send."""
        raise NotImplementedError

    # Whether the codec selects over a whole bucket (topk scope=model; sig, which budgets per tensor
    # from the flat record's segments); see ``bucket_flat``.
    def _selects_over_bucket(self) -> bool:
        return False

    @property
    def bucket_flat(self) -> bool:
        """The pipeline may hand a bucket over as one flat record (one payload per bucket), with the
        feedbacks that work per coordinate on what was sent (none, residual, ewma)."""
        return self._selects_over_bucket() and getattr(self.feedback, "name", "none") in ("none", "residual", "ewma")

    def _gen(self, info, name: Optional[str] = None) -> torch.Generator:
        return generator(getattr(self, "seed", 0), info.step, name or info.name, info.rank)

    def _sampled(self, score: torch.Tensor, k: int, info, name: Optional[str] = None,
                 sample: Optional[float] = None) -> torch.Tensor:
        """``mode=sampled`` selection: :func:`sampled_indices` (torch), or ``kernels.select_threshold``
        when the kernels run for ``score`` (a CUDA float32 tensor, CuPy present, not forced off)."""
        sample = getattr(self, "sample", 0.01) if sample is None else sample
        n = score.numel()
        if (0 < k < n < 2 ** 31 and score.dtype == torch.float32 and _K.backend(score) == "cuda"):
            seed = _K.derive_seed(getattr(self, "seed", 0), name or info.name, info.rank) ^ (int(info.step) & 0xFFFFFFFF)
            idx, _ = _K.select_threshold(score, k, sample_ratio=sample, seed=seed)
            cand = idx.long()
            if cand.numel() > SAMPLED_HIGH * k:      # the kernel allows 2k; keep the torch path's bound
                cand = cand[topk_indices(score.reshape(-1)[cand], k)]
            return cand
        return sampled_indices(score, k, self._gen(info, name), sample)

    def compress(self, tensor, info):
        flat = tensor.reshape(-1)
        if flat.dtype != torch.float32:
            flat = flat.float()
        idx = self._plan.pop((info.name, info.step), None)
        if idx is None:
            idx = self.select(flat, info)
        info.sparse_indices = idx
        vals = flat[idx]
        payload = pack(idx, vals, flat.numel(), self.value_dtype)
        if self.value_dtype != torch.float32:
            vals = vals.clamp(-FP16_MAX, FP16_MAX).to(self.value_dtype).float()
        info.sent_entries = (payload, idx, vals)
        return payload, None

    def _entries(self, data, info):
        """(indices, values) of a payload; this rank's own payload is read from ``info.sent_entries``."""
        own = info.sent_entries
        if own is not None and own[0] is data:
            return own[1], own[2]
        return unpack(data, info.numel, self.value_dtype)

    def sparse_entries(self, payload, ctx, info):
        return self._entries(payload, info)

    def decode(self, data, ctx, info):
        idx, val = self._entries(data, info)
        out = _fast.empty(info.numel, device=data.device).zero_()
        out[idx] = val
        return out

    def aggregate(self, datas, ctx, info):
        """Scatter-add every rank's (indices, values) into one dense accumulator, in rank order."""
        out = _fast.empty(info.numel, device=datas[0].device if datas else "cpu").zero_()
        idxs, vals = [], []
        own = info.sent_entries
        for r, d in enumerate(datas):
            if own is not None and r == info.rank and d.numel() == own[0].numel():
                idx, val = own[1], own[2]  # this rank's payload, as it packed it (same bytes)
            else:
                idx, val = self._entries(d, info)
            idxs.append(idx)
            vals.append(val)
        # CUDA: one scatter-add launch for all ranks (float atomics); else index_add_ per rank in order
        return _K.sparse_scatter_add(out, idxs, vals, 1.0)

    def support(self, datas, ctx, info):
        mask = torch.zeros(info.numel, dtype=torch.bool, device=datas[0].device if datas else "cpu")
        for d in datas:
            idx, _ = unpack(d, info.numel, self.value_dtype)
            mask[idx] = True
        return mask

    def local_contribution(self, payload, ctx, info, result):
        return self.decode(payload, ctx, info)

    # ---- budgets spanning the layers of a bucket --------------------------------------------
    def _plan_global(self, items, scores, total_k: int, mode: str, sample: float) -> None:
        """One selection over the concatenated scores of a bucket, split back per tensor. ``scores``:
        one score per tensor, or (their concatenation, sizes) as :func:`bucket_abs` returns."""
        if isinstance(scores, tuple):
            cat, sizes = scores
        else:
            sizes = [s.numel() for s in scores]
            cat = scores[0] if len(scores) == 1 else torch.cat(scores) if scores else torch.empty(0)
        if mode == "sampled":
            info0 = items[0][1]
            sel = self._sampled(cat, total_k, info0, "bucket:" + info0.name, sample)
        else:
            sel = topk_indices(cat, total_k)
        starts = [0]
        for n in sizes:
            starts.append(starts[-1] + n)
        # one search for every tensor boundary (sel is ascending)
        bounds = torch.tensor(starts, dtype=sel.dtype, device=sel.device)
        cuts = torch.searchsorted(sel, bounds).tolist() if sel.numel() else [0] * len(starts)
        for j, (u, info) in enumerate(items):
            self._plan[(info.name, info.step)] = sel[cuts[j]:cuts[j + 1]] - starts[j]
