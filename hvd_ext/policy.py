"""Policies: what decides, between steps, which codec and route each bucket of the pipeline takes.

The pipeline holds its policies in a list and calls every one, at the same step on every rank:

* ``after_step(exchange_s)`` -- after each exchange (``exchange_s``: this rank's seconds in it);
  a policy changes buckets here, and only here, through ``pipe.set_bucket_compressor``;
* ``commit()`` / ``discard()`` -- with the step's other staged state (finite step or skipped);
* ``state_dict()`` / ``load_state_dict(state)`` -- under ``key`` in the pipeline's state;
* ``report()`` -- what it decided, for ``opt.stats``.

Three implement it: :class:`DenseWarmup` (below), :class:`hvd_ext.auto.AutoTuner` (the codec per
bucket) and :class:`hvd_ext.route_trial.RouteTrial` (flat or node-aware). The two that measure share
the helpers here: a configuration the cost model cannot separate from the best (within
``CONTEND``) is run and timed; the first ``SETTLE`` step periods after a switch (new buffers, first
calls) are left out; a configuration's time is the median of its periods, averaged over the ranks
in one allreduce (:func:`ranks_mean`), so every rank takes the same decision.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch

from .compression.none import NoneCompressor

CONTEND = 3.0  # predicted within this factor of the fastest: measured rather than trusted
SETTLE = 2     # step periods right after a switch, left out of a measurement


class Policy:
    """The protocol of the module docstring; every method is a no-op by default."""

    key: Optional[str] = None  # its entry in the pipeline's state_dict (None: nothing to keep)

    def after_step(self, exchange_s: float) -> None:
        pass

    def commit(self) -> None:
        pass

    def discard(self) -> None:
        pass

    def state_dict(self) -> Dict[str, Any]:
        return {}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        pass

    def shared_state_dict(self) -> Dict[str, Any]:
        """What a rank resuming behind the others takes from the most advanced one: the decisions,
        which every rank must hold alike (default: the whole state)."""
        return self.state_dict()

    def load_shared_state_dict(self, state: Dict[str, Any]) -> None:
        self.load_state_dict(state)

    def report(self) -> Dict[str, Any]:
        return {}


def median(xs: List[float]) -> float:
    """The upper median (no interpolation: a measured value)."""
    return sorted(xs)[len(xs) // 2]


def ranks_mean(exchange, values: torch.Tensor, name: str) -> torch.Tensor:
    """``values`` averaged over the ranks (one allreduce; every rank gets the same numbers)."""
    out = values.detach().clone()
    exchange.allreduce_average([out], name)
    return out


class DenseWarmup(Policy):
    """The first ``steps`` exchanges send the exact average, dense and without feedback; then every
    bucket takes the codec, at the same step on every rank (an adaptive optimizer's second moment is
    frozen from these gradients: :mod:`hvd_ext.variance_freeze`)."""

    def __init__(self, pipe, steps: int):
        self.pipe = pipe
        self.steps = int(steps)
        self.codec = NoneCompressor()

    def active(self) -> bool:
        return self.pipe.step < self.steps

    def codec_now(self, compressor):
        """The codec every bucket takes at the pipeline's current step."""
        return self.codec if self.active() else compressor

    def after_step(self, exchange_s: float) -> None:
        if self.pipe.step == self.steps:
            self.pipe.follow_step()
