"""Deep Gradient Compression (Lin, Han, Mao, Wang, Dally, ICLR 2018; GRACE ``dgc``).

All four parts of the paper:

1. **Momentum correction** and 3. **momentum-factor masking** live in the
   feedback ``dgc_momentum`` (the default and only accepted feedback, see
   :mod:`hvd_ext.feedback.dgc_momentum`): the velocity u <- m*u + g is
   accumulated into v <- v + u, v is sparsified, and both u and v are zeroed
   on the sent coordinates. The momentum is applied here, before the
   exchange: DGC takes over a ``torch.optim.SGD`` optimizer's momentum (its
   value drives the correction, the optimizer's is set to 0, with a warning),
   switches the correction off for Adam-family optimizers, and refuses other
   optimizers with momentum (see ``bind_optimizer``).
2. **Local gradient clipping**: ``clip`` (feedback option) clips each
   tensor's local gradient norm to clip / sqrt(N) before it is accumulated
   (the paper clips the model's gradient; we clip per tensor).
4. **Warm-up of sparsity** (the sparsity ramp): the density (fraction sent) decays exponentially
   from ``start_ratio`` (0.25 = 75% sparsity) to ``ratio`` (0.001 = 99.9%)
   over the first ``ramp_steps`` exchanges, in ``ramp_stages`` constant
   stages (the paper: 4 epochs, 75%, 93.75%, 98.4375%, 99.6%, then 99.9%), or
   continuously with ``ramp_stages=0``. (Named ``ramp`` so it is not taken for
   the dense warm-up, ``warmup=``, that every codec has; the old keys
   ``warmup_steps`` / ``warmup_stages`` still spell it.) ``info.step`` (identical on every
   rank) drives it, so all ranks agree.

Selection: threshold estimated on a sample (``mode=sampled``, the paper's
choice; default) or exact top-k (``mode=exact``), as in ``topk``.
"""
from __future__ import annotations

import math

import torch

from ..options import Option, fraction, non_negative
from ._sparse import SparseCompressor, abs_score, bucket_abs, count_for, payload_bytes
from .base import register
from .topk import SELECTION_OPTIONS


@register("dgc")
class DGCCompressor(SparseCompressor):
    default_feedback = "dgc_momentum"
    accepted_feedback = ("dgc_momentum",)
    options = dict(
        SELECTION_OPTIONS,
        ratio=Option(float, 0.01, "0 < ratio <= 1", fraction, help="final density (1 - sparsity)"),
        mode=Option(str, "sampled", choices=("exact", "sampled"), help="sampled threshold or exact top-k"),
        start_ratio=Option(float, 0.25, "ratio <= start_ratio <= 1 (checked when ramp_steps > 0)", fraction,
                           help="density at step 0 of the ramp"),
        ramp_steps=Option(int, 0, "integer >= 0", non_negative,
                          help="exchanges over which the density decays to ratio (0 = no ramp)"),
        ramp_stages=Option(int, 4, "integer >= 0", non_negative,
                           help="constant stages of the ramp (0 = continuous)"),
        scope=Option(str, "model", choices=("layer", "model"),
                     help="density per tensor, or one selection over a whole bucket (as topk)"),
    )

    aliases = {"warmup_steps": "ramp_steps", "warmup_stages": "ramp_stages"}

    def validate(self):
        if self.ramp_steps > 0 and self.start_ratio < self.ratio:
            raise ValueError(f"compressor 'dgc': start_ratio={self.start_ratio} must be >= ratio={self.ratio} "
                             "(the ramp only increases sparsity)")

    def density(self, step: int) -> float:
        """Fraction of coordinates sent at exchange ``step``."""
        W = self.ramp_steps
        if W <= 0 or step >= W:
            return self.ratio
        frac = step / W
        if self.ramp_stages > 0:
            frac = math.floor(frac * self.ramp_stages) / self.ramp_stages
        return self.start_ratio * (self.ratio / self.start_ratio) ** frac

    def sparsity(self, step: int) -> float:
        return 1.0 - self.density(step)

    def selections(self, items, whole=None):
        """scope=model: one selection of density(step) over the concatenated |v| of the bucket (a fixed
        fraction per layer starves the small layers; see topk's ``scope``)."""
        density = self.density(items[0][1].step)
        if self.scope == "model":
            cat, sizes = bucket_abs(items)
            yield self._over(items, (cat, sizes), count_for(density, cat.numel()))
            return
        for u, info in items:
            flat = u.reshape(-1)
            yield self._one(abs_score(flat if flat.dtype == torch.float32 else flat.float()), info,
                            count_for(density, flat.numel()))

    @property
    def reads_device(self):
        # sampled counts, and the split of a bucket-wide selection over tensors sent one by one
        return self.mode == "sampled" or self.scope == "model"

    def payload_size(self, info, recoded=False):
        if self.mode != "exact" or self.scope != "layer":
            return None
        return payload_bytes(info.numel, count_for(self.density(info.step), info.numel), self.value_bytes)
