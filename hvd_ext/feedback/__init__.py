"""Feedback memories; each module registers itself on import."""
from __future__ import annotations

import importlib as _importlib

from .base import Feedback, register, registry  # noqa: F401
from . import residual  # noqa: F401

for _mod in ("ewma", "dgc_momentum"):
    try:
        _importlib.import_module(f"{__name__}.{_mod}")
    except ModuleNotFoundError as _e:
        if _e.name != f"{__name__}.{_mod}":
            raise
