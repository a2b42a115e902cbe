"""Momentum-driven adaptive synchronization (technique 6 in docs/techniques.md; local SGD after
Lin, Stich, Patel, Jaggi, ICLR 2020).

Local SGD whose period H adapts between ``min_period`` and ``max_period``. At each
sync the parameters AND the momentum buffers are averaged with one fused
allreduce; before they are overwritten each rank computes its momentum divergence
d_i = ||m_i - m_bar|| / ||m_bar|| and a small allreduce (a scalar; with ``balance`` also the ranks'
speeds) gives every rank the same delta = mean_i d_i. It is started at the sync and waited for at
the next ``step()``, after that step's forward and backward, which hide its latency; until then
``period``, ``plan`` and the history still show the previous decision. Then

    delta > delta_hi  ->  H = max(H // 2, min_period)   (ranks drift: sync more often)
    delta < delta_lo  ->  H = min(H + 1, max_period)    (ranks agree: sync less often)

(multiplicative decrease, additive increase). Because delta is the result of an
allreduce and H only changes at syncs, all ranks always agree on when the next
sync happens (rule of consistency). ``stats.extra["period_history"]`` holds one
``[step, delta, new_period]`` per sync.
"""
from __future__ import annotations

import math
from typing import Any, Dict, List, Optional

import torch

from ..options import Option
from ._common import exchange_for
from .balance import RoundClock, normalise_updates, plan_steps
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
    "balance": Option(bool, False, help="local steps in proportion to each rank's speed; the ranks "
                                        "stop together on global_steps() >= set_budget()"),
    "normalise": Option(bool, None, help="with balance: weigh each rank's update by the steps it took (FedNova; "
                                         "the default with balance=1: with the plain average the fast rank's extra "
                                         "steps on skewed data pulled runs off); 0: the plain average"),
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
                 warmup_steps: Optional[int] = None, balance: bool = False, normalise: Optional[bool] = None):
        self.history = []
        self._setup(optimizer, model, dict(min_period=min_period, max_period=max_period, period=period,
                                           delta_hi=delta_hi, delta_lo=delta_lo,
                                           warmup=resolve_warmup("AdaptiveSync", warmup, warmup_steps),
                                           sync_buffers=sync_buffers, balance=balance,
                                           **({} if normalise is None else {"normalise": normalise})))
        self.stats.extra["period_history"] = self.history
        self.budget: Optional[int] = None   # batches over all ranks (balance: set_budget)
        self.completed = 0                  # batches of the ranks together at the last sync (balance)
        self.plan: Optional[List[int]] = None   # this round's local steps per rank (balance)
        self.carry: Optional[List[float]] = None   # the fractions of steps carried to the next round
        self._budget_checked: Optional[int] = None   # the world in which the ranks' budgets were compared
        self._start: Optional[List[torch.Tensor]] = None   # the parameters at the round's start (x0)
        self._start_valid = False
        device = self.state.params[0].device if self.state.params else torch.device("cpu")
        self._clock = RoundClock(device)
        self._decision = None   # the last sync's decision allreduce, in flight until the next step

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
        self.balance = opts["balance"]
        if opts["normalise"] and not self.balance:
            raise ValueError("AdaptiveSync: bad value True for 'normalise': accepted: normalise=1 only with balance=1 "
                             "(without it every rank takes the same steps)")
        self.normalise = self.balance if opts["normalise"] is None else bool(opts["normalise"])
        self.last_delta = float("nan")

    def describe(self) -> str:
        return (f"adaptive:min={self.min_period},max={self.max_period},delta_lo={self.delta_lo},"
                f"delta_hi={self.delta_hi},warmup={self.warmup}"
                + ((",balance=1" + ("" if self.normalise else ",normalise=0")) if self.balance else ""))

    # ---- balance: local steps in proportion to speed ---------------------------------------
    def set_budget(self, batches: int) -> None:
        """The run's batches over all ranks together (the same on every rank: compared at the next step).
        With ``balance`` the loop stops when ``global_steps()`` reaches it, at a sync on every rank."""
        if isinstance(batches, bool) or not isinstance(batches, int) or batches < 1:
            raise ValueError(f"AdaptiveSync.set_budget: bad value {batches!r} for 'batches': accepted: integer >= 1 "
                             "(batches over all ranks together)")
        self.budget = batches
        self._budget_checked = None   # checked at the next step, on every rank

    def _round_plan(self) -> List[int]:
        """This round's local steps per rank: agreed at the last sync, equal before the first."""
        ex = exchange_for(self.process_set)
        if self.plan is not None and len(self.plan) == ex.size:
            return self.plan
        remaining = None if self.budget is None else self.budget - self.completed
        return plan_steps(self.period, [0.0] * ex.size, remaining)[0]

    def global_steps(self) -> int:
        """Local steps of all ranks together. Without ``balance`` every rank steps alike (N x steps).
        With it: the agreed count at the last sync plus this rank's share of the round, kept below
        the budget until the sync that reaches it, so every rank stops at the same sync. A rank outside
        the optimizer's process set takes no part: the budget (its loop ends at once)."""
        if self.balance and not self.included:
            return self.budget or 0
        ex = exchange_for(self.process_set)
        if not self.balance:
            return ex.size * self.steps
        plan = self._round_plan()
        g = self.completed + (self.since_sync * sum(plan)) // plan[ex.rank]
        if self.budget is not None and self.completed < self.budget:
            g = min(g, self.budget - 1)
        return g

    def _due(self) -> bool:
        if not (self.balance and self.included):
            return super()._due()
        return self.since_sync >= self._round_plan()[exchange_for(self.process_set).rank]

    def _check_budget(self) -> None:
        """Once per world, at the first step: every rank raises if the ranks' budgets differ."""
        if self._budget_checked == self.world_changes:
            return
        budgets = exchange_for(self.process_set).allgather_object(self.budget, "hvd_ext.sync.budget")
        if len(set(budgets)) > 1:
            raise ValueError(f"AdaptiveSync(balance=1): the ranks gave set_budget() different budgets {budgets}; "
                             "accepted: the same number of batches (over all ranks together) on every rank")
        self._budget_checked = self.world_changes

    def step(self, loss=None, closure=None):
        if not (self.balance and self.included):
            return super().step(loss, closure)
        if self.budget is None:
            raise RuntimeError("AdaptiveSync(balance=1): call set_budget(batches) before the first step; the "
                               "ranks take different numbers of steps, so the loop must stop on global_steps() "
                               ">= the budget, which every rank reaches at the same sync")
        self._settle()   # agree on the counters before reading them (LocalSGD.step's call is then a no-op)
        self._check_budget()
        warm = self.in_warmup()
        if self.normalise and not warm and self.since_sync == 0:   # the round starts: keep x0
            if self._start is None:
                self._start = [p.detach().clone() for p in self.state.params]
            else:
                torch._foreach_copy_(self._start, [p.detach() for p in self.state.params])
            self._start_valid = True
        out = super().step(loss, closure)
        if warm:
            self.completed += exchange_for(self.process_set).size
            self._clock.start()
        return out

    def _settle(self) -> None:
        self._decide()   # the last sync's decision first: before any counter is read or collective made
        super()._settle()

    def _average(self, defer: bool = False):
        if not self.included:
            return super()._average()
        self._decide()
        # balance: a round ends here (a warm-up average, since_sync == 0, ends none); its plan is
        # fixed before the period changes
        round_end = self.balance and self.since_sync > 0
        if round_end:
            self._clock.stop()
            plan, rank = self._round_plan(), exchange_for(self.process_set).rank
            if self.normalise and self._start_valid:
                normalise_updates(self.state.params, self._start, sum(plan) / len(plan) / plan[rank])
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
        d_i = d_i if math.isfinite(d_i) else 1e30
        nbytes += self._start_decision(d_i, round_end)
        if round_end:
            self.completed += sum(plan)
            self._start_valid = False
            self._clock.start()
        self.since_sync = 0
        self.syncs += 1
        if not defer:
            self._decide()
        return nbytes, wait

    def _start_decision(self, d_i: float, round_end: bool) -> int:
        """Start the one allreduce the next period (and with ``balance`` the next plan) is decided from:
        [divergence] or, with ``balance``, [divergence, seconds per step at this rank's slot] (this
        round's time counts only at a ``round_end``, not at a warm-up average). It stays in flight
        through the next step's forward and backward (``_decide`` at the next ``step``). Returns its bytes."""
        ex = exchange_for(self.process_set)
        vec = torch.zeros(1 + ex.size if self.balance else 1, dtype=torch.float64)
        vec[0] = d_i
        if self.balance:
            if round_end:
                self._clock.lap(self.since_sync)
            vec[1 + ex.rank] = self._clock.per_step()
        name = "hvd_ext.sync.balance" if self.balance else "hvd_ext.sync.delta"
        self._decision = (ex.start_average([vec], name), vec, round_end, self.steps)
        return 8 * vec.numel()

    def _decide(self) -> None:
        """The decision of the last sync, from its allreduce (the same numbers on every rank):
        the period by the divergence, and at a round's end the next plan by the ranks' speeds."""
        if self._decision is None:
            return
        pending, vec, round_end, at_step = self._decision
        self._decision = None
        if self._world.moved():   # Horovod was re-initialised (elastic): the counters are agreed anew
            return
        ex = exchange_for(self.process_set)
        ex.finish_average(pending)
        delta = float(vec[0])
        self.last_delta = delta
        self.period = next_period(self.period, delta, self.delta_lo, self.delta_hi, self.min_period, self.max_period)
        self.history.append([at_step, delta, self.period])
        if round_end:
            seconds = (vec[1:] * ex.size).tolist()
            remaining = None if self.budget is None else self.budget - self.completed
            # at the smallest period the ranks drift most: no extra steps for a fast rank (it waits)
            speeds = seconds if self.period > self.min_period else [0.0] * len(seconds)
            self.plan, self.carry = plan_steps(self.period, speeds, remaining, self.carry)
            self.stats.extra["step_plan"] = list(self.plan)

    def state_dict(self):
        self._decide()
        sd = super().state_dict()
        sd["history"] = [list(h) for h in self.history]
        if self.balance:
            sd.update(completed=self.completed, plan=None if self.plan is None else list(self.plan),
                      carry=None if self.carry is None else list(self.carry))
        return sd

    def load_state_dict(self, sd):
        self._decision = None   # what the last sync would have decided: replaced by the loaded state
        super().load_state_dict(sd)
        self.history[:] = [list(h) for h in sd.get("history", [])]
        if self.balance:
            self.completed = int(sd.get("completed", 0))
            self.plan = None if sd.get("plan") is None else [int(h) for h in sd["plan"]]
            self.carry = None if sd.get("carry") is None else [float(c) for c in sd["carry"]]
            self._start_valid = False   # a round resumed mid-way is averaged without normalisation
