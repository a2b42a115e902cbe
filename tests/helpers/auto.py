"""Gradients and a scripted link probe for the compression="auto" tests (tests/unit/test_auto.py,
tests/unit/test_accuracy_guard.py)."""
from __future__ import annotations

import torch

from hvd_ext.exchange import cost

NAMES = {"w1": (40, 50), "b1": (50,), "w2": (3000,)}


def _grads(steps, size, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [[{n: torch.randn(*s, generator=g) for n, s in NAMES.items()} for _ in range(size)]
            for _ in range(steps)]


def _link(slow_from=None, fast_from=None):
    """A probe that reports a slow (1 kB/s) or fast (100 GB/s) link depending on the step."""
    def probe(self):
        step = self.pipe.step
        slow = slow_from is not None and step >= slow_from and (fast_from is None or step < fast_from)
        wire = cost.allreduce_wire(4.0 * 256 * 1024, self.pipe.size)
        return {"lat": 1e-5, "large": 1e-5 + (wire / 1e3 if slow else wire / 1e11), "wire": wire}
    return probe
