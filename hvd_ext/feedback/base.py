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

from typing import Any, ClassVar, Dict, Optional

import torch

from ..options import Option, resolve_options


class Feedback:
    name: ClassVar[str] = "?"
    options: ClassVar[Dict[str, Option]] = {}

    def __init__(self, **kwargs):
        self.opts = resolve_options(f"feedback '{self.name}'", self.options, kwargs)
        for k, v in self.opts.items():
            setattr(self, k, v)
        self.memory: Dict[str, torch.Tensor] = {}
        self._pending: Dict[str, torch.Tensor] = {}

    def compensate(self, name: str, grad: torch.Tensor, info) -> torch.Tensor:
        return grad

    def adjust(self, name: str, result: torch.Tensor, info, support: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Change the applied (exchanged, averaged) update; ``support`` is the
        boolean mask of coordinates some rank sent, when the compressor knows it."""
        return result

    def update(self, name: str, u: torch.Tensor, sent: torch.Tensor, info) -> None:
        pass

    def commit(self) -> None:
        self.memory.update(self._pending)
        self._pending = {}

    def discard(self) -> None:
        self._pending = {}

    def state_dict(self) -> Dict[str, Any]:
        return {"memory": {k: v.clone() for k, v in self.memory.items()}}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.memory = {k: v.clone() for k, v in state.get("memory", {}).items()}
        self._pending = {}


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
