"""Momentum correction and momentum-factor masking (Lin, Han, Mao, Wang, Dally, "Deep Gradient
Compression", ICLR 2018, Sec. 3.2 and 3.3), shared by the feedbacks that apply SGD momentum
before compression.

Per tensor and rank::

    u <- m * u + g                       the velocity, accumulated before compression
    after the exchange, with masking:    u_j <- 0 on the coordinates j this rank sent

Error feedback then compresses u + memory. Without masking, a coordinate that was just sent
keeps its velocity and keeps pushing the same, now stale, direction into the memory; at high
sparsity that delays every coordinate by hundreds of steps. Masking forgets the velocity of what
was sent, as the sent value already carried it.
"""
from __future__ import annotations

import torch


def sent_mask(sent: torch.Tensor, info) -> torch.Tensor:
    """Boolean flat mask of the coordinates this rank sent: the compressor's
    ``info.sparse_indices`` when it provides them, else ``sent != 0``."""
    idx = info.sparse_indices if info is not None else None
    flat = sent.reshape(-1)
    if idx is None:
        return flat != 0
    mask = torch.zeros(flat.numel(), dtype=torch.bool, device=flat.device)
    mask[idx.to(flat.device)] = True
    return mask


class LocalVelocity:
    """Mixin for a :class:`~hvd_ext.feedback.base.Feedback` with a ``momentum`` attribute: each rank's
    velocity under the memory key ``name + VELOCITY_KEY`` (staged, so a skipped step keeps it).
    A rank resuming behind the others starts from the most advanced rank's velocity: a feedback lists
    its ``VELOCITY_KEY`` in its ``SHARED_KEYS``."""

    VELOCITY_KEY = "\x00velocity_u"

    def accumulate_velocity(self, name: str, grad: torch.Tensor, info=None) -> torch.Tensor:
        """u <- momentum * u + grad (+ weight_decay * param, the decay taken over from SGD, as torch
        adds it before its momentum); returns the new u (a new tensor) and stages it."""
        decay, param = getattr(self, "weight_decay", 0.0), getattr(info, "param", None)
        if decay and param is not None:
            grad = grad + param.detach().to(device=grad.device, dtype=grad.dtype).reshape(grad.shape) * decay
        u_old = self.memory.get(name + self.VELOCITY_KEY)
        u = grad.clone() if u_old is None else u_old.to(grad.dtype) * self.momentum + grad
        self._pending[name + self.VELOCITY_KEY] = u.detach()
        return u

    def mask_velocity(self, name: str, sent: torch.Tensor, info) -> None:
        """Zero the staged velocity on the coordinates this rank sent (momentum-factor masking)."""
        u = self._pending.get(name + self.VELOCITY_KEY)
        if u is not None:
            mask = sent_mask(sent, info).reshape(u.shape)
            self._pending[name + self.VELOCITY_KEY] = u.masked_fill(mask, 0.0)
