"""Residual error feedback (Seide et al. 2014, "1-bit SGD"; Karimireddy et al. 2019, "EF-SGD").

memory_i <- (grad_i + memory_i) - sent_i : every coordinate not sent this step
is added to the next step's gradient, so sent + remembered = input exactly.
"""
from __future__ import annotations

import torch

from .base import Feedback, register


@register("residual")
class ResidualFeedback(Feedback):
    def compensate(self, name, grad, info):
        mem = self.memory.get(name)
        if mem is None:
            return grad
        return grad + mem

    def update(self, name, u, sent, info):
        self._pending[name] = (u - sent).detach()
