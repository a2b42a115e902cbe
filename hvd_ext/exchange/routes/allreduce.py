"""The allreduce route: linear codecs (none, fp16, bf16, PowerSGD's factors) summed by one fused
allreduce per dtype; a codec that returns ``Continue`` gets further rounds (PowerSGD)."""
from __future__ import annotations

from typing import List, Optional

import torch

from ...compression.base import Continue
from .base import Route, register


@register
class AllreduceRoute(Route):
    """Linear codecs: one fused allreduce per dtype; ``Continue`` asks for further rounds (PowerSGD).
    The non-finite test reads the reduced buffer: a NaN/Inf on any rank makes the sum non-finite."""

    name = "allreduce"

    def start(self, records, nonfinite):
        self.compress_records(records)
        self.records = records
        self._pending = self.exchange.start_allreduce(f"hvd_ext.ar.{self.tag}", [r.payload for r in records],
                                                      nonfinite, reuse=self.comp.transient_results)

    def finish(self):
        ex, comp = self.exchange, self.comp
        reduced, nf = ex.finish_allreduce(self._pending)
        # finish_allreduce also tested the reduced buffers for NaN/Inf (one pass per fused buffer)
        results: List[Optional[torch.Tensor]] = [None] * len(reduced)
        todo = list(range(len(reduced)))
        ctxs = [r.ctx for r in self.records]
        rnd = 1
        while todo:
            again, payloads = [], []
            for j, i in enumerate(todo):
                out = comp.decompress(reduced[j], ctxs[i], self.records[i].info)
                if isinstance(out, Continue):
                    ctxs[i] = out.ctx
                    again.append(i)
                    payloads.append(out.payload)
                else:
                    results[i] = out
            if not again:
                break
            rnd += 1
            pend = ex.start_allreduce(f"hvd_ext.ar.{self.tag}.r{rnd}", payloads, False)
            reduced, _ = ex.finish_allreduce(pend)
            todo = again
        for rec, ctx in zip(self.records, ctxs):  # the final ctx, for local_contribution
            rec.ctx = ctx
        return results, [None] * len(results), nf
