"""Threshold sparsification (Strom 2015, "Scalable distributed DNN training using
commodity GPU cloud computing"; GRACE ``threshold``).

Sends every coordinate with |u| > tau (u = grad + memory), exact values
(fp32, or fp16 with ``values=fp16``); the rest stays in the residual memory
(default ``feedback=residual``). Strom sends +-tau instead of the value; we
send the value, as GRACE does. The payload size varies with the data (it can
exceed the dense size when tau is small), so ``wire_bytes`` is None.
"""
from __future__ import annotations

import torch

from ..options import Option, positive
from ._sparse import SparseCompressor, abs_score
from .base import register


@register("threshold")
class ThresholdCompressor(SparseCompressor):
    options = {
        "tau": Option(float, 1e-3, "tau > 0", positive, help="send coordinates with |u| > tau"),
        "values": Option(str, "fp32", choices=("fp32", "fp16"), help="value precision on the wire"),
    }

    reads_device = True  # how many coordinates exceed tau is known only from the data

    def selections(self, items, whole=None):
        for u, info in items:
            flat = u.reshape(-1)
            yield self._one(abs_score(flat if flat.dtype == torch.float32 else flat.float()), info, 0, "above",
                            tau=self.tau)
