"""Top-k sparsification (Aji & Heafield 2017, "Sparse Communication for Distributed
Gradient Descent"; Stich et al. 2018, "Sparsified SGD with memory"; GRACE ``topk``).

Each step sends the k = ceil(ratio * n) coordinates of u = grad + memory with
the largest |u|; the rest stays in the residual memory (default
``feedback=residual``; ``feedback=ewma`` gives technique 4 in docs/techniques.md).

Options:

* ``mode=exact`` (default): ``torch.topk``; ties at the threshold go to the
  lowest index, so the selection is deterministic. ``mode=sampled``: the
  threshold is estimated on a random sample of |u| (``sample``, default 1%)
  and applied in one pass, with one refinement when the count is far off
  (DGC, Lin et al. ICLR 2018); the count stays within [k/2, 1.3k]. On a GPU
  the threshold comes from a histogram of |u| on the device instead (about k).
* ``values=fp32|fp16``: value precision on the wire (fp16 saturates at +-65504;
  what is not sent exactly stays in the memory).
* ``scope=model`` (default): one top-k over all tensors of a bucket
  (k = ceil(ratio * bucket size)); with the default 25 MiB buckets a small
  model is one bucket. Needs the pipeline's ``prepare_bucket`` hook; costs one
  dense copy of the bucket's |u|. ``scope=layer``: k per tensor -- converges
  slower in an ordinary loop, because small layers get the same fraction as
  the large ones.

Payload: see :mod:`hvd_ext.compression._sparse` (i32 count, values, 16-bit
indices per 65536-chunk or int32). ``mode=exact,scope=layer`` has a fixed size,
``wire_bytes(n) = 4 + index bytes + k * value bytes``.
"""
from __future__ import annotations

import torch

from ..options import Option, fraction, non_negative
from ._sparse import SparseCompressor, abs_score, bucket_abs, count_for, payload_bytes
from .base import register

SELECTION_OPTIONS = {
    "ratio": Option(float, 0.01, "0 < ratio <= 1", fraction, help="fraction of coordinates sent"),
    "mode": Option(str, "exact", choices=("exact", "sampled"), help="exact top-k or sampled threshold"),
    "values": Option(str, "fp32", choices=("fp32", "fp16"), help="value precision on the wire"),
    "sample": Option(float, 0.01, "0 < sample <= 1", fraction, help="sampled mode: fraction of |u| sampled"),
    "seed": Option(int, 0, "integer >= 0", non_negative, help="sampled mode: seed of the sample"),
}


@register("topk")
class TopKCompressor(SparseCompressor):
    options = dict(SELECTION_OPTIONS, scope=Option(str, "model", choices=("layer", "model"),
                                                help="budget per tensor or over a whole bucket"))

    def __init__(self, **kw):
        super().__init__(**kw)
        # instance attribute: only exact per-layer top-k has a size fixed by n
        self.fixed_size = self.mode == "exact" and self.scope == "layer"

    def _selects_over_bucket(self):
        return self.scope == "model"  # one top-k over the bucket: the flat record needs no segments

    def selections(self, items, whole=None):
        if self.scope == "model":  # one top-k over the concatenated |u| of the bucket
            cat, sizes = bucket_abs(items)
            yield self._over(items, (cat, sizes), count_for(self.ratio, cat.numel()))
            return
        for u, info in items:
            flat = u.reshape(-1)
            yield self._one(abs_score(flat if flat.dtype == torch.float32 else flat.float()), info,
                            count_for(self.ratio, flat.numel()))

    def payload_size(self, info, recoded=False):
        """Exact top-k sends k entries: per tensor (scope=layer), or per flat bucket record."""
        if self.mode != "exact" or not (self.scope == "layer" or info.segments is not None):
            return None
        return payload_bytes(info.numel, count_for(self.ratio, info.numel), self.value_bytes)

    def wire_bytes(self, numel):
        if not self.fixed_size:
            return None
        return payload_bytes(numel, count_for(self.ratio, numel), self.value_bytes)
