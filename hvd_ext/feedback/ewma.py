"""Exponential-smoothing compensation for sparsification (technique 4 in docs/techniques.md;
Gardner, "Exponential smoothing", J. Forecasting 1985). Usable with any sparsifier: ``topk:ratio=0.01,feedback=ewma``.

Every rank holds the same smoothed estimate S of the aggregated gradient
(same inputs on every rank: the exchanged result and the support Omega, the
set of coordinates some rank sent). Per tensor and step, with G the exchanged
result (``aggregate`` x the exchange's scale sigma; sigma = 1/N for
``op=Average``, 1 for ``op=Sum``)::

    S_j   <- beta * S_j + (1 - beta) * G_j          j in Omega (S unchanged elsewhere)
    A_j    = G_j  (j in Omega),   lambda * S_j  (j not in Omega)      applied update
    r_i   <- u_i - sent_i - c * lambda * S_j * [j not in Omega],   c = 1 / (sigma * N)

Why c: the exchange applies sigma * sum_i sent_i, so the rank-combined memory is
R = sigma * sum_i r_i and R' = sigma*sum_i g_i + R - sigma*sum_i sent_i - sigma*N*c*lambda*S*[not Omega]
= sigma*sum_i g_i + R - A + (1 - sigma*N*c)*lambda*S*[not Omega]. With c = 1/(sigma*N)
the last term vanishes: sum_t A_t + R_T = sum_t sigma*sum_i g_i,t exactly -- the
prediction is paid back from the memories once, never counted twice. Under
``op=Average`` (our default) c = 1: *each* worker's residual is reduced by the
full lambda*S_j (the average of N workers each "sending" lambda*S_j is
lambda*S_j); under ``op=Sum`` c = 1/N, i.e. r_i <- r_i - lambda*S_j/N.

Per-step rate (``rate=1``, default). With error feedback a coordinate that
waited a_j steps arrives carrying about a_j steps of gradient, so smoothing G_j
itself would make S (and the prediction applied on *every* unsent step) about
a_j times too large. With ``rate=1`` every rank also keeps a_j (steps since some
rank last sent j; identical everywhere, it depends only on the shared support)
and smooths the per-step estimate G_j / a_j instead:
``S_j <- beta * S_j + (1 - beta) * G_j / a_j`` on j in Omega, then a_j <- 0.
``rate=0`` smooths G_j as written above.

Momentum (``momentum=m``; by default a ``torch.optim.SGD`` optimizer's plain momentum -- one
value, no Nesterov, no dampening, one weight decay, which is taken over with it -- is taken
over, see ``MomentumTakeover``): each rank accumulates its velocity u <- m*u + g before selection
and u replaces g above, with DGC's momentum-factor masking on what it sent
(:mod:`hvd_ext.feedback.velocity`). The prediction then smooths the exchanged velocity.
At high sparsity a coordinate waits hundreds of steps; the optimizer's momentum applied to
the burst it then delivers, and to the prediction, overshoots.

sigma comes from ``info.scale`` (set by the pipeline), else 1/N.
Without a support mask from the compressor, Omega = {G != 0}. ``lambda=0`` is
exactly residual error feedback with the same velocity. S is part of the state dict.

Kernels: on CUDA (``hvd_ext.ops.cuda_kernels`` present and not forced off) the S update
is ``kernels.ewma_update`` (one fused masked pass; beta and 1-beta rounded to
float32 and the products rounded separately, as torch does) and ``u - sent`` is
``kernels.residual_update``; elsewhere the torch code below.
"""
from __future__ import annotations

import torch

from ..ops import cuda_kernels as _K
from ..options import Option, non_negative, unit_interval
from .base import Feedback, MomentumTakeover, register
from .residual import residual_of
from .velocity import LocalVelocity

_S = "\x00ewma_S"
_AGE = "\x00ewma_age"


@register("ewma")
class EWMAFeedback(LocalVelocity, MomentumTakeover, Feedback):
    needs_support = True
    options = {
        "beta": Option(float, 0.9, "0 <= beta <= 1", unit_interval, help="smoothing of S on sent coordinates"),
        "lambda": Option(float, 0.1, "lambda >= 0", non_negative,
                         help="weight of the prediction lambda*S on coordinates nobody sent (0 = error feedback)"),
        "rate": Option(bool, True, "0 or 1",
                       help="smooth the per-step rate G_j / (steps since j was last sent) instead of G_j"),
        "momentum": Option(float, 0.0, "0 <= momentum < 1", lambda v: 0 <= v < 1,
                           help="velocity accumulated before selection, masked where sent (default: an SGD "
                                "optimizer's momentum, taken over; 0 = the optimizer keeps its momentum)"),
    }
    VELOCITY_KEY = "\x00ewma_u"
    SHARED_KEYS = (_S, _AGE, VELOCITY_KEY)   # not the residual: per rank
    takes_over_plain_only = True
    carries_weight_decay = True

    def __init__(self, **kw):
        super().__init__(**kw)
        self.lam = self.opts["lambda"]
        self._share = {}
        self._init_takeover(kw)

    def compensate(self, name, grad, info):
        self._check_optimizer(info)
        if self.momentum:
            grad = self.accumulate_velocity(name, grad, info)
        mem = self.memory.get(name)
        return grad if mem is None else grad + mem

    def share_factor(self, info) -> float:
        """c = 1 / (sigma * N): how much of the prediction each worker's residual pays."""
        n = max(int(getattr(info, "size", 1)), 1)
        sigma = float(info.scale) if info is not None and info.scale is not None else 1.0 / n
        return 1.0 / (sigma * n)

    def adjust(self, name, result, info, support=None):
        flat = result.reshape(-1)
        sup = (flat != 0) if support is None else support.reshape(-1).to(flat.device)
        S = self.memory.get(name + _S)
        if S is None:
            S = torch.zeros(flat.numel(), dtype=torch.float32, device=flat.device)
        G = flat.float()
        if self.rate:
            age = self.memory.get(name + _AGE)
            age = torch.ones_like(S) if age is None else age + 1
            G = G / age
            self._pending[name + _AGE] = torch.where(sup, torch.zeros_like(age), age)
        if S.dtype == torch.float32 and _K.backend(S, flat, sup) == "cuda":
            S_new = S.clone(memory_format=torch.contiguous_format)
            _K.ewma_update(S_new, G, sup, self.beta)
        else:
            S_new = torch.where(sup, S * self.beta + G * (1.0 - self.beta), S)
        self._pending[name + _S] = S_new
        if self.lam == 0:
            self._share.pop(name, None)
            return result
        pred = torch.where(sup, torch.zeros_like(S), S * self.lam)
        self._share[name] = pred * self.share_factor(info)
        out = torch.where(sup, flat, pred.to(flat.dtype))
        return out.reshape(result.shape)

    def update(self, name, u, sent, info):
        r = residual_of(u, sent)
        share = self._share.pop(name, None)
        if share is not None:
            r = r - share.reshape(r.shape).to(r.dtype)
        self._pending[name] = r.detach()
        if self.momentum:
            self.mask_velocity(name, sent, info)

    def discard(self):
        super().discard()
        self._share = {}
