"""Which candidates ``compression="auto"`` may use on a bucket: a verdict from gradients, never from timing.

Rule. During auto's dense warm-up every lossy candidate ``c`` codes each bucket's *local* gradient
``g_t`` as it will run: with a shadow residual of its own where it runs under error feedback
(Seide et al. 2014; Karimireddy et al. 2019), without one (``e = 0``) where it runs as an unbiased
codec without memory (qsgd)::

    u_t = g_t + e_t,   out_t = decode(encode_c(u_t)),   e_{t+1} = u_t - out_t

Nothing is sent and nothing of the training state is touched (the shadow memories are dropped
with the verdict). The codec's error ratio over the warm-up, its first step left out (the shadow
memory is still empty there)::

    q(b, c) = sqrt( sum_t ||u_t - out_t||^2 / sum_t ||u_t||^2 )

is the fraction of the compensated gradient that the codec holds back each step. A codec with
``q < 1`` is contractive (``||x - C(x)||^2 <= (1 - delta) ||x||^2`` with ``delta = 1 - q^2``,
Stich and Karimireddy 2019), and its residual then holds about ``q / (1 - q)`` steps of gradient:
the update lags the dense one by that many steps. ``q >= 1`` (e.g. QSGD at 4 bits on large
tensors) means the residual grows without bound under error feedback.

``c`` is eligible on bucket ``b`` when ``q(b, c) <= bound`` (lossless codecs always are). The
ranks' mean ``q`` is taken (one allreduce, with auto's other measurements) and rank 0's decision
is broadcast, so the verdict is the same on every rank, and it depends on the gradients alone:
the same on a busy machine as on a quiet one. The default bound and how it was set:
``benchmarks/auto_trust.py`` and the README's ``auto`` section.
"""
from __future__ import annotations

from typing import Callable, Dict, List, Optional, Sequence

import torch

DEFAULT_BOUND = 0.5


class AccuracyGuard:
    """Shadow error feedback of every lossy candidate on every bucket, over auto's warm-up.

    ``roundtrip(c, bucket, grads) -> outputs`` codes ``grads`` (one tensor per parameter) as the
    pipeline would and returns the decoded tensors (flat, in the same order)."""

    def __init__(self, candidates: Sequence, bound: float, memory: Optional[Sequence[bool]] = None):
        self.candidates = list(candidates)
        self.bound = bound
        self.memory = list(memory) if memory is not None else [True] * len(self.candidates)
        self.lossy = [ci for ci, c in enumerate(self.candidates) if not c.lossless]
        self._memory: Dict[tuple, torch.Tensor] = {}           # (candidate, name) -> shadow residual
        self._sums: Dict[tuple, List[torch.Tensor]] = {}       # (bucket, candidate) -> [err^2, in^2]
        self._grads: Dict[str, torch.Tensor] = {}              # this step's local gradients
        self.steps = 0                                          # warm-up steps measured
        self.ratio: Optional[List[List[float]]] = None         # the verdict's q per bucket, candidate

    # ---- called while the warm-up runs -----------------------------------------------------
    def keep(self, name: str, g: torch.Tensor) -> None:
        """The local gradient of ``name`` this step, before the exchange overwrites it (a copy,
        queued on the device: no sync)."""
        self._grads[name] = g.detach().clone()

    def kept(self) -> bool:
        return bool(self._grads)

    def forget_step(self) -> None:
        self._grads = {}

    def measure(self, buckets, roundtrip: Callable) -> None:
        """Code this step's local gradients with every lossy candidate's shadow memory."""
        first = self.steps == 0
        for b in buckets:
            grads = [self._grads.get(n) for n in b.names]
            if any(g is None for g in grads):
                continue
            for ci in self.lossy:
                c = self.candidates[ci]
                us = [g.float() + self._memory[(ci, n)] if (ci, n) in self._memory else g.float()
                      for n, g in zip(b.names, grads)]
                outs = roundtrip(c, b, us)
                err2 = in2 = None
                for n, u, out in zip(b.names, us, outs):
                    e = u.reshape(-1) - out.reshape(-1).float()
                    if self.memory[ci]:
                        self._memory[(ci, n)] = e.reshape(u.shape)
                    if not first:
                        de, du = e.pow(2).sum(), u.pow(2).sum()  # device scalars: read at the verdict
                        err2 = de if err2 is None else err2 + de
                        in2 = du if in2 is None else in2 + du
                if err2 is not None:
                    s = self._sums.setdefault((b.index, ci), [torch.zeros_like(err2), torch.zeros_like(in2)])
                    s[0] += err2
                    s[1] += in2
        self._grads = {}
        self.steps += 1

    # ---- the verdict -------------------------------------------------------------------------
    def local_ratios(self, n_buckets: int) -> List[float]:
        """This rank's ``q`` per (bucket, candidate), bucket-major (lossless: 0; a pair never measured,
        e.g. a bucket with no gradient yet: ``inf``, not eligible). One read of the device."""
        measured = [(bi, ci, s) for (bi, ci), s in sorted(self._sums.items()) if bi < n_buckets]
        q = torch.zeros(0)
        if measured:
            dev = measured[0][2][0].device
            q = torch.stack([(s[0] / s[1].clamp_min(1e-30)).sqrt().float().to(dev) for _, _, s in measured]).cpu()
        out = [0.0 if ci not in self.lossy else float("inf")
               for bi in range(n_buckets) for ci in range(len(self.candidates))]
        k = len(self.candidates)
        for (bi, ci, _), v in zip(measured, q.tolist()):
            out[bi * k + ci] = v
        return out

    def decide(self, ratios: Sequence[float], n_buckets: int) -> None:
        """Keep the ranks' mean ``q`` per bucket and candidate; the shadow state is dropped."""
        k = len(self.candidates)
        self.ratio = [[float(q) for q in ratios[bi * k:(bi + 1) * k]] for bi in range(n_buckets)]
        self._memory, self._sums, self._grads = {}, {}, {}

    def eligible(self, bucket: int, candidate: int) -> bool:
        """``q <= bound``; on a bucket where no candidate passes, the one of least error (NaN: never)."""
        if self.ratio is None or bucket >= len(self.ratio):
            return candidate not in self.lossy
        row = self.ratio[bucket]
        if any(q <= self.bound for q in row):
            return row[candidate] <= self.bound
        return row[candidate] == min((q for q in row if q == q), default=None)

    def report(self, specs: Sequence[str]) -> List[Dict[str, float]]:
        return [{s: round(q, 4) for s, q in zip(specs, row) if q == q and q != float("inf")} for row in self.ratio or []]
