"""The allreduce route: linear codecs (none, fp16, bf16, PowerSGD's factors) summed by one fused
allreduce per dtype; a codec that returns ``Continue`` gets further rounds (PowerSGD's ``Q``).

A bucket whose codec asks for a second round (``Compressor.rounds``) starts it in ``progress()``,
which the pipeline calls on every bucket before it waits for any: each bucket's next round is
queued while later buckets' rounds are still in flight (as DDP chains PowerSGD's allreduces per
bucket with futures), not after the buckets before it have finished. A one-round bucket is waited
for in ``finish()`` only, so it never holds up a later bucket's ``progress()``."""
from __future__ import annotations

from typing import List, Optional, Sequence

import torch

from ...compression.base import Compressor, Continue, TensorInfo
from .base import Route, register


def bucket_rounds(comp: Compressor, shapes: Sequence[Sequence[int]], step: int) -> int:
    """The allreduce rounds a bucket of tensors of ``shapes`` takes at ``step`` on this route: its
    tensors' most (``Compressor.rounds``), as ``compression="auto"`` and the planner price it."""
    return max((comp.rounds(TensorInfo(name=f"t{i}", shape=torch.Size(s), step=step)) for i, s in enumerate(shapes)),
               default=1)


@register
class AllreduceRoute(Route):
    """Linear codecs: one fused allreduce per dtype; ``Continue`` asks for further rounds (PowerSGD).
    The non-finite test reads the reduced buffer: a NaN/Inf on any rank makes the sum non-finite."""

    name = "allreduce"

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self._pending, self._more, self._round = None, False, 1

    def start(self, records, nonfinite):
        self.compress_records(records)
        self.records = records
        self._pending = self.exchange.start_allreduce(f"hvd_ext.ar.{self.tag}", [r.payload for r in records],
                                                      nonfinite, reuse=self.comp.transient_results)
        self._ctxs = [r.ctx for r in records]
        self._results: List[Optional[torch.Tensor]] = [None] * len(records)
        self._todo = list(range(len(records)))
        self._round = 1
        self._nf = None  # the first round's non-finite flag, once it is waited for
        self._more = any(self.comp.rounds(r.info) > 1 for r in records)

    def _next_round(self) -> None:
        """Wait for the round in flight and decode it; start the next round for the records whose
        codec asks for one (``Continue``)."""
        reduced, nf = self.exchange.finish_allreduce(self._pending)
        if self._nf is None:  # finish_allreduce tested the first round's sums for NaN/Inf
            self._nf = nf
        again, payloads = [], []
        for j, i in enumerate(self._todo):
            out = self.comp.decompress(reduced[j], self._ctxs[i], self.records[i].info)
            if isinstance(out, Continue):
                self._ctxs[i] = out.ctx
                again.append(i)
                payloads.append(out.payload)
            else:
                self._results[i] = out
        self._todo, self._pending = again, None
        if again:
            self._round += 1
            self._pending = self.exchange.start_allreduce(f"hvd_ext.ar.{self.tag}.r{self._round}", payloads, False)

    def progress(self):
        if self._more and self._round == 1 and self._pending is not None:
            self._next_round()

    def finish(self):
        self.progress()
        while self._pending is not None:
            self._next_round()
        for rec, ctx in zip(self.records, self._ctxs):  # the final ctx, for local_contribution
            rec.ctx = ctx
        return self._results, [None] * len(self._results), self._nf
