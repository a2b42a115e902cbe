"""Significance-based gradient selection (technique 3 in docs/techniques.md; Taylor saliency after
Molchanov et al., ICLR 2017).

Each coordinate is scored by its first-order Taylor saliency
s_j = |u_j| * (|w_j| + eps)^alpha, u = grad + memory, w the parameter
(``info.param``; without one the score is |u|). A budget of
k = ceil(ratio * n_bucket) coordinates per bucket is split over the bucket's
tensors and each tensor sends its k_l highest-scored coordinates (exact top-k
with ties to the lowest index, or ``mode=sampled`` threshold as in ``topk``);
values sent are u, unsent mass stays in the feedback memory (default
``residual``; ``ewma`` works too). Under ``torch.optim.SGD`` with a plain momentum (one value
and one weight decay in every group, no Nesterov, no dampening) the residual feedback takes the
momentum and the decay over, with DGC's momentum correction and masking
(``hvd_ext.feedback.residual.correct_momentum``): the optimizer's momentum applied to the rare
bursts of a coordinate that waited for its turn overshoots at high sparsity.

``split`` chooses how the budget is divided (needs the pipeline's
``prepare_bucket`` hook; a lone ``compress`` call behaves as a one-tensor bucket):

* ``mass`` (default; technique 3's rule): k_l proportional to the layer's total saliency
  sum_j s_j (largest remainders, capped at the layer size, excess re-split);
* ``global``: one top-k of s over the whole bucket;
* ``layer``: k_l = ceil(ratio * n_l), like ``topk``.

With ``alpha=0`` the score is exactly |u|, so ``split=layer`` selects exactly
what ``topk`` selects, ``split=global`` exactly what ``topk:scope=model``
selects, and any split selects what ``topk`` would for a one-tensor bucket.
(With ``split=mass`` and several tensors, alpha=0 still moves budget between
layers by their |u| mass: that is the split, not the score.)
"""
from __future__ import annotations

import torch

from ..feedback.residual import correct_momentum
from ..ops.device import read
from ..options import Option, non_negative, positive
from ._sparse import SparseCompressor, abs_score, count_for, payload_bytes, split_budget
from .base import register
from .topk import SELECTION_OPTIONS


@register("sig")
class SignificanceCompressor(SparseCompressor):
    options = dict(
        SELECTION_OPTIONS,
        alpha=Option(float, 1.0, "alpha >= 0", non_negative, help="exponent of the parameter factor"),
        eps=Option(float, 1e-3, "eps > 0", positive, help="added to |w| before the power"),
        split=Option(str, "mass", choices=("mass", "global", "layer"), help="how the budget is split"),
    )

    def bind_optimizer(self, optimizer):
        correct_momentum(self, optimizer)  # before the feedback takes the momentum over
        super().bind_optimizer(optimizer)

    def score(self, flat: torch.Tensor, info, reuse: bool = False) -> torch.Tensor:
        """Saliency of every coordinate; ``reuse``: in the thread's reused score buffer (one tensor at a time)."""
        s = abs_score(flat) if reuse else flat.abs()
        w = info.param
        if self.alpha == 0 or w is None:
            return s
        w = w.detach().reshape(-1).to(device=s.device, dtype=torch.float32)
        if w.numel() != s.numel():
            raise ValueError(f"compressor 'sig': parameter of {info.name!r} has {w.numel()} elements, "
                             f"gradient {s.numel()}")
        return s.mul_(w.abs().add_(self.eps).pow_(self.alpha))

    per_segment = True  # a flat record's segments are scored and budgeted as separate tensors

    def _selects_over_bucket(self):
        return True

    @property
    def reads_device(self):
        # sampled counts; the mass of each layer (its budget); a bucket-wide selection split over
        # tensors sent one by one
        return self.mode == "sampled" or self.split == "mass" or (self.split == "global" and not self.bucket_flat)

    def payload_size(self, info, recoded=False):
        if self.mode != "exact":
            return None
        if info.segments is None:  # one tensor: split=layer gives it its own k
            return payload_bytes(info.numel, count_for(self.ratio, info.numel), self.value_bytes) \
                if self.split == "layer" else None
        k = (sum(count_for(self.ratio, n) for _, n, _ in info.segments) if self.split == "layer"
             else count_for(self.ratio, info.numel))
        return payload_bytes(info.numel, k, self.value_bytes)

    def selections(self, items, whole=None):
        if self.split == "layer" or len(items) == 1:  # a budget per tensor: scored one at a time
            for u, info in items:
                flat = u.reshape(-1).float()
                who = whole if whole is not None and len(items) == 1 else info
                yield self._one(self.score(flat, info, reuse=True), who, count_for(self.ratio, flat.numel()))
            return
        scores = [self.score(u.reshape(-1).float(), info) for u, info in items]
        sizes = [sc.numel() for sc in scores]
        total_k = count_for(self.ratio, sum(sizes))
        if self.split == "global":
            if whole is not None:  # the flat record's own indices: nothing to split back
                yield self._one(torch.cat(scores) if len(scores) > 1 else scores[0], whole, total_k)
            else:
                yield self._over(items, scores, total_k)
            return
        masses = read(torch.stack([sc.double().sum() if sc.numel() else torch.zeros((), dtype=torch.float64,
                                                                                      device=sc.device)
                                   for sc in scores]))
        for (u, info), sc, k in zip(items, scores, split_budget(total_k, masses, sizes)):
            yield self._one(sc, info, k)
