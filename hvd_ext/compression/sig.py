"""Significance-based gradient selection (thesis technique 3).

Each coordinate is scored by its first-order Taylor saliency
s_j = |u_j| * (|w_j| + eps)^alpha, u = grad + memory, w the parameter
(``info.param``; without one the score is |u|). A budget of
k = ceil(ratio * n_bucket) coordinates per bucket is split over the bucket's
tensors and each tensor sends its k_l highest-scored coordinates (exact top-k
with ties to the lowest index, or ``mode=sampled`` threshold as in ``topk``);
values sent are u, unsent mass stays in the feedback memory (default
``residual``; ``ewma`` works too).

``split`` chooses how the budget is divided (needs the pipeline's
``prepare_bucket`` hook; a lone ``compress`` call behaves as a one-tensor bucket):

* ``mass`` (default, DESIGN): k_l proportional to the layer's total saliency
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

from dataclasses import replace

import torch

from ..options import Option, non_negative, positive
from ._sparse import SparseCompressor, abs_score, count_for, split_budget, topk_indices
from .base import register
from .topk import COMMON_OPTIONS


@register("sig")
class SignificanceCompressor(SparseCompressor):
    options = dict(
        COMMON_OPTIONS,
        alpha=Option(float, 1.0, "alpha >= 0", non_negative, help="exponent of the parameter factor"),
        eps=Option(float, 1e-3, "eps > 0", positive, help="added to |w| before the power"),
        split=Option(str, "mass", choices=("mass", "global", "layer"), help="how the budget is split"),
    )

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

    def _select_k(self, score, k, info):
        if self.mode == "sampled":
            return self._sampled(score, k, info)
        return topk_indices(score, k)

    def select(self, flat, info):
        return self._select_k(self.score(flat, info, reuse=True), count_for(self.ratio, flat.numel()), info)

    def _selects_over_bucket(self):
        return True  # a flat record's segments are scored and budgeted as separate tensors (_plan_flat)

    def prepare_bucket(self, items):
        self._plan = {}
        if len(items) == 1 and items[0][1].segments:
            self._plan_flat(*items[0])
            return
        if self.split == "layer" or not items:
            return
        scores = [self.score(u.reshape(-1).float(), info) for u, info in items]
        sizes = [s.numel() for s in scores]
        total_k = count_for(self.ratio, sum(sizes))
        if self.split == "global":
            self._plan_global(items, scores, total_k, self.mode, self.sample)
            return
        masses = torch.stack([s.double().sum() if s.numel() else torch.zeros((), dtype=torch.float64,
                                                                             device=s.device)
                              for s in scores]).tolist()
        for (u, info), s, k in zip(items, scores, split_budget(total_k, masses, sizes)):
            self._plan[(info.name, info.step)] = self._select_k(s, k, info)

    def _plan_flat(self, u, info):
        """A flat bucket record: plan its tensors (``info.segments``) as a bucket of separate tensors,
        then join their selections into indices of the flat tensor."""
        flat = u.reshape(-1)
        subs, off = [], 0
        for name, n, param in info.segments:
            subs.append((flat[off:off + n], replace(info, name=name, shape=torch.Size([n]), param=param,
                                                   segments=None, base_name=None)))
            off += n
        if self.split != "layer":
            self.prepare_bucket(subs)
        parts, off = [], 0
        for su, si in subs:
            idx = self._plan.pop((si.name, si.step), None)
            if idx is None:
                idx = self.select(su, si)
            parts.append(idx + off)
            off += su.numel()
        self._plan = {(info.name, info.step): torch.cat(parts) if parts else torch.empty(0, dtype=torch.long)}
