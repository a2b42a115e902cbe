"""Speed-proportional local steps for periodic averaging (``adaptive:balance=1``).

A synchronous round ends when the slowest rank arrives, so a fast rank idles at every sync.
With ``balance`` each rank fills that time with local steps instead. At every sync each rank's
seconds per step (the median over its last rounds) travel in the allreduce that carries the
momentum divergence, and the next round gives rank i

    H_i = max(1, floor(H * v_i / min_j v_j + c_i)),   v_i = 1 / (seconds per step of rank i)

where c_i is the fraction of a step rank i could not take in the round before (carried over).
At the smallest period (``min_period``) the plan is equal: the adaptive rule has found the ranks
drifting apart, a fast rank's extra local steps are what drifts, and without them the ranks can
sync every step as plain adaptive SGD does (at a high learning rate that is what keeps a run stable).

so the slowest rank takes the period H, as without balance, and a faster rank the steps it can
take in the same time: every rank reaches the sync at about the same time, and the sync comes
as often in wall-clock time as before.
Each rank's update is weighed by the steps it took (``normalise``, the default with balance; FedNova: Wang, Liu,
Liang, Joshi, Poor, "Tackling the Objective Inconsistency Problem in Heterogeneous Federated
Optimization", NeurIPS 2020), with equal weights per rank:

    x <- x0 + mean_i (mean_j H_j / H_i) (x_i - x0)

where x0 is the model at the start of the round. FedNova removes the pull toward the fast rank's
shard on non-IID data, at the price of scaling up the slow rank's noisier update; with the plain
average (``normalise=0``) the fast rank's extra steps count in full, and on label-skewed shards runs
collapsed at the peak learning rate. ``benchmarks/results/balance.md`` compares the two.

Rule of consistency: the step counts come from an allreduced vector, so every rank computes the
same plan and makes one average per round (the budgets are compared once, at the first step). A rank
outside the optimizer's process set takes no part. Under Horovod elastic the ranks agree on the most
advanced rank's counters after a change of world, as local SGD does. A loop gives the run a budget of batches over all
ranks (``set_budget``) and stops when ``global_steps()`` reaches it: the last round is cut to
end at the budget, and ``global_steps()`` reaches it only at a sync, on every rank at once.
"""
from __future__ import annotations

import math
import time
from collections import deque
from typing import List, Optional, Sequence, Tuple

import torch


def plan_steps(period: int, seconds_per_step: Sequence[float], remaining: Optional[int] = None,
               carry: Optional[Sequence[float]] = None) -> Tuple[List[int], List[float]]:
    """Local steps per rank for the next round, and the fractions carried to the round after (pure:
    the same inputs give the same plan on every rank).

    The slowest rank takes ``period`` steps, a faster one as many as it takes in the same time; the
    fraction a rank cannot take this round is carried to the next, so over rounds its steps match its
    speed. A rank without a measurement (0, negative or non-finite seconds) makes the plan equal.
    ``remaining`` caps the round's total at the batches left (every rank still takes one step)."""
    n = len(seconds_per_step)
    carry = list(carry) if carry is not None and len(carry) == n else [0.0] * n
    if all(math.isfinite(s) and s > 0 for s in seconds_per_step):
        slowest = max(seconds_per_step)
        exact = [period * slowest / s + c for s, c in zip(seconds_per_step, carry)]
    else:
        exact = [float(period)] * n
    if remaining is not None and sum(exact) > remaining:   # the last round: nothing to carry
        return cut_to(exact, remaining), [0.0] * n
    plan = [max(1, int(math.floor(h + 1e-9))) for h in exact]
    return plan, [min(max(h - k, -1.0), 1.0) for h, k in zip(exact, plan)]


def cut_to(exact: Sequence[float], remaining: int) -> List[int]:
    """``exact`` scaled to sum to ``remaining``, rounded by largest remainder (the sum is exactly
    ``remaining`` unless a rank would get 0: every rank takes at least one step)."""
    scaled = [h * max(remaining, 0) / sum(exact) for h in exact]
    whole = [int(math.floor(h)) for h in scaled]
    order = sorted(range(len(scaled)), key=lambda i: (whole[i] - scaled[i], i))   # largest remainder first
    for i in order[:max(remaining, 0) - sum(whole)]:
        whole[i] += 1
    return [max(1, h) for h in whole]


def normalise_updates(params: List[torch.Tensor], start: List[torch.Tensor], scale: float) -> None:
    """``x <- x0 + scale * (x - x0)`` in place (this rank's share of the normalised average)."""
    if scale == 1.0:
        return
    with torch.no_grad():
        torch._foreach_sub_(params, start)
        torch._foreach_mul_(params, scale)
        torch._foreach_add_(params, start)


class RoundClock:
    """Seconds per step of this rank between two syncs: CUDA events on the current stream on a GPU
    (read once per round, after the average has waited for the stream anyway), the host clock on a
    CPU. ``per_step()`` is the median of the last ``window`` rounds, so one slow round (an evaluation
    on rank 0, a pause) does not move the plan. Only spans from a ``start()`` count: the strategy
    starts the clock at a sync, so the first round, which holds the job's setup and the first step's
    agreements, is not timed."""

    def __init__(self, device: torch.device, window: int = 5):
        self.device = device
        self.cuda = device.type == "cuda"
        self.laps = deque(maxlen=window)
        self._start = self._end = None

    def _mark(self):
        if not self.cuda:
            return time.perf_counter()
        ev = torch.cuda.Event(enable_timing=True)
        ev.record(torch.cuda.current_stream(self.device))   # the parameters' device, not the current one
        return ev

    def start(self) -> None:
        self._start, self._end = self._mark(), None

    def stop(self) -> None:
        self._end = self._mark()

    def seconds(self) -> float:
        """The last start-to-stop span (``nan`` before a start and a stop)."""
        if self._start is None or self._end is None:
            return float("nan")
        if not self.cuda:
            return self._end - self._start
        self._end.synchronize()
        return self._start.elapsed_time(self._end) / 1000.0

    def lap(self, steps: int) -> None:
        """Record the last span as ``steps`` steps."""
        sec = self.seconds()
        if steps > 0 and math.isfinite(sec) and sec > 0:
            self.laps.append(sec / steps)

    def per_step(self) -> float:
        """Median seconds per step over the recorded rounds (0.0 before any)."""
        if not self.laps:
            return 0.0
        ordered = sorted(self.laps)
        mid = len(ordered) // 2
        return ordered[mid] if len(ordered) % 2 else 0.5 * (ordered[mid - 1] + ordered[mid])
