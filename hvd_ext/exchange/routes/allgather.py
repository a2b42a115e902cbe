"""The allgather route: every rank receives every rank's payload and decodes all N
(non-linear codecs; bytes per rank grow as (N-1) x payload)."""
from __future__ import annotations

import time

from .base import Route, known_sizes, register


@register
class AllgatherRoute(Route):
    """Non-linear codecs: one allgather of every rank's payloads, each rank decodes all N."""

    name = "allgather"

    def start(self, records, nonfinite):
        self.compress_records(records)
        self.records = records
        # every rank's payloads have these sizes when the codec can say so: nothing to read on receipt
        lens = known_sizes(self.comp, [r.info for r in records], [r.payload for r in records])
        lens = [lens] * self.exchange.size if lens is not None else None
        self._pending = self.exchange.start_allgather(f"hvd_ext.ag.{self.tag}", [r.payload for r in records],
                                                      nonfinite, lens)

    def finish(self):
        per_tensor, nf = self.exchange.finish_allgather(self._pending)
        t0 = time.perf_counter()
        scale = self.exchange.scale()
        comp = self.comp
        want_support = getattr(comp.feedback, "needs_support", False)
        results, supports = [], []
        for rec, datas in zip(self.records, per_tensor):
            results.append(comp.aggregate(datas, rec.ctx, rec.info).mul_(scale))
            supports.append(comp.support(datas, rec.ctx, rec.info) if want_support else None)
        self.code_s += time.perf_counter() - t0
        return results, supports, nf
