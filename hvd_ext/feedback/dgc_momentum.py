"""DGC momentum correction, local gradient clipping and momentum-factor masking
(Lin et al., "Deep Gradient Compression", ICLR 2018), as a feedback.

Per tensor, worker-local (the default feedback of ``dgc``)::

    g <- g * min(1, (clip / sqrt(N)) / ||g||)      local gradient clipping (clip > 0)
    u <- m * u + g                                   momentum correction
    v <- v + u                                       velocity accumulation; v is compressed
    after the exchange, on the sent coordinates:  v <- v - sent (= 0),  u <- 0   (masking)

so sent + v_new = v exactly. The sent set is the compressor's
``info.sparse_indices`` when it provides one, else ``sent != 0``.
The memory holds u and v per tensor; with ``momentum=0`` and no clipping this
is plain residual feedback. Use the outer optimizer without momentum.
"""
from __future__ import annotations

import math

import torch

from ..options import Option, non_negative
from .base import Feedback, register
from .residual import residual_of

_U = "\x00dgc_u"
_V = "\x00dgc_v"


def sent_mask(sent: torch.Tensor, info) -> torch.Tensor:
    idx = info.sparse_indices if info is not None else None
    flat = sent.reshape(-1)
    if idx is None:
        return flat != 0
    mask = torch.zeros(flat.numel(), dtype=torch.bool, device=flat.device)
    mask[idx.to(flat.device)] = True
    return mask


@register("dgc_momentum")
class DGCMomentumFeedback(Feedback):
    options = {
        "momentum": Option(float, 0.9, "0 <= momentum < 1", lambda v: 0 <= v < 1,
                           help="momentum of the correction (use the outer optimizer without momentum)"),
        "clip": Option(float, 0.0, "clip >= 0 (0 = off)", non_negative,
                       help="local gradient clipping: per-tensor max norm clip/sqrt(N)"),
    }

    def compensate(self, name, grad, info):
        g = grad
        if self.clip > 0:
            limit = self.clip / math.sqrt(max(int(getattr(info, "size", 1)), 1))
            norm = float(g.float().norm())
            if math.isfinite(norm) and norm > limit:
                g = g * (limit / norm)
        u_old = self.memory.get(name + _U)
        v_old = self.memory.get(name + _V)
        u = g.clone() if u_old is None else u_old * self.momentum + g
        v = u.clone() if v_old is None else v_old + u
        self._pending[name + _U] = u.detach()
        return v

    def update(self, name, u, sent, info):
        # ``u`` here is what compensate returned: the accumulated velocity v.
        mask = sent_mask(sent, info).reshape(u.shape)
        self._pending[name + _V] = residual_of(u, sent)     # fused kernel on CUDA
        mom = self._pending.get(name + _U)
        if mom is not None:
            self._pending[name + _U] = mom.masked_fill(mask, 0.0)
