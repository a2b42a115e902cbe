"""The learning-rate schedule of an asynchronous run, read at the run's global progress (technique 1's
budget in docs/techniques.md).

Under event-triggered asynchronous SGD a fast worker does not wait, so the workers take different
numbers of steps. The run's budget is then a number of batches over all workers: each worker stops
when ``EventTriggeredSGD.global_steps()`` (every worker's steps, read one-sided from the server)
reaches it, and reads its one-cycle schedule (Smith & Topin 2019, torch's ``OneCycleLR``) at the
fraction of the budget done. A schedule over a worker's own steps would end the fast worker's
schedule early and leave the slow one pushing large steps alone.
"""
from __future__ import annotations

from typing import List, Tuple

import torch


class GlobalOneCycle:
    """``OneCycleLR(max_lr, cycle_momentum)`` tabulated at ``points`` fractions; ``at(frac)`` puts the
    optimizer's learning rate (and momentum, where it has some and it cycles) at that fraction."""

    def __init__(self, optimizer, max_lr: float, cycle_momentum: bool, points: int = 1000):
        self.optimizer = optimizer
        p = torch.nn.Parameter(torch.zeros(1))
        probe = torch.optim.SGD([p], lr=max_lr, momentum=0.9)
        sched = torch.optim.lr_scheduler.OneCycleLR(probe, max_lr=max_lr, total_steps=points,
                                                    cycle_momentum=cycle_momentum)
        self.table: List[Tuple[float, float]] = []
        for _ in range(points):
            self.table.append((probe.param_groups[0]["lr"], probe.param_groups[0]["momentum"]))
            probe.step()
            if len(self.table) < points:
                sched.step()
        self.cycle_momentum = cycle_momentum

    def at(self, frac: float) -> None:
        lr, mom = self.table[min(max(int(frac * len(self.table)), 0), len(self.table) - 1)]
        for g in self.optimizer.param_groups:
            g["lr"] = lr
            if self.cycle_momentum and g.get("momentum", 0) > 0:
                g["momentum"] = mom
