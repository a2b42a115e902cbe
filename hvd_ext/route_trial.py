"""``hierarchy=auto``, measured: the flat and the node-aware exchange each run a few steps when
the cost model cannot tell which is faster, and the shorter step period wins.

The node-aware exchange (dense inside a node, compressed across nodes) is chosen per bucket
from an alpha-beta model of the two links (:mod:`hvd_ext.exchange.probe` measures them,
:func:`hvd_ext.exchange.routes.route_options` prices each route). The model leaves out what
decides on a busy machine -- CPU contention between the ranks of a node, skew, Python costs --
and identical runs differ by more than its margins (``compare_nodes_repeat`` in
benchmarks/RESULTS.md). So, as ``compression="auto"``
does for codecs (and Horovod's autotuner for its fusion settings), the choice is measured
where the model cannot separate the two: when the predicted step exchange of one is within
``CONTEND`` (3x, :mod:`hvd_ext.policy`) of the other, after the dense warm-up

1. the model's pick (all buckets flat, or all node-aware) runs ``hierarchy_trial`` exchanges
   (default 20) after ``SETTLE`` (2) that are left out, then the other one does;
2. each rank's median step period per configuration is averaged over the ranks (one small
   allreduce), so every rank sees the same two numbers and takes the same decision;
3. the other configuration is kept only if it is ``_MARGIN`` (5%) faster than the model's pick.

Switching routes between steps loses nothing of the workers' error-feedback memory (it is per
tensor, whatever the route); a two-phase route's owner-side memory of the configuration left
behind is dropped with it. The decision is part of ``state_dict`` so a resumed job does not
repeat the trial. ``hierarchy_trial=0`` trusts the model; ``hierarchy=flat`` never goes
node-aware.
"""
from __future__ import annotations

import time
from typing import Any, Dict, List, Optional

import torch

from .policy import CONTEND, SETTLE, Policy, median, ranks_mean

_MARGIN = 0.05   # the configuration the model did not pick must be this much faster to be kept


class RouteTrial(Policy):
    """Flat against node-aware, measured once per pipeline (see the module docstring): the policy
    (:mod:`hvd_ext.policy`) that picks the buckets' routes."""

    key = "route_trial"

    def __init__(self, pipe, steps: int, plans: Dict[str, List[str]], predicted: Dict[str, float]):
        self.pipe = pipe
        self.steps = int(steps)
        self.plans = plans                      # "flat" / "node" -> route per bucket
        self.predicted = predicted              # "flat" / "node" -> predicted exchange seconds per step
        self.model_pick = "node" if predicted["node"] < predicted["flat"] else "flat"
        self.order = [self.model_pick, "flat" if self.model_pick == "node" else "node"]
        self.measured: Dict[str, float] = {}    # configuration -> ranks' mean of the median period
        self.choice: Optional[str] = None
        self._i: Optional[int] = None
        self._periods: List[float] = []
        self._last: Optional[float] = None

    @classmethod
    def plan(cls, pipe) -> Optional["RouteTrial"]:
        """A trial when the codec allows both exchanges and the model's predictions for the
        whole step are within ``CONTEND`` of each other; else None (the model's routes stay)."""

        comp = pipe.compressor
        steps = int(comp.hierarchy_trial or 0)
        if steps <= 0 or pipe.auto is not None or comp.hierarchy != "auto":
            return None
        plans: Dict[str, List[str]] = {"flat": [], "node": []}
        predicted = {"flat": 0.0, "node": 0.0}
        for b in pipe.buckets:
            opts = pipe.route_options(b, comp)
            if opts["node"] is None:
                return None
            plans["flat"].append(opts["flat"])
            plans["node"].append(opts["node"])
            predicted["flat"] += opts["flat_s"]
            predicted["node"] += opts["node_s"]
        lo, hi = sorted(predicted.values())
        if hi > CONTEND * lo:
            return None
        return cls(pipe, steps, plans, predicted)

    @property
    def done(self) -> bool:
        return self.choice is not None

    def apply(self, config: str) -> None:
        """Every bucket to its route in ``config`` ("flat" or "node"), between steps."""
        for b, kind in zip(self.pipe.buckets, self.plans[config]):
            if b.route.name != kind:
                self.pipe.set_bucket_compressor(b, b.comp, kind)

    def after_step(self, exchange_s: float) -> None:
        """Called by the pipeline after every exchange (same step on every rank)."""
        pipe = self.pipe
        if self.done or pipe.step < pipe.warmup:
            return
        now = time.perf_counter()
        if self._i is None:  # past the warm-up: the model's pick first
            self._i = 0
            self.apply(self.order[0])
            self._periods, self._last = [], now
            return
        self._periods.append(now - self._last)
        self._last = now
        if len(self._periods) < SETTLE + self.steps:
            return
        out = ranks_mean(pipe.exchange, torch.tensor([median(self._periods[SETTLE:])], dtype=torch.float32),
                         f"hvd_ext.route_trial.{pipe.step}")
        self.measured[self.order[self._i]] = float(out[0])
        self._periods = []
        self._i += 1
        if self._i < len(self.order):
            self.apply(self.order[self._i])
            return
        first, other = self.order
        self.choice = other if self.measured[other] < (1 - _MARGIN) * self.measured[first] else first
        self.apply(self.choice)

    def report(self) -> Dict[str, Any]:
        return {"model": self.model_pick, "choice": self.choice,
                "predicted_ms": {k: round(v * 1e3, 3) for k, v in self.predicted.items()},
                "measured_period_ms": {k: round(v * 1e3, 3) for k, v in self.measured.items()},
                "steps": self.steps}

    def state_dict(self) -> Dict[str, Any]:
        return {"choice": self.choice, "measured": dict(self.measured)}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """A decided trial is applied as it was; one in progress starts again."""
        self._i, self._periods, self._last = None, [], None
        choice = (state or {}).get("choice")
        if choice in self.plans:
            self.choice = choice
            self.measured = dict(state.get("measured") or {})
            if self.pipe.step >= self.pipe.warmup:  # else applied when the warm-up ends
                self.apply(choice)
        else:
            self.choice, self.measured = None, {}

