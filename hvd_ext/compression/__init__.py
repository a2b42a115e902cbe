"""Compressors: one module per codec; importing a module registers it.

The spec-string front door (``compression_from_spec``) lives in :mod:`hvd_ext.spec`. Add a
compressor by writing one module and importing it below (see ``docs/extending.md``).
"""
from __future__ import annotations

from .base import ROUTE_CHOICES, Compressor, Continue, TensorInfo, register, registry  # noqa: F401

# One module per compressor; importing registers it.
from . import none, fp16, bf16, randomk  # noqa: F401,E401  (foundation)
from . import topk, threshold, dgc, sig  # noqa: F401,E401  (sparsification)
from . import qsgd, terngrad, signsgd, efsignsgd, signum, onebit, natural, int8, powersgd, qdist  # noqa: F401,E401

__all__ = ["Compressor", "Continue", "TensorInfo", "register", "registry"]
