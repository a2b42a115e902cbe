"""Residual error feedback (Seide et al. 2014, "1-bit SGD"; Karimireddy et al. 2019, "EF-SGD").

memory_i <- (grad_i + memory_i) - sent_i : every coordinate not sent this step
is added to the next step's gradient, so sent + remembered = input exactly.

On CUDA float32 tensors (``hvd_ext.kernels`` present and not forced off) the new
memory is written by the fused ``kernels.residual_update`` (one pass); elsewhere
``u - sent`` in torch (the same float32 values).
"""
from __future__ import annotations

import torch

from .. import kernels as _K
from .base import Feedback, register


def residual_of(u: torch.Tensor, sent: torch.Tensor) -> torch.Tensor:
    """A new, detached tensor ``u - sent`` (shape of ``u``): ``kernels.residual_update`` when the
    kernels run for both (CUDA float32, same shape), else torch. Shared by the feedbacks."""
    if (u.dtype == torch.float32 and sent.dtype == torch.float32 and u.shape == sent.shape
            and _K.backend(u, sent) == "cuda"):
        mem = torch.empty(u.shape, dtype=torch.float32, device=u.device)
        return _K.residual_update(mem, u.detach(), sent.detach())
    return (u - sent).detach()


@register("residual")
class ResidualFeedback(Feedback):
    def compensate(self, name, grad, info):
        mem = self.memory.get(name)
        if mem is None:
            return grad
        return grad + mem

    def update(self, name, u, sent, info):
        self._pending[name] = residual_of(u, sent)
