"""The Feedback interface: per-tensor memory that makes biased compressors converge.

Order of calls for one tensor in one step (see ``hvd_ext.pipeline``)::

    u = fb.compensate(name, grad, info)            # e.g. grad + residual
    payload = compressor.compress(u)  ... exchange ...
    result = fb.adjust(name, result, info, support) # may change the applied update
    fb.update(name, u, sent, info)                 # stage the new memory

Staged memory becomes current only on ``commit()``; ``discard()`` drops it.
The optimizer commits after a step whose gradients were finite on every rank
and discards otherwise, so a skipped step leaves the memory untouched.
The memory is part of the optimizer ``state_dict()``.
"""
from __future__ import annotations

import warnings
from typing import Any, Callable, ClassVar, Dict, Optional, Sequence, Tuple

import torch

from ..options import Option, resolve_options


# Memory keys: a tensor's error memory is keyed by its name; a feedback's other entries for it by
# ``name + SEP + what`` (``what`` names the entry; no parameter name contains SEP, hvd_ext's own
# flat-record names start with it), its tensor-independent ones by ``SEP + what``.
SEP = "\x00"


class Feedback:
    name: ClassVar[str] = "?"
    options: ClassVar[Dict[str, Option]] = {}
    # True when the node-aware exchange can keep this memory at node level (error feedback of what
    # the node's compression left out); momentum masking and prediction sharing need each rank's
    # own sent mask.
    node_level: ClassVar[bool] = False
    #: key endings (``SEP + what``) of the entries a rank resuming behind the others takes from the most
    #: advanced one: state every rank keeps identical, and velocities (Horovod's resume recipe gives
    #: every rank rank 0's momentum). Every other entry stays this rank's own: an error memory is what
    #: this rank has not sent yet, and the sum over ranks is the update still owed -- a copy would pay
    #: the root's twice. Collected over the class hierarchy (``shared_keys()``).
    SHARED_KEYS: ClassVar[Tuple[str, ...]] = ()

    def __init__(self, **kwargs):
        self.opts = resolve_options(f"feedback '{self.name}'", self.options, kwargs)
        for k, v in self.opts.items():
            setattr(self, k, v)
        self.memory: Dict[str, torch.Tensor] = {}
        self._pending: Dict[str, torch.Tensor] = {}

    def bind_optimizer(self, optimizer) -> None:
        """See ``Compressor.bind_optimizer`` (which calls this). Default: nothing."""

    def compensate(self, name: str, grad: torch.Tensor, info) -> torch.Tensor:
        return grad

    def adjust(self, name: str, result: torch.Tensor, info, support: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Change the applied (exchanged, averaged) update; ``support`` is the
        boolean mask of coordinates some rank sent, when the compressor knows it."""
        return result

    def update(self, name: str, u: torch.Tensor, sent: torch.Tensor, info) -> None:
        pass

    def forget(self, name: str) -> None:
        """Stage the removal of ``name``'s memory (its whole input was sent losslessly)."""
        self._pending[name] = None

    def commit(self) -> None:
        for k, v in self._pending.items():
            if v is None:
                self.memory.pop(k, None)
            else:
                self.memory[k] = v
        self._pending = {}

    def discard(self) -> None:
        self._pending = {}

    def state_dict(self) -> Dict[str, Any]:
        return {"memory": {k: v.clone() for k, v in self.memory.items()}}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.memory = {k: v.clone() for k, v in state.get("memory", {}).items()}
        self._pending = {}

    @classmethod
    def shared_keys(cls) -> Tuple[str, ...]:
        """The ``SHARED_KEYS`` of this class and of every class it derives from."""
        return tuple(k for c in cls.__mro__ for k in vars(c).get("SHARED_KEYS", ()))

    def is_shared(self, key: str) -> bool:
        """Whether the memory entry ``key`` is taken from the most advanced rank on a resume."""
        return key.endswith(self.shared_keys())

    def shared_state_dict(self) -> Dict[str, Any]:
        """The memory entries a rank resuming behind the others takes from the most advanced one
        (the optimizer's state agreement): those ``is_shared`` names."""
        return {"memory": shared_entries(self.memory, self.is_shared)}

    def load_shared_state_dict(self, state: Dict[str, Any]) -> None:
        """Take ``state``'s shared entries (only those ``is_shared`` names); this rank's own memory
        (its error memories) stays."""
        self.load_state_dict({"memory": with_shared(self.memory, state.get("memory", {}), self.is_shared)})


def shared_entries(memory: Dict[str, torch.Tensor], is_shared: Callable[[str], bool]) -> Dict[str, torch.Tensor]:
    """Copies of ``memory``'s entries that every rank holds alike (``is_shared`` keys)."""
    return {k: v.clone() for k, v in memory.items() if is_shared(k)}


def with_shared(mine: Dict[str, torch.Tensor], theirs: Dict[str, torch.Tensor],
                is_shared: Callable[[str], bool]) -> Dict[str, torch.Tensor]:
    """This rank's own entries of ``mine`` with the shared entries of ``theirs`` (a resume's agreement:
    what every rank holds alike comes from the most advanced rank; error memories stay each rank's)."""
    return {**{k: v for k, v in mine.items() if not is_shared(k)},
            **{k: v for k, v in (theirs or {}).items() if is_shared(k)}}


def give_back_momentum(opt, momenta: Sequence[float], adam: bool = False, decay: float = 0.0) -> None:
    """Give each parameter group of ``opt`` back the momentum (Adam: beta1) a takeover held for it,
    and ``decay`` as its weight decay, and drop its stale momentum buffers; nothing when the optimizer
    has a momentum already (a checkpoint restored it while the takeover was bypassed)."""
    groups = opt.param_groups
    if any(float(g["betas"][0] if adam else (g.get("momentum", 0) or 0)) for g in groups):
        return
    for g, m in zip(groups, momenta):
        if adam:
            g["betas"] = (m, g["betas"][1])
            continue
        g["momentum"] = m
        if decay:
            g["weight_decay"] = decay
        for p in g["params"]:
            opt.state.get(p, {}).pop("momentum_buffer", None)


def group_values(groups, key: str) -> set:
    """The distinct values of an optimizer hyper-parameter over its parameter groups (missing = 0)."""
    return {float(g.get(key, 0) or 0) for g in groups}


def plain_momentum(groups) -> bool:
    """One non-zero SGD momentum and one weight decay in every parameter group, without Nesterov or
    dampening: what a feedback that carries the decay (``carries_weight_decay``) can take over whole."""
    values, decays = group_values(groups, "momentum"), group_values(groups, "weight_decay")
    return (len(values) == 1 and 0.0 not in values and len(decays) == 1
            and not any(g.get("nesterov") or float(g.get("dampening", 0) or 0) != 0 for g in groups))


class MomentumTakeover:
    """Mixin for feedbacks that apply SGD momentum *before* compression (momentum correction,
    Lin et al. 2018, Sec. 3.2): with error feedback, momentum applied by the outer optimizer to
    the compressed, delayed stream of updates destabilizes training (``benchmarks/defaults_check.py``);
    accumulating the velocity locally and compressing it keeps the sum of applied updates
    equal to momentum SGD's.

    ``bind_optimizer`` (reached through ``Compressor.bind_optimizer``): a ``torch.optim.SGD``
    optimizer's momentum m > 0 is taken over -- this feedback uses m (unless the spec set
    ``momentum=`` explicitly) and the optimizer's ``momentum`` is set to 0, with a one-time
    warning. The check repeats once per step, so a scheduler cycling SGD momentum
    (``OneCycleLR``) drives this momentum instead of re-enabling the optimizer's. Other
    optimizers are left alone (``adam_momentum`` says what to do with Adam's). A non-SGD
    optimizer with a non-zero ``momentum`` (RMSprop) is refused when this feedback applies
    momentum itself.

    Adam, AdamW and RAdam (whose first moment is ``m <- b1 m + (1 - b1) g`` read through
    ``1 - b1^t``) are taken over only by a feedback that compresses the shared velocity
    (``adam_velocity()``): ``betas[0]`` is set to 0 and the feedback compresses the moment
    itself, in the same exponential-average form and with the same bias correction, as 1-bit
    Adam does (Tang et al. 2021)."""

    #: momentum used with Adam-family optimizers when the spec does not set ``momentum=``
    #: (None: leave ``self.momentum`` as it is).
    adam_momentum: Optional[float] = None
    #: take over SGD momentum without ``momentum=`` in the spec (dgc: yes; residual: opt-in)
    takes_over_by_default: bool = True
    #: also take over Adam's first moment without ``momentum=`` in the spec (needs ``adam_velocity()``)
    takes_over_adam_by_default: bool = False
    #: without ``momentum=`` in the spec, take over only a plain momentum (``plain_momentum``: one
    #: value and one weight decay in every group, no Nesterov, no dampening); else the optimizer keeps it
    takes_over_plain_only: bool = False
    #: with SGD's momentum also take over its weight decay, when every group has the same: torch adds
    #: wd * p to the gradient *before* the momentum, so a velocity built here must add it too
    #: (``LocalVelocity.accumulate_velocity``), or the decay would act 1 - m times as strongly
    carries_weight_decay: bool = False
    #: optimizers whose first moment can be taken over (plain exponential average, ``1 - b1^t`` correction)
    ADAM_FAMILY = (torch.optim.Adam, torch.optim.AdamW, torch.optim.RAdam)

    def _init_takeover(self, kwargs) -> None:
        self._explicit_momentum = "momentum" in kwargs
        self._optimizer = None
        self._checked_step = None
        self._adam = False   # the optimizer's betas[0] is taken over: the velocity is an exponential average
        self.weight_decay = 0.0  # SGD's weight decay, taken over with its momentum (carries_weight_decay)
        self._bound_sgd = None   # the SGD optimizer bound, even when it had nothing to take (a restored one)
        self._held_momentum: Optional[float] = None   # the optimizer's value this feedback holds now
        self._held_decay = 0.0                        # and its weight decay (handed back with it)

    def adam_velocity(self) -> bool:
        """Whether this feedback can carry Adam's first moment (it compresses the shared velocity)."""
        return False

    # The momentum taken over is kept in the memory (so in ``state_dict`` and in the resume agreement):
    # an optimizer restored from a checkpoint before it is wrapped already has momentum 0 / betas[0] 0.
    _TAKEN = SEP + "taken_momentum"
    _TAKEN_DECAY = SEP + "taken_weight_decay"
    SHARED_KEYS = (_TAKEN, _TAKEN_DECAY)

    def _remember_taken(self) -> None:
        self.memory[self._TAKEN] = torch.tensor(float(self.momentum), dtype=torch.float64)
        if self.weight_decay:
            self.memory[self._TAKEN_DECAY] = torch.tensor(float(self.weight_decay), dtype=torch.float64)

    def _take_over_decay(self, groups) -> bool:
        """SGD's weight decay, when this feedback carries it and every group has the same: set to 0 in
        the optimizer and applied in the velocity instead (kept while a later check finds 0)."""
        decays = group_values(groups, "weight_decay")
        if not self.carries_weight_decay or len(decays) != 1 or 0.0 in decays:
            return False
        for g in groups:
            g["weight_decay"] = 0.0
        self.weight_decay = decays.pop()
        return True

    def load_state_dict(self, state) -> None:
        mine = self.memory.get(self._TAKEN)
        super().load_state_dict(state)
        taken = self.memory.get(self._TAKEN)
        if taken is None and mine is not None:  # a checkpoint without it: keep this one's
            self.memory[self._TAKEN] = mine
        elif taken is not None and not self._explicit_momentum:
            self.momentum = float(taken)
        decay = self.memory.get(self._TAKEN_DECAY)
        if decay is not None:
            self.weight_decay = float(decay)
        elif taken is not None:   # taken without a decay (or before decay was taken): the optimizer keeps it
            self.weight_decay = 0.0
        if taken is not None and float(taken) and self._optimizer is None and self._bound_sgd is not None:
            # restored before wrapping, nothing was left to take: watch it from now on, so a scheduler
            # writing its momentum back does not add the optimizer's momentum to the one restored here
            self._optimizer, self._adam = self._bound_sgd, False
        self._checked_step = None  # the restored optimizer is checked again at the next step

    def bind_optimizer(self, optimizer) -> None:
        groups = optimizer.param_groups
        kind = type(optimizer).__name__
        if self._explicit_momentum and not self.momentum:
            return  # the spec says momentum=0: leave the optimizer's momentum alone
        if isinstance(optimizer, torch.optim.SGD):
            self._bound_sgd = optimizer
        adam = isinstance(optimizer, self.ADAM_FAMILY) and self.adam_velocity()
        if not self._explicit_momentum and not (self.takes_over_adam_by_default if adam else self.takes_over_by_default):
            return
        if adam or isinstance(optimizer, torch.optim.SGD):
            if not adam and self.takes_over_plain_only and not self._explicit_momentum and not plain_momentum(groups):
                return
            self._optimizer, self._adam = optimizer, adam
            self._take_over_momentum(announce=True)
        elif any("betas" in g for g in groups):
            if self.adam_momentum is not None and not self._explicit_momentum and self.momentum != self.adam_momentum:
                warnings.warn(f"hvd_ext feedback '{self.name}': {kind} keeps its own first moment (betas), so the "
                              f"momentum correction is switched off (momentum={self.adam_momentum}). To force "
                              f"it anyway put momentum=0.9 in the compression spec.", stacklevel=4)
                self.momentum = self.adam_momentum
        elif self.momentum and any(float(g.get("momentum", 0) or 0) != 0 for g in groups):
            raise ValueError(f"feedback '{self.name}' applies momentum {self.momentum} itself (momentum "
                             f"correction); {kind} has momentum={[g.get('momentum') for g in groups]}: create "
                             f"the optimizer with momentum=0, use torch.optim.SGD (whose momentum is taken "
                             f"over), or put momentum=0 in the compression spec")

    def _take_over_momentum(self, announce: bool = False) -> None:
        """Set the optimizer's momentum (SGD) or first moment (``betas[0]``, Adam family) to 0 and apply
        its value here instead, unless the spec set ``momentum=``."""
        groups, adam = self._optimizer.param_groups, self._adam
        found = sorted({float(g["betas"][0] if adam else (g.get("momentum", 0) or 0)) for g in groups} - {0.0})
        if not found:
            return
        what, field, zero = (("first moment", "betas[0]", "betas=(0, b2)") if adam
                             else ("momentum", "momentum", "momentum=0"))
        if len(found) > 1:
            raise ValueError(f"feedback '{self.name}' takes over the optimizer's {what}, but its parameter "
                             f"groups have different {field} {found}: give every group the same {field}, or "
                             f"create the optimizer with {zero} and put momentum= in the compression spec")
        m = found[0]
        special = not adam and any(g.get("nesterov") or float(g.get("dampening", 0) or 0) != 0 for g in groups)
        for g in groups:
            if adam:
                g["betas"] = (0.0, g["betas"][1])
            else:
                g["momentum"] = 0.0
        self._held_momentum = m
        if not adam and self._take_over_decay(groups):
            self._held_decay = self.weight_decay
        if announce:
            if adam:
                how = ("): the moment shared by every rank is compressed, as in 1-bit Adam (Tang et al. 2021), "
                       "and the optimizer runs with betas[0]=0")
            else:
                used = self.momentum if self._explicit_momentum else m
                how = ("the momentum shared by every rank is compressed, as in 1-bit Adam, Tang et al. 2021"
                       if getattr(self, "velocity", "local") == "exchanged" else "momentum correction, Lin et al. 2018")
                decay = f" and weight decay {self.weight_decay}" if self.weight_decay else ""
                how = (f"; {how}): the optimizer now runs with momentum=0{' and weight_decay=0' if decay else ''} "
                       f"and the momentum {used}{decay} is applied before compression"
                       + (" (nesterov/dampening not reproduced)" if special else ""))
            warnings.warn(f"hvd_ext feedback '{self.name}': took over {type(self._optimizer).__name__}'s {what} "
                          f"({field}={m}{how}. To silence this, create the optimizer with {zero} (the feedback "
                          "then uses the spec's momentum).", stacklevel=5)
        if not self._explicit_momentum:
            self.momentum = m
        self._remember_taken()

    def hand_back_momentum(self) -> None:
        """Steps that bypass this feedback (the gradient exchange off between parameter averages, a
        dense warm-up) still need the momentum: give the optimizer back what was taken from it (its
        momentum, its weight decay), once; its momentum buffer, from before this feedback held it, is
        dropped. The next step through the feedback takes them over again (``_check_optimizer``)."""
        opt, m = self._optimizer, self._held_momentum
        if opt is None or m is None:
            return
        decay, self._held_momentum, self._held_decay = self._held_decay, None, 0.0
        self._checked_step = None
        give_back_momentum(opt, [m] * len(opt.param_groups), self._adam, decay)

    def _check_optimizer(self, info) -> None:
        if self._optimizer is not None:
            step = getattr(info, "step", None)
            if step != self._checked_step:  # once per step: a scheduler may have set momentum again
                self._checked_step = step
                self._take_over_momentum()


_REGISTRY: Dict[str, type] = {}


def register(name: str):
    def deco(cls):
        if name in _REGISTRY:
            raise RuntimeError(f"feedback {name!r} registered twice")
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return deco


def registry() -> Dict[str, type]:
    return dict(_REGISTRY)


@register("none")
class NoFeedback(Feedback):
    """No memory: what is not sent is lost."""

    node_level = True
