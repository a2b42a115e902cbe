"""Signum: signSGD with momentum and majority vote (Bernstein et al. 2018, "signSGD: Compressed
Optimisation for Non-Convex Problems", Algorithm "Signum").

Each rank keeps a momentum ``m <- beta * m + (1 - beta) * g`` per tensor (compressor
state, saved in ``state_dict`` so a checkpoint resumes exactly), sends
``sign(m)`` as one bit per coordinate, and every rank applies the majority vote
``sign(sum_r sign(m_r))``. Use it with a momentum-free optimizer (plain SGD):
the momentum lives here. The new momentum is staged and becomes current only
when the step was finite on every rank (``commit``), so a skipped step leaves it
untouched.

Wire bytes (allgather, fixed size): ``ceil(n / 8)``.
"""
from __future__ import annotations

import torch

from ..options import Option
from .base import register
from .signsgd import MajorityVote


@register("signum")
class SignumCompressor(MajorityVote):
    options = {"beta": Option(float, 0.9, "0 <= beta < 1", lambda v: 0 <= v < 1)}

    def __init__(self, **kw):
        super().__init__(**kw)
        self.momentum = {}
        self._staged = {}

    def _vector(self, tensor, info):
        g = tensor.reshape(-1).float()
        m = self.momentum.get(info.name)
        if m is None or m.shape != g.shape or m.device != g.device:
            m = torch.zeros_like(g)
        new = m * self.beta + g * (1 - self.beta)
        self._staged[info.name] = new
        return new

    def commit(self):
        self.momentum.update(self._staged)
        self._staged = {}

    def discard(self):
        self._staged = {}

    def state_dict(self):
        return {"momentum": {k: v.clone() for k, v in self.momentum.items()}}

    def load_state_dict(self, state):
        self.momentum = {k: v.clone() for k, v in state.get("momentum", {}).items()}
        self._staged = {}
