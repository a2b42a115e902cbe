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

On a device (``docs/gpu.md``): a bucket's selections are planned together
(``prepare_bucket``) and every data-dependent size among them is read in one
read: exact top-k is ``torch.topk`` (k entries, nothing to read); ``mode=sampled``
takes its threshold from ``kernels.threshold_for`` (two histograms of |x|'s
float bits on the device -- about k entries, not a random sample as on the
host) and ``threshold`` from tau; their counts per tensor are read together,
then ``kernels.compact_ge`` writes the entries. ``aggregate`` is
``kernels.sparse_scatter_add`` (one launch for all ranks on CUDA). Payload
headers and indices from other ranks are checked on the device (an index
outside the tensor raises with the step's checks and is never written).
"""
from __future__ import annotations

import itertools
import math
import zlib
from dataclasses import dataclass, replace
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import torch

from ..ops import cuda_kernels as _K
from ..ops.device import expect, in_range, on_host, read, upload
from ..ops import cpu_kernels as _cpu
from ..ops.select import FP16_MAX, indices_where, topk_indices, topk_small
from .base import Compressor, TensorInfo, from_bytes

CHUNK = 1 << 16
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


def _chunk_counts(idx: torch.Tensor, nchunks: int) -> torch.Tensor:
    """int32 entries per 65536-chunk of ascending indices (``bincount`` reads its size on a device)."""
    hi = idx >> 16
    if on_host(idx):
        return torch.bincount(hi, minlength=nchunks).to(torch.int32)
    return torch.zeros(nchunks, dtype=torch.int32, device=idx.device).scatter_add_(
        0, hi, torch.ones_like(hi, dtype=torch.int32))


def pack(idx: torch.Tensor, vals: torch.Tensor, n: int, vdtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``idx``: ascending int64 indices (unique); ``vals``: their float values."""
    k = int(idx.numel())
    dev = vals.device
    fmt = index_format(n, k)
    if vdtype == torch.float16:
        vals = vals.float().clamp(-FP16_MAX, FP16_MAX).to(torch.float16)
    else:
        vals = vals.to(torch.float32)
    parts = [upload([k], torch.int32, dev).view(torch.uint8)]
    if fmt == "chunk":
        parts.append(_chunk_counts(idx, -(-n // CHUNK)).view(torch.uint8))
    parts.append(vals.contiguous().view(torch.uint8))
    if fmt == "i32":
        parts.append(idx.to(torch.int32).view(torch.uint8))
    elif k:
        # low 16 bits as uint16: int32 -> keep the low half of every element
        low = (idx & 0xFFFF).to(torch.int32)
        low = torch.where(low >= 32768, low - 65536, low).to(torch.int16)
        parts.append(low.view(torch.uint8))
    return torch.cat([p.reshape(-1) for p in parts])


def count_in(nbytes: int, n: int, vbytes: int) -> Optional[int]:
    """k such that ``payload_bytes(n, k, vbytes) == nbytes`` (the size of a payload says how many
    entries it holds), or None when no k gives that size."""
    for per, fixed in ((2 + vbytes, 4), (4 + vbytes, 4), (2 + vbytes, 4 + 4 * -(-n // CHUNK))):
        k, rem = divmod(nbytes - fixed, per)
        if rem == 0 and 0 <= k <= n and payload_bytes(n, k, vbytes) == nbytes:
            return k
    return None


def unpack(data: torch.Tensor, n: int, vdtype: torch.dtype = torch.float32) -> Tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`pack`: (int64 indices, float32 values). Raises ValueError on a bad payload: at
    once for a size that holds no whole payload; for a header or indices that do not match it (an
    index outside [0, n), chunk counts that do not add up) when the step reads its checks on a device
    -- the indices are kept in range meanwhile. The size says k: nothing is read from the device."""
    vbytes = vdtype.itemsize
    k = count_in(int(data.numel()), n, vbytes)
    if k is None:
        raise ValueError(f"sparse payload of {data.numel()} bytes does not hold entries of a tensor of n={n} "
                         f"({4 + 2 * vbytes}.. bytes per entry after a 4-byte header)")
    expect(from_bytes(data, 0, torch.int32, 1)[0][0] == k,
           f"sparse payload: its header disagrees with its size ({data.numel()} bytes, k={k} of n={n})")
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
            expect(counts.sum() == k, "sparse payload: chunk counts do not add up to k")
            hi = torch.repeat_interleave(torch.arange(counts.numel(), device=data.device), counts.clamp(min=0),
                                         output_size=k)
            idx = idx + (hi << 16)
    if k:
        idx = in_range(idx, n, "sparse payload")
    return idx, vals.float()


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
        cand = cand[topk_small(score[cand], k)]
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
    out = _cpu.scratch("sparse/bucket-score", total, torch.float32, dev)
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
    return torch.abs(flat, out=_cpu.scratch("sparse/score", n, flat.dtype, flat.device))


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


# ---- what a bucket selects, selected on the host or on a device ------------------------------------

@dataclass
class Selection:
    """One selection of a bucket: about ``k`` coordinates of ``score`` -- the concatenation of the
    tensors of ``infos`` (``sizes`` elements each) -- split back per tensor. ``how``: ``"exact"``
    top-k, ``"sampled"`` (a threshold from a sample of the score on the host, from a histogram on a
    device) or ``"above"`` (score > ``tau``; k unused). ``stream``: the name of the host sample's
    random stream."""

    infos: List[TensorInfo]
    sizes: List[int]
    score: torch.Tensor
    k: int
    how: str
    tau: float = 0.0
    sample: float = 0.01
    stream: str = ""


def _bounds(sizes: Sequence[int]) -> List[int]:
    out = [0]
    for n in sizes:
        out.append(out[-1] + int(n))
    return out


def _cuts_from_counts(counts: Sequence[int]) -> List[int]:
    return _bounds(counts)


# ---- the compressor base ----------------------------------------------------------------------

class SparseCompressor(Compressor):
    """Base of the index+value sparsifiers: subclasses say what to select (:meth:`selections`).

    ``prepare_bucket`` (called by the pipeline with every (u, info) of a bucket before any
    ``compress``) selects for the whole bucket at once -- budgets that span layers, and on a device
    a single host read for every data-dependent size of the bucket (``docs/gpu.md``); ``compress``
    uses the planned selection. Without a plan ``compress`` selects for its own tensor."""

    collective = "allgather"
    default_feedback = "residual"
    fixed_size = False
    sparse = True
    # the selection of a flat bucket record is made per tensor (its segments), not over the record
    per_segment = False

    def __init__(self, **kw):
        super().__init__(**kw)
        self._plan: Dict[Tuple[str, int], torch.Tensor] = {}

    @property
    def value_dtype(self) -> torch.dtype:
        return _VALUE_DTYPES[getattr(self, "values", "fp32")]

    @property
    def value_bytes(self) -> int:
        return 2 if self.value_dtype == torch.float16 else 4

    def selections(self, items, whole=None) -> Iterator[Selection]:
        """What to select for ``items`` ([(u, info)] of one bucket, or one tensor), one selection at a
        time: the host resolves each before the next is made (scores may share a reused buffer).
        ``whole``: the flat record whose segments ``items`` are -- a selection over all of them may be
        made for it directly (no split by tensor to read back)."""
        raise NotImplementedError

    @property
    def reads_device(self) -> bool:
        """A selection whose size depends on the data (sampled, above a threshold, a budget split by
        the data) reads that size from the device once per bucket."""
        return getattr(self, "mode", "exact") == "sampled"

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

    def _one(self, score: torch.Tensor, info, k: int, how: Optional[str] = None, tau: float = 0.0) -> Selection:
        return Selection([info], [score.numel()], score, k, how or getattr(self, "mode", "exact"), tau=tau,
                         sample=getattr(self, "sample", 0.01))

    def _over(self, items, scores, k: int, how: Optional[str] = None) -> Selection:
        """One selection over the concatenated scores of ``items`` (``scores``: one per item, or their
        concatenation and sizes as :func:`bucket_abs` returns)."""
        if isinstance(scores, tuple):
            cat, sizes = scores
        else:
            sizes = [sc.numel() for sc in scores]
            cat = scores[0] if len(scores) == 1 else torch.cat(scores) if scores else torch.empty(0)
        info0 = items[0][1]
        return Selection([info for _, info in items], sizes, cat, k, how or getattr(self, "mode", "exact"),
                         sample=getattr(self, "sample", 0.01), stream="bucket:" + info0.name)

    def select(self, flat: torch.Tensor, info) -> torch.Tensor:
        """Ascending int64 indices of the coordinates of ``flat`` (float32) to send (no bucket plan)."""
        self._resolve(self.selections([(flat, info)]))
        return self._plan.pop((info.name, info.step))

    def prepare_bucket(self, items):
        """Plan the selections of a bucket (one host read on a device when sizes depend on the data)."""
        self._plan = {}
        if not items:
            return
        if self.per_segment and len(items) == 1 and items[0][1].segments:
            self._plan_flat(*items[0])
            return
        self._resolve(self.selections(items))

    def _plan_flat(self, u, info):
        """A flat bucket record: select per tensor (its ``info.segments``), then join the selections
        into indices of the flat tensor."""
        flat = u.reshape(-1)
        subs, off = [], 0
        for name, n, param in info.segments:
            subs.append((flat[off:off + n], replace(info, name=name, shape=torch.Size([n]), param=param,
                                                   segments=None, base_name=None)))
            off += n
        self._resolve(self.selections(subs, whole=info))
        if (info.name, info.step) in self._plan:  # selected over the record as a whole
            return
        parts, off = [], 0
        for su, si in subs:
            parts.append(self._plan.pop((si.name, si.step)) + off)
            off += su.numel()
        self._plan[(info.name, info.step)] = torch.cat(parts) if parts else \
            torch.empty(0, dtype=torch.long, device=flat.device)

    def _resolve(self, sels: Iterator[Selection]) -> None:
        first = next(sels, None)
        if first is None:
            return
        if on_host(first.score):
            self._resolve_host(itertools.chain([first], sels))
        else:
            self._resolve_device([first] + list(sels))

    def _resolve_host(self, sels: Iterator[Selection]) -> None:
        for s in sels:
            if s.how == "above":
                idx = indices_where(s.score, s.tau, strict=True)
            elif s.how == "sampled":
                idx = sampled_indices(s.score, s.k, self._gen(s.infos[0], s.stream or None), s.sample)
            else:
                idx = topk_indices(s.score, s.k)
            bounds = _bounds(s.sizes)
            if len(s.infos) == 1:
                cuts = [0, idx.numel()]
            else:  # one search for every tensor boundary (idx is ascending)
                cuts = torch.searchsorted(idx, torch.tensor(bounds, dtype=idx.dtype)).tolist() if idx.numel() \
                    else [0] * len(bounds)
            self._store(s, idx, cuts, bounds)

    def _resolve_device(self, sels: List[Selection]) -> None:
        """Every selection's data-dependent sizes in one read: exact top-k has k entries (split by one
        search per tensor boundary), a threshold's count per tensor comes from its mask."""
        staged, reads = [], []
        for s in sels:
            n = s.score.numel()
            bounds = _bounds(s.sizes)
            exact = s.how == "exact" or (s.how == "sampled" and not 0 < s.k < n)
            if exact:
                idx = topk_indices(s.score, s.k)
                staged.append((s, "idx", idx, bounds))
                if len(s.infos) > 1:
                    reads.append(torch.searchsorted(idx, upload(bounds, idx.dtype, idx.device)))
                continue
            if s.how == "above":
                t = torch.full((1,), float(np.nextafter(np.float32(s.tau), np.float32(np.inf))),
                               dtype=torch.float32, device=s.score.device)
            else:
                t, _ = _K.threshold_for(s.score, s.k)
            mask = s.score >= t
            staged.append((s, "mask", t, bounds))
            if len(s.infos) > 1:
                before = torch.cat([mask.new_zeros(1, dtype=torch.int64), torch.cumsum(mask, 0)])
                b = upload(bounds, torch.int64, mask.device)
                reads.append(before.index_select(0, b[1:]) - before.index_select(0, b[:-1]))
            else:
                reads.append(mask.sum().reshape(1))
        got = read(torch.cat(reads)) if reads else []
        pos = 0
        for s, kind, x, bounds in staged:
            m = len(s.infos)
            if kind == "idx":
                if m == 1:
                    cuts = [0, x.numel()]
                else:
                    cuts, pos = got[pos:pos + m + 1], pos + m + 1
                self._store(s, x, cuts, bounds)
                continue
            counts, pos = got[pos:pos + m], pos + m
            idx, _ = _K.compact_ge(s.score, x, sum(counts))
            self._store(s, idx.long(), _cuts_from_counts(counts), bounds)

    def _store(self, s: Selection, idx: torch.Tensor, cuts: Sequence[int], bounds: Sequence[int]) -> None:
        for j, info in enumerate(s.infos):
            self._plan[(info.name, info.step)] = idx[cuts[j]:cuts[j + 1]] - bounds[j]

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
        out = _cpu.empty(info.numel, device=data.device).zero_()
        out[idx] = val
        return out

    def aggregate(self, datas, ctx, info):
        """Scatter-add every rank's (indices, values) into one dense accumulator, in rank order."""
        out = _cpu.empty(info.numel, device=datas[0].device if datas else "cpu").zero_()
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
