"""Sparse reduce-scatter for the top-k family (topk, dgc, sig, threshold, randomk).

gTop-k (Shi et al., "A distributed synchronous SGD algorithm with global
top-k sparsification", ICDCS 2019) and Ok-Topk (Li & Hoefler, PPoPP 2022):
instead of allgathering every rank's k (index, value) pairs -- (N-1)k pairs
received per rank -- route each pair to the owner of its index range:

1. each rank selects its entries as usual (the compressor, after error
   feedback); the bucket's index space [0, n) is split into N owner ranges and
   one variable-split ``alltoall`` sends every pair to its owner (indices
   relative to the range: 16 bits when the range has at most 65536 entries);
2. the owner sums what it received, adds its owner-side residual, keeps the
   ``ceil(received / N)`` largest entries (about k/N: the global budget stays
   about k) and remembers the rest; one ``allgather`` of the owners'
   selections gives every rank the same sparse sum.

Received per rank: about k pairs in each phase, flat in N. :func:`expected_wire` gives the bytes
a rank counts when the entries fall evenly (the planner and ``compression="auto"`` predict with it).

Rebalancing: the owner ranges start equal. Every ``REBALANCE_EVERY`` steps,
if the entries of the (identical) global result fall unevenly on the owners
(max > 1.5 x mean), the ranges are moved to the quantiles of those entries'
positions -- the same decision on every rank, since all hold the same result.
Owner residual left outside a rank's new range is sent to its new owner with
the next step's pairs, so nothing is lost (the pass over the bucket that finds it runs only where a
range may have moved: after a rebalance, a load of the memory, a change of world).

Host reads (``docs/gpu.md``): one per step, in ``start`` -- the owner ranges, how many pairs go to
each owner and how many carried residual entries there are, in one read (the alltoall's split
sizes must be known on the host). The rebalancing decision stays on the device until then; the
received pairs are counted from the frames' sizes, which the transport knows.
"""
from __future__ import annotations

import math
import time
from typing import Sequence, Tuple

import torch

from ...compression.base import from_bytes
from ...ops.device import compact, in_range, read, upload
from ...ops.select import FP16_MAX, topk_indices
from ..core import frame_size
from ..transport import offsets, split_sizes
from .base import OwnerMemory, Route, register, segments

REBALANCE_EVERY = 16
IMBALANCE = 1.5


def _index_dtype(span: int) -> torch.dtype:
    return torch.int16 if span <= 65536 else torch.int32


def pair_bytes(span: int, value_dtype: torch.dtype) -> int:
    """Bytes of one (value, index) pair for an owner range of ``span`` entries."""
    return (2 if value_dtype == torch.float16 else 4) + (2 if _index_dtype(span) == torch.int16 else 4)


def expected_wire(sizes: Sequence[int], selected: Sequence[float], size: int, value_dtype: torch.dtype) -> float:
    """Bytes one rank counts on the wire per step (the ranks' mean) for a bucket of tensors of ``sizes``
    entries, of which every rank selects ``selected[t]`` from tensor t, spread evenly over it (one
    selection over the bucket: one size and its count). The even owner ranges then hold c_j entries
    of each rank. Phase 1 sends c_j pairs to each other owner j (``value_dtype`` values, indices 16
    or 32 bits by the range's span), counted as the larger of a rank's sent and received bytes (an
    alltoall), so an owner holding more entries than the others (small tensors' minimum of one)
    counts more; phase 2 gathers every other owner's ceil(c_j) float32 pairs (counted as received,
    an allgather's bytes); one frame per message."""
    N = size
    if N < 2:
        return 0.0
    spans = split_sizes(sum(sizes), N)
    # each owner range's share of every tensor it overlaps (the pieces the two-phase route cuts)
    counts = [sum(selected[i] * (b - a) / sizes[i] for i, a, b in shard) for shard in segments(list(sizes), N)]
    frame = frame_size([0])  # a frame of one payload: header + length, then the payload's bytes
    first = [frame + c * pair_bytes(sp, value_dtype) for c, sp in zip(counts, spans)]
    second = [frame + math.ceil(c - 1e-9) * pair_bytes(sp, torch.float32) for c, sp in zip(counts, spans)]
    sum1, sum2 = sum(first), sum(second)
    return sum(max(sum1 - first[r], (N - 1) * first[r]) + sum2 - second[r] for r in range(N)) / N


def encode_pairs(idx: torch.Tensor, vals: torch.Tensor, span: int, value_dtype: torch.dtype) -> torch.Tensor:
    """[values][indices] as bytes; indices relative to an owner range of ``span`` entries."""
    if vals.numel() == 0:
        return torch.empty(0, dtype=torch.uint8, device=vals.device)
    if value_dtype == torch.float16:
        v = vals.float().clamp(-FP16_MAX, FP16_MAX).to(torch.float16)
    else:
        v = vals.to(torch.float32)
    idt = _index_dtype(span)
    if idt == torch.int16:
        i = idx.to(torch.int32)
        i = torch.where(i >= 32768, i - 65536, i).to(torch.int16)
    else:
        i = idx.to(torch.int32)
    return torch.cat([v.contiguous().view(torch.uint8), i.contiguous().view(torch.uint8)])


def decode_pairs(data: torch.Tensor, span: int, value_dtype: torch.dtype) -> Tuple[torch.Tensor, torch.Tensor]:
    """(int64 indices in [0, span), float32 values) of a payload of :func:`encode_pairs`. An index outside
    the range raises ValueError (when the step reads its checks, on a device; it is never used)."""
    pb = pair_bytes(span, value_dtype)
    if data.numel() % pb:
        raise ValueError(f"sparse reduce-scatter: payload of {data.numel()} bytes is not a whole number of "
                         f"{pb}-byte pairs (ranks disagree on the layout?)")
    k = data.numel() // pb
    vals, off = from_bytes(data, 0, value_dtype, k)
    idt = _index_dtype(span)
    idx, _ = from_bytes(data, off, idt, k)
    idx = idx.long()
    if idt == torch.int16:
        idx = idx & 0xFFFF
    if k:
        raw = idx
        idx = in_range(raw, span, "sparse reduce-scatter")
        if idx is not raw:  # out-of-range entries were redirected to 0: they add nothing
            vals = torch.where((raw >= 0) & (raw < span), vals, torch.zeros_like(vals))
    return idx, vals.float()


def _at(t: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
    return t.index_select(0, i.reshape(-1)).reshape(i.shape)


@register
class SparseReduceScatterRoute(Route):
    name = "sparse_rs"
    reads_on_start = True  # how many pairs go to each owner depends on where the entries fall

    def _value_dtype(self):
        return getattr(self.comp, "value_dtype", torch.float32)

    def _bounds_key(self, total: int) -> str:
        """Where the owner ranges of this route's ``total`` entries are kept: the size is in the key, so
        ranges of another layout (a node-aware route's other shard) are never taken for these."""
        return f"{self.tag}@{total}{OwnerMemory.SHARED_SUFFIX}"

    def _bounds(self, total: int, device) -> torch.Tensor:
        """The owner ranges' edges (N + 1, on the device): the rebalanced ones, else an even split."""
        N = self.exchange.size
        b = self.memory.memory.get(self._bounds_key(total)) if self.memory is not None else None
        if b is not None and b.numel() == N + 1:
            return b.to(device)
        sizes = split_sizes(total, N)
        return upload([0] + [hi for _, hi in offsets(sizes)], torch.int64, device)

    def start(self, records, nonfinite):
        ex, comp = self.exchange, self.comp
        N, me = ex.size, ex.rank
        self.compress_records(records)
        self.records = records
        sizes = [r.u.numel() for r in records]
        self.starts = [a for a, _ in offsets(sizes)]
        self.total = sum(sizes)
        dev = records[0].u.device if records else torch.device("cpu")
        bounds = self._bounds(self.total, dev)
        gi, gv = [], []
        for rec, s in zip(records, self.starts):
            idx, vals = comp.sparse_entries(rec.payload, rec.ctx, rec.info)
            gi.append(idx.to(dev) + s)
            gv.append(vals.to(dev).float())
        g = torch.cat(gi) if gi else torch.empty(0, dtype=torch.long, device=dev)
        v = torch.cat(gv) if gv else torch.empty(0, device=dev)
        # owner residual outside this rank's range (after a rebalance) travels to its new owner
        mem = self.memory.memory.get(f"{self.tag}:owner") if self.memory is not None else None
        carry = None
        if mem is not None and mem.numel() == self.total and self._ranges_may_have_moved():
            mem = mem.to(dev)
            pos = torch.arange(self.total, device=dev)
            carry = (mem != 0) & ((pos < bounds[me]) | (pos >= bounds[me + 1]))
            before = torch.cat([carry.new_zeros(1, dtype=torch.int64), torch.cumsum(carry, 0)])
            per_owner = _at(before, bounds[1:]) - _at(before, bounds[:-1])
        else:
            per_owner = torch.zeros(N, dtype=torch.int64, device=dev)
        # the one read of the step: the ranges, where the selected entries fall, the carried entries
        cuts_g = torch.searchsorted(g, bounds)
        got = read(torch.cat([bounds, cuts_g, per_owner]))
        self.bounds = got[:N + 1]
        cuts_g, carried = got[N + 1:2 * N + 2], got[2 * N + 2:]
        lo, hi = self.bounds[me], self.bounds[me + 1]
        self._mem = mem[lo:hi].to(dev) if mem is not None and mem.numel() == self.total else None
        if sum(carried):
            pos = compact(carry, sum(carried))
            g, order = torch.cat([g, pos]).sort()
            v = torch.cat([v, mem[pos]])[order]
        cuts = [c + sum(carried[:j]) for j, c in enumerate(cuts_g)]
        vdt = self._value_dtype()
        per_dest = []
        for j in range(N):
            a, b = cuts[j], cuts[j + 1]
            span = self.bounds[j + 1] - self.bounds[j]
            per_dest.append([encode_pairs(g[a:b] - self.bounds[j], v[a:b], span, vdt)])
        self._p1 = ex.start_alltoall(f"hvd_ext.rs1.{self.tag}", per_dest, nonfinite)
        self._p2 = None

    def _ranges_may_have_moved(self) -> bool:
        """Whether this rank's owner range may differ from the one its owner residual was kept for.
        The step that scans stages a note of what it scanned for (the world's size and the bucket's
        entries) and a rebalance stages its removal; both commit only with a finite step, and a load
        of the memory drops every note (``OwnerMemory.NOTE_SUFFIX``). So the residual is scanned for
        entries that now belong to another owner (a pass over the bucket) after a committed
        rebalance, a load of the memory, in another world, and again after a skipped step that should
        have scanned, and on no other step."""
        name = f"{self.tag}{OwnerMemory.NOTE_SUFFIX}"
        key = [self.exchange.size, self.total]
        noted = self.memory.memory.get(name)
        if noted is not None and noted.tolist() == key:
            return False
        self.memory.stage(name, torch.tensor(key, dtype=torch.int64))
        return True

    def progress(self):
        if self._p2 is not None:
            return
        ex = self.exchange
        N, me = ex.size, ex.rank
        per_source, nf = ex.finish_alltoall(self._p1)
        t0 = time.perf_counter()
        lo, hi = self.bounds[me], self.bounds[me + 1]
        span = hi - lo
        vdt = self._value_dtype()
        dev = self.records[0].u.device if self.records else torch.device("cpu")
        s = torch.zeros(span, dtype=torch.float32, device=dev)
        received = 0
        for r in range(N):
            idx, vals = decode_pairs(per_source[r][0], span, vdt)
            received += idx.numel()
            s.index_add_(0, idx, vals)
        if self._mem is not None:
            s = s + self._mem
        budget = min(span, math.ceil(received / N))
        sel = topk_indices(s.abs(), budget)
        if self.memory is not None:  # staged: dropped by the pipeline when the step is skipped
            rest = s.clone()
            rest[sel] = 0.0
            full = torch.zeros(self.total, dtype=torch.float32, device=dev)
            full[lo:hi] = rest
            self.memory.stage(f"{self.tag}:owner", full)
        payload = encode_pairs(sel, s[sel], span, torch.float32)
        self.code_s += time.perf_counter() - t0
        self._p2 = ex.start_allgather(f"hvd_ext.rs2.{self.tag}", [payload], nf)

    def finish(self):
        self.progress()
        ex, comp = self.exchange, self.comp
        per_slot, nf = ex.finish_allgather(self._p2)
        t0 = time.perf_counter()
        dev = self.records[0].u.device if self.records else torch.device("cpu")
        flat = torch.zeros(self.total, dtype=torch.float32, device=dev)
        for owner in range(ex.size):
            lo, hi = self.bounds[owner], self.bounds[owner + 1]
            idx, vals = decode_pairs(per_slot[0][owner], hi - lo, torch.float32)
            flat[lo + idx] = vals
        support = flat != 0
        flat.mul_(ex.scale())
        step = self.records[0].info.step if self.records else 0
        if (step + 1) % REBALANCE_EVERY == 0:
            self._rebalance(support, nf)
        want_support = getattr(comp.feedback, "needs_support", False)
        outs, sups = [], []
        for rec, s in zip(self.records, self.starts):
            n = rec.u.numel()
            outs.append(flat[s:s + n])
            sups.append(support[s:s + n] if want_support else None)
        self.code_s += time.perf_counter() - t0
        self._p1 = self._p2 = None
        return outs, sups, nf

    def _rebalance(self, support: torch.Tensor, nonfinite: torch.Tensor) -> None:
        """Move the owner ranges to the quantiles of the selected positions when they are uneven: the
        same decision on every rank (all hold the same result), computed on the device and staged (the
        next ``start`` reads the ranges with its split sizes)."""
        N = self.exchange.size
        if self.memory is None:
            return
        dev = support.device
        csum = torch.cumsum(support, 0)
        m = csum[-1] if csum.numel() else torch.zeros((), dtype=torch.int64, device=dev)
        old = upload(self.bounds, torch.int64, dev)
        before = torch.cat([csum.new_zeros(1), csum])
        counts = _at(before, old[1:]) - _at(before, old[:-1])
        uneven = (counts.max() > IMBALANCE * m / N) & (m >= 2 * N) & ~nonfinite
        # the j-th cut sits at the position of the (j m / N)-th selected entry (0-based)
        want = (torch.arange(1, N, device=dev) * m) // N
        cut = torch.searchsorted(csum, want + 1)
        new = torch.cat([old[:1], cut, old[-1:]])
        new = torch.cummax(new, 0).values  # non-decreasing
        self.memory.stage(self._bounds_key(self.total), torch.where(uneven, new, old))
        self.memory.stage(f"{self.tag}{OwnerMemory.NOTE_SUFFIX}", None)   # the next start scans the residual
