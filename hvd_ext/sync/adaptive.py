"""Momentum-driven adaptive synchronization (technique 6 in docs/techniques.md; local SGD after
Lin, Stich, Patel, Jaggi, ICLR 2020).

Local SGD whose period H adapts between ``min_period`` and ``max_period``. At each
sync the parameters AND the momentum buffers are averaged with one fused
allreduce; before they are overwritten each rank computes its momentum divergence
d_i = ||m_i - m_bar|| / ||m_bar|| and a scalar allreduce gives every rank the same
delta = mean_i d_i. Then

    delta > delta_hi  ->  H = max(H // 2, min_period)   (ranks drift: sync more often)
    delta < delta_lo  ->  H = min(H + 1, max_period)    (ranks agree: sync less often)

(multiplicative decrease, additive increase). Because delta is the result of an
allreduce and H only changes at syncs, all ranks always agree on when the next
sync happens (rule of consistency). ``stats.extra["period_history"]`` holds one
``[step, delta, new_period]`` per sync.
"""
from __future__ import annotations

import math
from typing import Any, Dict, Optional

import torch

from ..options import Option
from ._common import allreduce_scalar_mean
from .local_sgd import LOCAL_OPTIONS, LocalSGD, finite_average, resolve_warmup

_INT1 = dict(accepted="integer >= 1", check=lambda v: v >= 1)

ADAPTIVE_OPTIONS = {
    "min_period": Option(int, 1, help="smallest period H_min", **_INT1),
    "max_period": Option(int, 32, help="largest period H_max", **_INT1),
    "period": Option(int, 0, accepted="0 (= min_period) or min_period <= period <= max_period",
                     check=lambda v: v >= 0, help="initial period"),
    "delta_hi": Option(float, 1.0, accepted="delta_hi > 0", check=lambda v: v > 0,
                       help="halve H when the momentum divergence exceeds this"),
    "delta_lo": Option(float, 0.5, accepted="0 <= delta_lo < delta_hi", check=lambda v: v >= 0,
                       help="grow H by one when the divergence is below this"),
    "warmup": LOCAL_OPTIONS["warmup"],
    "sync_buffers": LOCAL_OPTIONS["sync_buffers"],
}


def next_period(period: int, delta: float, delta_lo: float, delta_hi: float, min_period: int, max_period: int) -> int:
    """The adaptation rule (pure function, same inputs -> same output on every rank)."""
    if not math.isfinite(delta) or delta > delta_hi:
        return max(period // 2, min_period)
    if delta < delta_lo:
        return min(period + 1, max_period)
    return period


def momentum_divergence(local: torch.Tensor, mean: torch.Tensor) -> float:
    """d_i = ||m_i - m_bar|| / ||m_bar|| (0 when both are zero)."""
    num = float(torch.linalg.vector_norm((local - mean).double()))
    den = float(torch.linalg.vector_norm(mean.double()))
    if den == 0.0:
        return 0.0 if num == 0.0 else float("inf")
    return num / den


class AdaptiveSync(LocalSGD):
    """Local SGD with the momentum-driven adaptive period (see module doc)."""

    name = "adaptive"
    declared = ADAPTIVE_OPTIONS

    def __init__(self, optimizer, model, min_period: int = 1, max_period: int = 32, period: int = 0,
                 delta_hi: float = 1.0, delta_lo: float = 0.5, warmup: int = 0, sync_buffers: bool = True,
                 warmup_steps: Optional[int] = None):
        self.history = []
        self._setup(optimizer, model, dict(min_period=min_period, max_period=max_period, period=period,
                                           delta_hi=delta_hi, delta_lo=delta_lo,
                                           warmup=resolve_warmup("AdaptiveSync", warmup, warmup_steps),
                                           sync_buffers=sync_buffers))
        self.stats.extra["period_history"] = self.history

    def _configure(self, opts: Dict[str, Any]) -> None:
        if opts["min_period"] > opts["max_period"]:
            raise ValueError(f"AdaptiveSync: bad value {opts['min_period']!r} for 'min_period': "
                             f"accepted: min_period <= max_period (= {opts['max_period']})")
        if not opts["delta_lo"] < opts["delta_hi"]:
            raise ValueError(f"AdaptiveSync: bad value {opts['delta_lo']!r} for 'delta_lo': "
                             f"accepted: 0 <= delta_lo < delta_hi (= {opts['delta_hi']})")
        p = opts["period"] or opts["min_period"]
        if not opts["min_period"] <= p <= opts["max_period"]:
            raise ValueError(f"AdaptiveSync: bad value {opts['period']!r} for 'period': accepted: 0 (= min_period) "
                             f"or {opts['min_period']} <= period <= {opts['max_period']}")
        self.min_period, self.max_period = opts["min_period"], opts["max_period"]
        self.delta_lo, self.delta_hi = opts["delta_lo"], opts["delta_hi"]
        self.period = p
        self.warmup = opts["warmup"]
        self.last_delta = float("nan")

    def describe(self) -> str:
        return (f"adaptive:min={self.min_period},max={self.max_period},delta_lo={self.delta_lo},"
                f"delta_hi={self.delta_hi},warmup={self.warmup}")

    def _average(self):
        if not self.included:
            return super()._average()
        moms = self.state.momentum_tensors()
        local = torch.cat([m.reshape(-1) for m in moms]).clone() if moms else torch.zeros(0)
        # non-finite values never reach the average (they count as maximal divergence: H halves)
        nbytes, wait, bad = finite_average(self.state.params + self.state.buffers + moms, "hvd_ext.sync.params",
                                           self.process_set)
        if bad:
            self.skipped_syncs += 1
            self.stats.extra["skipped_syncs"] = self.skipped_syncs
        mean = torch.cat([m.reshape(-1) for m in moms]) if moms else torch.zeros(0)
        d_i = momentum_divergence(local, mean) if moms else 0.0
        delta = allreduce_scalar_mean(d_i if math.isfinite(d_i) else 1e30, name="hvd_ext.sync.delta",
                                      process_set=self.process_set)
        nbytes += 8
        self.last_delta = delta
        self.period = next_period(self.period, delta, self.delta_lo, self.delta_hi, self.min_period, self.max_period)
        self.history.append([self.steps, delta, self.period])
        self.since_sync = 0
        self.syncs += 1
        return nbytes, wait

    def state_dict(self):
        sd = super().state_dict()
        sd["history"] = [list(h) for h in self.history]
        return sd

    def load_state_dict(self, sd):
        super().load_state_dict(sd)
        self.history[:] = [list(h) for h in sd.get("history", [])]
