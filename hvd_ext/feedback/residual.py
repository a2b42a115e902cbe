"""Residual error feedback (Seide et al. 2014, "1-bit SGD"; Karimireddy et al. 2019, "EF-SGD").

memory_i <- (grad_i + memory_i) - sent_i : every coordinate not sent this step
is added to the next step's gradient, so sent + remembered = input exactly.
Opt-in (``momentum=m`` in the spec): the velocity is accumulated *before*
compression and a ``torch.optim.SGD`` optimizer's own momentum is taken over
(set to 0). ``velocity=local``: each rank's own ``u <- m u + g`` replaces
``grad`` above (momentum correction, Lin et al. 2018); ``masking=1`` adds DGC's
momentum-factor masking (:mod:`hvd_ext.feedback.velocity`).
``velocity=exchanged``: ``u <- m * (last averaged update) + g``, the velocity
every rank shares, is compressed (1-bit Adam's compressed momentum, Tang et al.
2021; in exact arithmetic the same sum of updates as momentum applied after the
exchange, but the codec sees the smooth velocity instead of the raw gradient).
Under Adam, AdamW and RAdam the first moment is taken over instead (``betas[0]``
set to 0): ``u <- b1 * (last averaged update) + (1 - b1) g``, and the optimizer is
handed the average divided by ``1 - b1^t`` (t counted per tensor), which is Adam's
own moment when nothing is dropped. The second moment should then be frozen
(``hvd_ext.variance_freeze``, 1-bit Adam): a live one would average the squared
moment it is handed, not the squared gradient. During a dense warm-up
(``warmup=N``) this feedback is bypassed, so those N steps run without a
first moment.
Defaults (``compress_momentum``): the error-feedback sign codecs (efsignsgd,
onebit) under SGD momentum, randomk under SGD momentum and the Adam family.
Defaults (``correct_momentum``): ``sig`` under a plain SGD momentum
(``velocity=local,masking=1``). Not the default otherwise: it makes little difference to
topk, powersgd and int8 (``benchmarks/defaults_check.py``).

On CUDA float32 tensors (``hvd_ext.ops.cuda_kernels`` present and not forced off) the new
memory is written by the fused ``kernels.residual_update`` (one pass); elsewhere
``u - sent`` in torch (the same float32 values).
"""
from __future__ import annotations

import torch

from ..ops import cuda_kernels as _K
from ..options import Option
from .base import Feedback, MomentumTakeover, plain_momentum, register
from .velocity import LocalVelocity


def residual_of(u: torch.Tensor, sent: torch.Tensor) -> torch.Tensor:
    """A new, detached tensor ``u - sent`` (shape of ``u``): ``kernels.residual_update`` when the
    kernels run for both (CUDA float32, same shape), else torch. Shared by the feedbacks."""
    if (u.dtype == torch.float32 and sent.dtype == torch.float32 and u.shape == sent.shape
            and _K.backend(u, sent) == "cuda"):
        mem = torch.empty(u.shape, dtype=torch.float32, device=u.device)
        return _K.residual_update(mem, u.detach(), sent.detach())
    return (u - sent).detach()


_M = "\x00residual_m"   # the last averaged update (velocity=exchanged); identical on every rank
_T = "\x00residual_t"   # steps of that velocity so far (Adam's bias correction); identical on every rank


@register("residual")
class ResidualFeedback(LocalVelocity, MomentumTakeover, Feedback):
    """Error feedback; with ``momentum=m > 0`` in the spec it first accumulates the velocity
    ``u <- m * u + g`` and compresses ``u + memory`` (momentum correction, Lin et al. 2018), so
    the sum of applied updates equals momentum SGD's, and takes over a ``torch.optim.SGD``
    optimizer's momentum (see ``MomentumTakeover``). Default ``momentum=0``: plain error
    feedback under the optimizer's own momentum."""

    takes_over_by_default = False
    options = {"momentum": Option(float, 0.0, "0 <= momentum < 1", lambda v: 0 <= v < 1,
                                  help="velocity accumulated before compression; > 0 takes over the SGD "
                                       "optimizer's momentum (0 = plain error feedback)"),
               "velocity": Option(str, "local", choices=("local", "exchanged"),
                                  help="with momentum > 0: local = each rank's own velocity u <- m u + g "
                                       "(momentum correction); exchanged = u <- m * (last averaged update) + g, "
                                       "the velocity every rank shares (1-bit Adam's compressed momentum)"),
               "masking": Option(bool, False, "0 or 1",
                                 help="with velocity=local: zero the velocity on the coordinates this rank "
                                      "sent (momentum-factor masking, DGC)")}
    VELOCITY_KEY = "\x00residual_u"
    SHARED_KEYS = (_M, _T, VELOCITY_KEY)
    #: one memory for several codecs (``auto``'s candidates): no codec reconfigures it for itself
    shared_by_candidates = False

    def __init__(self, **kw):
        super().__init__(**kw)
        self._init_takeover(kw)
        self._explicit = set(kw)

    def adam_velocity(self) -> bool:
        return self.velocity == "exchanged"

    @property
    def node_level(self) -> bool:
        """Masking needs this rank's own sent mask, which the node-aware exchange does not give
        (inside a node everything is sent): without masking the memory can live at node level.
        Decided by the options alone, so a momentum restored later cannot change the route."""
        return not (self.masking and self.velocity == "local")

    @property
    def carries_weight_decay(self) -> bool:
        """The local velocity adds SGD's weight decay itself (the exchanged one does not)."""
        return self.velocity == "local"

    def compensate(self, name, grad, info):
        self._check_optimizer(info)
        if self.momentum and self.velocity == "exchanged":
            m_bar = self.memory.get(name + _M)
            if self._adam:  # Adam's first moment: an exponential average, m <- b1 m + (1 - b1) g
                grad = grad * (1.0 - self.momentum)  # a new tensor
            elif m_bar is None:
                grad = grad.clone()
            if m_bar is not None:
                grad = m_bar.to(grad.dtype) * self.momentum + grad
        elif self.momentum:
            grad = self.accumulate_velocity(name, grad, info)
        mem = self.memory.get(name)
        if mem is None:
            return grad
        return grad + mem

    def adjust(self, name, result, info, support=None):
        if self.momentum and self.velocity == "exchanged":
            self._pending[name + _M] = result.detach().reshape(info.shape).clone()
            if self._adam:  # the optimizer runs with betas[0] = 0: hand it the bias-corrected moment
                t = self.memory.get(name + _T)
                t = 1 if t is None else int(t) + 1
                self._pending[name + _T] = torch.tensor(t)
                return result / (1.0 - self.momentum ** t)
        return result

    def update(self, name, u, sent, info):
        self._pending[name] = residual_of(u, sent)
        if self.momentum and self.masking and self.velocity == "local":
            self.mask_velocity(name, sent, info)


def compress_momentum(comp, optimizer, adam: bool) -> None:
    """Make ``comp``'s residual feedback compress the momentum shared by every rank (1-bit Adam's
    compressed momentum, Tang et al. 2021) instead of letting the optimizer apply its momentum to
    the delayed, bursty stream error feedback delivers: ``velocity=exchanged`` and the optimizer's
    momentum taken over -- ``torch.optim.SGD``'s ``momentum``, and with ``adam=True`` also the first
    moment (``betas[0]``) of Adam, AdamW and RAdam. The optimizer's momentum on an
    error-compensated sign stream diverges; compressing the shared velocity tracks ``signum``.
    The spec's ``momentum=``/``velocity=`` keys, when given, win; call it before the feedback binds the optimizer.
    A memory several codecs share (``auto``'s candidates) is not reconfigured for one of them: ``comp``
    is marked ``needs_compressed_momentum`` instead, and ``auto`` does not choose it."""
    fb = comp.feedback
    if fb is None or fb.name != "residual":
        return
    if isinstance(optimizer, torch.optim.SGD):
        has = any(float(g.get("momentum", 0) or 0) > 0 for g in optimizer.param_groups)
    else:
        has = adam and isinstance(optimizer, fb.ADAM_FAMILY)
    if fb.shared_by_candidates:
        comp.needs_compressed_momentum = has
        return
    if not has:
        return
    if "velocity" not in getattr(fb, "_explicit", ()):
        fb.velocity = "exchanged"
    fb.takes_over_by_default = True
    fb.takes_over_adam_by_default = adam


def correct_momentum(comp, optimizer) -> None:
    """Make ``comp``'s residual feedback take over a ``torch.optim.SGD`` optimizer's momentum with
    DGC's momentum correction and momentum-factor masking (``velocity=local,masking=1``; Lin et al.
    2018): each rank accumulates its own velocity before selection and forgets it on what it sent.
    For a sparsifier at high sparsity, the optimizer's momentum applied to the rare, large bursts
    that error feedback delivers overshoots. The spec's ``momentum=``/``velocity=``/``masking=`` keys,
    when given, win; call it before the feedback binds the optimizer. Only a plain momentum is taken,
    with its weight decay (``plain_momentum``): Nesterov, dampening or per-group values stay with the
    optimizer. Not for a memory several codecs share (``auto``'s candidates)."""
    fb = comp.feedback
    if fb is None or fb.name != "residual" or not isinstance(optimizer, torch.optim.SGD):
        return
    explicit = getattr(fb, "_explicit", ())
    if "momentum" in explicit or fb.shared_by_candidates:
        return
    # set even with nothing to take: a checkpoint's taken momentum (load_state_dict) then runs masked
    if "velocity" not in explicit:
        fb.velocity = "local"
    if "masking" not in explicit:
        fb.masking = True
    fb.takes_over_by_default = plain_momentum(optimizer.param_groups)
