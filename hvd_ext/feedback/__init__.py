"""Feedback memories; each module registers itself on import."""
from __future__ import annotations

from .base import Feedback, register, registry  # noqa: F401
from . import residual, ewma, dgc_momentum  # noqa: F401,E401
