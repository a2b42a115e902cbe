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
is plain residual feedback.

DGC owns the momentum (momentum correction, Lin et al. 2018, Sec. 3.2): the
outer optimizer must not apply it a second time. ``bind_optimizer`` (called by
``hvd_ext.DistributedOptimizer`` through the ``dgc`` compressor;
:class:`~hvd_ext.feedback.base.MomentumTakeover`) therefore

* ``torch.optim.SGD`` with momentum m > 0: takes it over -- the correction uses
  m (unless the spec sets ``momentum=`` explicitly) and the optimizer's
  ``momentum`` is set to 0, with a one-time warning. Its weight decay, when every
  parameter group has the same, is taken over with it (``u <- m * u + g + wd * w``,
  as torch adds it before its momentum; left in the optimizer it would act 1 - m
  times as strongly on the accumulated update). The check is repeated at
  every step, so a scheduler that cycles SGD momentum (``OneCycleLR``) drives
  DGC's momentum instead of re-enabling the optimizer's;
* Adam-family optimizers (``betas``): their first moment already is the
  momentum, so the correction is switched off (``momentum=0``: DGC is then
  top-k with accumulation, masking, clipping and warm-up) unless the spec sets
  ``momentum=`` explicitly; a one-time warning says so;
* any other optimizer with a non-zero ``momentum`` (RMSprop, ...): ``ValueError``
  asking for ``momentum=0`` on the optimizer.
"""
from __future__ import annotations

import math

import torch

from ..options import Option, non_negative
from .base import Feedback, MomentumTakeover, register
from .residual import residual_of
from .velocity import LocalVelocity

_V = "\x00dgc_v"


@register("dgc_momentum")
class DGCMomentumFeedback(LocalVelocity, MomentumTakeover, Feedback):
    options = {
        "momentum": Option(float, 0.9, "0 <= momentum < 1", lambda v: 0 <= v < 1,
                           help="momentum of the correction (default: the SGD optimizer's, which is taken over)"),
        "clip": Option(float, 0.0, "clip >= 0 (0 = off)", non_negative,
                       help="local gradient clipping: per-tensor max norm clip/sqrt(N)"),
    }

    VELOCITY_KEY = "\x00dgc_u"
    SHARED_KEYS = (VELOCITY_KEY,)   # not _V, the accumulated residual: per rank
    carries_weight_decay = True  # the velocity adds SGD's weight decay, taken over with the momentum
    adam_momentum = 0.0  # Adam's first moment is the momentum: correction off unless the spec sets it

    def __init__(self, **kw):
        super().__init__(**kw)
        self._init_takeover(kw)

    def compensate(self, name, grad, info):
        self._check_optimizer(info)
        g = grad
        if self.clip > 0:  # decided on the device: no read of the norm
            limit = self.clip / math.sqrt(max(int(getattr(info, "size", 1)), 1))
            norm = g.float().norm()
            clip = torch.isfinite(norm) & (norm > limit)
            g = g * torch.where(clip, limit / torch.where(clip, norm, torch.ones_like(norm)), 1.0).to(g.dtype)
        u = self.accumulate_velocity(name, g, info)
        v_old = self.memory.get(name + _V)
        return u.clone() if v_old is None else v_old + u

    def update(self, name, u, sent, info):
        # ``u`` here is what compensate returned: the accumulated velocity v.
        self._pending[name + _V] = residual_of(u, sent)     # fused kernel on CUDA
        self.mask_velocity(name, sent, info)
