"""Speed-proportional local steps for periodic averaging (``adaptive:balance=1``).

A synchronous round ends when the slowest rank arrives, so a fast rank idles at every sync.
With ``balance`` each rank fills that time with local steps instead. At every sync the ranks'
seconds per step over the round that ends travel in the allreduce that carries the momentum
divergence, and the next round gives rank i

    H_i = max(1, round(H * v_i / min_j v_j)),   v_i = 1 / (seconds per step of rank i)

so the slowest rank takes the period H, as without balance, and a faster rank the steps it can
take in the same time: every rank reaches the sync at about the same time, and the sync comes
as often in wall-clock time as before.
The models are averaged as without balance, so the fast rank's extra steps count in full. With
``normalise=1`` each rank's update is weighed by the steps it took instead (FedNova: Wang, Liu,
Liang, Joshi, Poor, "Tackling the Objective Inconsistency Problem in Heterogeneous Federated
Optimization", NeurIPS 2020), with equal weights per rank:

    x <- x0 + mean_i (mean_j H_j / H_i) (x_i - x0)

where x0 is the model at the start of the round. FedNova removes the pull toward the fast rank's
shard on non-IID data, at the price of scaling up the slow rank's noisier update;
``benchmarks/results/balance.md`` compares the two.

Rule of consistency: the step counts come from an allreduced vector, so every rank computes the
same plan and makes one average per round. A loop gives the run a budget of batches over all
ranks (``set_budget``) and stops when ``global_steps()`` reaches it: the last round is cut to
end at the budget, and ``global_steps()`` reaches it only at a sync, on every rank at once.
"""
from __future__ import annotations

import math
import time
from typing import List, Optional, Sequence

import torch


def plan_steps(period: int, seconds_per_step: Sequence[float], remaining: Optional[int] = None) -> List[int]:
    """Local steps per rank for the next round (pure: the same inputs give the same plan on every rank).

    The slowest rank takes ``period`` steps, a faster one as many as it takes in the same time. A
    rank without a measurement (0, negative or non-finite seconds) makes the plan equal.
    ``remaining`` caps the round's total at the batches left (every rank still takes one step)."""
    if all(math.isfinite(s) and s > 0 for s in seconds_per_step):
        slowest = max(seconds_per_step)
        steps = [period * slowest / s for s in seconds_per_step]
    else:
        steps = [float(period)] * len(seconds_per_step)
    if remaining is not None and sum(steps) > remaining:
        steps = [h * max(remaining, 0) / sum(steps) for h in steps]
    return [max(1, int(round(h))) for h in steps]


def normalise_updates(params: List[torch.Tensor], start: List[torch.Tensor], scale: float) -> None:
    """``x <- x0 + scale * (x - x0)`` in place (this rank's share of the normalised average)."""
    if scale == 1.0:
        return
    with torch.no_grad():
        torch._foreach_sub_(params, start)
        torch._foreach_mul_(params, scale)
        torch._foreach_add_(params, start)


class RoundClock:
    """Seconds this rank spends between two syncs. On a GPU, CUDA events on the current stream,
    read once per round after the average has waited for the stream; on a CPU, the host clock."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self._start = self._end = None
        self.start()

    def _mark(self):
        if not self.cuda:
            return time.perf_counter()
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def start(self) -> None:
        self._start, self._end = self._mark(), None

    def stop(self) -> None:
        self._end = self._mark()

    def seconds(self) -> float:
        """The last start-to-stop span (``nan`` before a stop)."""
        if self._end is None:
            return float("nan")
        if not self.cuda:
            return self._end - self._start
        self._end.synchronize()
        return self._start.elapsed_time(self._end) / 1000.0
