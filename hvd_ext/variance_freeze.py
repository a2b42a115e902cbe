"""Adaptive optimizers under lossy compression: dense warm-up, then a frozen second moment.

Technique of 1-bit Adam (Tang et al. 2021, "1-bit Adam: Communication Efficient Large-Scale
Training with Adam's Convergence Speed") and 0/1 Adam (Lu et al. 2022).

Why. Adam divides each coordinate's step by sqrt(v), v a running mean of g^2, so its update is
not linear in the gradient. Error feedback (top-k, DGC, sign codecs) delivers a coordinate's
gradient late and in bursts -- top-k at 1% sends about 100x the gradient once every ~100 steps:
v grows with the square of the burst and the summed step shrinks about tenfold. Unbiased
quantizers (QSGD, TernGrad) inflate v with their variance the same way, and training falls far
behind the uncompressed run.

What. (1) The dense warm-up, the first ``warmup`` exchanges, is sent dense (the exact average), so the
optimizer's second moment is estimated from true gradients. (2) From then on it is frozen at
its bias-corrected value V: Adam becomes momentum SGD under a fixed diagonal preconditioner,
which is linear in the gradient, so the delayed sums of error feedback add up as under SGD.

Warm-up length: for top-k and dgc a longer dense warm-up does worse after the switch
(``benchmarks/defaults_check.py`` with ``warmup=N``): gradients shrink as training
goes on, and a moment frozen from the first, largest gradients keeps the bursts of error
feedback in check. Sparsifiers, quantizers and PowerSGD therefore default to 0 (frozen from the
first step). The error-feedback sign codecs (efsignsgd, onebit) diverge without a warm-up
and keep 1-bit Adam's, 200 exchanges (``Compressor.default_warmup``); PowerSGD keeps its own
warm-up, 100 exchanges, so its moment is frozen when that ends.

How, without re-implementing the optimizer. Before each step the state is set so that the
optimizer's own update lands exactly on the frozen value. For the Adam family (Adam, AdamW,
NAdam, RAdam: ``v' = b2 v + (1 - b2) g^2`` read through ``1 - b2^t``) the state is set to
``(V (1 - b2^(t+1)) - (1 - b2) g^2) / b2``; RMSprop (``v' = a v + (1 - a) g^2``) and Adagrad
(``s' = s + g^2``) likewise. ``g`` is the gradient the optimizer will see (the exchanged
gradient plus L2 weight decay where the optimizer adds it). V is kept here and saved in the
optimizer's ``state_dict``, so a resumed run continues exactly. Optimizers not listed (Adamax,
custom ones) keep a live second moment.

Spec keys (every compressor, :mod:`hvd_ext.compression.common`): ``variance=auto|freeze|live``
(auto: freeze when the optimizer is one of the above and the codec keeps an error-feedback memory
or is QSGD below 8 bits -- see ``needs_freeze``) and ``warmup=N`` dense exchanges (old name ``variance_warmup``).
"""
from __future__ import annotations

import warnings
from typing import Any, Dict, Optional

import torch

from .compression.common import VARIANCE_CHOICES
from .feedback.base import NoFeedback

def _rule(optimizer) -> Optional[str]:
    """Which second-moment update ``optimizer`` uses: 'adam', 'rmsprop', 'adagrad' or None."""
    if isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW, torch.optim.NAdam, torch.optim.RAdam)):
        return "adam"
    if isinstance(optimizer, torch.optim.RMSprop):
        return "rmsprop"
    if isinstance(optimizer, torch.optim.Adagrad):
        return "adagrad"
    return None


def adaptive_kind(optimizer) -> Optional[str]:
    """Name of an adaptive optimizer whose second moment compression distorts, else None."""
    if _rule(optimizer) is not None or any("betas" in g for g in optimizer.param_groups):
        return type(optimizer).__name__
    return None


def needs_freeze(compressor) -> bool:
    """``variance=auto``: a lossy codec with an error-feedback memory (its delayed bursts are what
    the live second moment distorts), or one whose noise is known to inflate it
    (``Compressor.noise_inflates_live_moment``: QSGD below 8 bits). Other codecs without memory
    (8-bit QSGD, sign codecs) keep the live second moment, which absorbs their noise.
    ``compression="auto"`` keeps it live too: under an adaptive optimizer it does not choose a
    candidate with a memory (``AutoCompression``), unless ``variance=freeze`` is in its spec."""

    if getattr(compressor, "lossless", False):
        return False
    if getattr(compressor, "candidates", None) is not None:
        return False
    fb = getattr(compressor, "feedback", None)
    return (fb is not None and not isinstance(fb, NoFeedback)) or bool(compressor.noise_inflates_live_moment())


class VarianceFreeze:
    """Dense warm-up of ``warmup`` exchanges, then the optimizer's second moment frozen (see module)."""

    STATE_KEY = {"adam": "exp_avg_sq", "rmsprop": "square_avg", "adagrad": "sum"}

    def __init__(self, optimizer, warmup: int, names: Dict[torch.Tensor, str]):
        self.rule = _rule(optimizer)
        self.warmup = int(warmup)
        self.names = names
        self.frozen: Dict[str, torch.Tensor] = {}   # parameter name -> V (bias-corrected)

    @classmethod
    def for_optimizer(cls, optimizer, compressor, names) -> Optional["VarianceFreeze"]:
        """The freeze this (optimizer, compressor) pair needs, or None; warns once when it applies."""
        mode = getattr(compressor, "variance", "auto")
        if mode not in VARIANCE_CHOICES:
            raise ValueError(f"variance must be one of {', '.join(VARIANCE_CHOICES)}, got {mode!r}")
        warmup = compressor.warmup_length(frozen_moment=True)
        kind = adaptive_kind(optimizer)
        if mode == "live" or kind is None or (mode == "auto" and not needs_freeze(compressor)):
            return None
        if _rule(optimizer) is None:
            warnings.warn(f"hvd_ext: {kind}'s second moment is not one hvd_ext can freeze (Adam, AdamW, NAdam, "
                          f"RAdam, RMSprop, Adagrad): it stays live under compression '{compressor.name}'",
                          stacklevel=3)
            return None
        if mode == "auto":
            when = (f"the first {warmup} exchanges are dense, then {kind}'s second moment is frozen" if warmup
                    else f"{kind}'s second moment is frozen at its first value")
            why = ("so error feedback adds up as under SGD" if not compressor.noise_inflates_live_moment()
                   else "so the codec's noise does not inflate it")
            warnings.warn(f"hvd_ext: {kind} with lossy compression '{compressor.name}': {when} (1-bit Adam, Tang "
                          f"et al. 2021) {why}. Put variance=live in the compression "
                          f"spec to keep it live, warmup=N for N dense exchanges first.", stacklevel=3)
        return cls(optimizer, warmup, names)

    # ---- called by the optimizer around each local update ---------------------------------
    def before_step(self, optimizer, exchanges: int) -> None:
        """Pre-set the second-moment state so this step's update lands on the frozen value."""
        if exchanges < self.warmup:
            return
        key = self.STATE_KEY[self.rule]
        with torch.no_grad():
            for group in optimizer.param_groups:
                for p in group["params"]:
                    st = optimizer.state.get(p)
                    if p.grad is None or not st or key not in st or p.grad.is_sparse or torch.is_complex(p):
                        continue
                    self._preset(optimizer, group, p, st, key)

    def _preset(self, optimizer, group, p, st, key) -> None:
        name = self.names.get(p, str(id(p)))
        v = st[key]
        g = p.grad
        wd = float(group.get("weight_decay", 0) or 0)
        decoupled = group.get("decoupled_weight_decay", isinstance(optimizer, torch.optim.AdamW))
        if wd and not decoupled:
            g = g.add(p, alpha=wd)
        g2 = g.to(v.dtype) * g.to(v.dtype)
        if self.rule == "adam":
            b2 = float(group["betas"][1])
            t = float(st["step"]) if "step" in st else 0.0
            if name not in self.frozen:
                self.frozen[name] = v / (1.0 - b2 ** t) if t > 0 else v.clone()
            keep, fresh, corr = b2, 1.0 - b2, 1.0 - b2 ** (t + 1.0)
        elif self.rule == "rmsprop":
            a = float(group["alpha"])
            self.frozen.setdefault(name, v.clone())
            keep, fresh, corr = a, 1.0 - a, 1.0
        else:  # adagrad
            self.frozen.setdefault(name, v.clone())
            keep, fresh, corr = 1.0, 1.0, 1.0
        # A coordinate quiet during the warm-up (V ~ 0) that now gets a gradient is raised to what the
        # live optimizer would hold after that one gradient, and stays there: V never falls below
        # (1 - b2) g^2, so no step is larger than the live optimizer's first step on that coordinate.
        V = torch.maximum(self.frozen[name], g2.mul_(fresh), out=self.frozen[name])
        target = V * corr
        v.copy_(target.sub(g2).div_(keep))
        if self.rule == "adam" and "max_exp_avg_sq" in st:  # amsgrad: the maximum is the frozen value
            st["max_exp_avg_sq"].copy_(target)

    # ---- checkpoint -----------------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        return {"warmup": self.warmup, "frozen": {k: v.clone() for k, v in self.frozen.items()}}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.frozen = {k: v.clone() for k, v in (state or {}).get("frozen", {}).items()}
