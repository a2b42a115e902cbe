"""Two-phase compressed allreduce for the quantizers and the sign family.

CGX (Markov et al., "CGX: adaptive system support for communication-efficient
deep learning", Middleware 2022) and DeepSpeed's compressed allreduce for
1-bit Adam (Tang et al. 2021) scale a non-linear codec like a ring allreduce:

1. the bucket (its tensors concatenated, n elements) is cut into N contiguous
   shards; shard j belongs to rank j. Each rank compresses every shard -- per
   *segment*, the part of one tensor inside one shard, so per-layer codecs
   (qdist's fitted levels, terngrad's scale) still see one layer at a time --
   and one variable-split ``alltoall`` sends shard j to rank j;
2. the owner decodes the N contributions to its shard, sums and averages them,
   adds its owner-side error-feedback memory (codecs run with error feedback
   only), re-compresses the result (``Compressor.recompress``), remembers
   what that lost, and one
   ``allgather`` gives every rank every owner's shard; each rank decodes N
   shards of n/N elements.

Bytes per rank: (N-1)/N x C out and in for each phase, 2(N-1)/N x C in all
(C = one rank's compressed bucket), against (N-1) x C for an allgather;
decode work O(n) instead of O(N n). The non-finite flag rides in both
phases' headers, so a NaN on any rank reaches every rank.
"""
from __future__ import annotations

import time
from typing import List

import torch

from ...compression.base import TensorInfo
from .base import Route, TensorRecord, known_sizes, register, segments


@register
class TwoPhaseRoute(Route):
    name = "twophase"

    def _seg_info(self, rec: TensorRecord, a: int, b: int, rank: int, owner: bool = False) -> TensorInfo:
        i = rec.info
        param = i.param.reshape(-1)[a:b] if i.param is not None else None
        return TensorInfo(name=f"{rec.name}@{a}" + (":owner" if owner else ""), shape=torch.Size([b - a]),
                          step=i.step, rank=rank, size=i.size, param=param, scale=i.scale, base_name=rec.name)

    def start(self, records, nonfinite):
        ex, comp = self.exchange, self.comp
        N, me = ex.size, ex.rank
        self.records = records
        self.prepare(records)  # per tensor, before the tensors are cut into shards
        self.segs = segments([r.u.numel() for r in records], N)
        flats = [r.u.reshape(-1) for r in records]
        self.own: List[List[tuple]] = []  # per shard: [(seg info, payload, ctx)] of this rank
        per_dest = []
        for j in range(N):
            row, pays = [], []
            for (i, a, b) in self.segs[j]:
                info = self._seg_info(records[i], a, b, me)
                payload, ctx = comp.compress(flats[i][a:b], info)
                row.append((info, payload, ctx))
                pays.append(payload)
            self.own.append(row)
            per_dest.append(pays)
        # every destination gets the same number of payloads: pad with empty ones
        self.width = max(len(s) for s in self.segs)
        dev = flats[0].device if flats else torch.device("cpu")
        empty = torch.empty(0, dtype=torch.uint8, device=dev)
        per_dest = [p + [empty] * (self.width - len(p)) for p in per_dest]
        # Sizes that follow from the shapes: every source sends this rank payloads of the sizes of its
        # own for the same segments, and every owner's re-coded shard has sizes every rank can say --
        # nothing to read on receipt.
        pad = lambda row: row + [0] * (self.width - len(row))  # noqa: E731
        mine = known_sizes(comp, [info for info, _, _ in self.own[me]], [p for _, p, _ in self.own[me]])
        owners = [known_sizes(comp, [self._seg_info(records[i], a, b, j, owner=True) for (i, a, b) in self.segs[j]],
                              [None] * len(self.segs[j]), recoded=True) for j in range(N)]
        self._lens = [pad(row) for row in owners] if all(row is not None for row in owners) else None
        self._p1 = ex.start_alltoall(f"hvd_ext.tp1.{self.tag}", per_dest, nonfinite,
                                     [pad(mine)] * N if mine is not None else None)
        self._p2 = None

    def progress(self):
        if self._p2 is not None:
            return
        ex, comp = self.exchange, self.comp
        N, me = ex.size, ex.rank
        per_source, nf = ex.finish_alltoall(self._p1)
        t0 = time.perf_counter()
        scale = ex.scale()
        # Owner-side error feedback only where the worker uses it too: it needs a contractive codec
        # (EF-signSGD, 1-bit); on an unbiased high-variance quantizer (QSGD 4-bit, TernGrad) it would
        # grow without bound, and stochastic rounding at the owner already keeps the result unbiased.
        use_mem = (comp.owner_feedback and self.memory is not None
                   and getattr(comp.feedback, "name", "none") != "none")
        pays = []
        for k, ((i, a, b), (info, _, ctx)) in enumerate(zip(self.segs[me], self.own[me])):
            datas = [per_source[r][k] for r in range(N)]
            avg = comp.aggregate(datas, ctx, info).mul_(scale)
            oinfo = self._seg_info(self.records[i], a, b, me, owner=True)
            if use_mem:
                avg = avg + self.memory.get(oinfo.name, avg)
            payload, octx = comp.recompress(avg, oinfo)
            if use_mem:  # staged: the pipeline drops it when the step is skipped (non-finite)
                self.memory.stage(oinfo.name, avg - comp.decode(payload, octx, oinfo))
            pays.append(payload)
        dev = self.records[0].u.device if self.records else torch.device("cpu")
        pays += [torch.empty(0, dtype=torch.uint8, device=dev)] * (self.width - len(pays))
        self.code_s += time.perf_counter() - t0
        self._p2 = ex.start_allgather(f"hvd_ext.tp2.{self.tag}", pays, nf, self._lens)

    def finish(self):
        self.progress()
        ex, comp = self.exchange, self.comp
        per_slot, nf = ex.finish_allgather(self._p2)
        t0 = time.perf_counter()
        outs = [torch.empty(r.u.numel(), dtype=torch.float32, device=r.u.device) for r in self.records]
        for owner in range(ex.size):
            for k, (i, a, b) in enumerate(self.segs[owner]):
                info, _, ctx = self.own[owner][k]
                outs[i][a:b] = comp.decode(per_slot[k][owner], ctx, info)
        self.code_s += time.perf_counter() - t0
        self._p1 = self._p2 = None
        return outs, [None] * len(outs), nf

    def sent(self, idx, result):
        """This rank's phase-1 contribution to tensor ``idx``: its decoded segments in every shard."""
        rec = self.records[idx]
        out = torch.zeros(rec.u.numel(), dtype=torch.float32, device=rec.u.device)
        for j, segs in enumerate(self.segs):
            for k, (i, a, b) in enumerate(segs):
                if i == idx:
                    info, payload, ctx = self.own[j][k]
                    out[a:b] = self.comp.decode(payload, ctx, info)
        return out
