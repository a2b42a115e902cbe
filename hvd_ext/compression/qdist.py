"""qdist: layer-wise quantization fitted to the gradient's distribution (thesis technique 5).

Related work: Lloyd 1982 / Max 1960 (optimal scalar quantizers), Faghri et al. 2020
("Adaptive Gradient Quantization for Data-Parallel SGD", ALQ/AMQ) and Ramezani-Kebrya
et al. 2021 ("NUQSGD") for unbiased non-uniform levels.

Two formats. ``bucket=B`` (default 256): the level placement is fitted per layer, the scale
per bucket of B consecutive elements (below). ``bucket=0``: one fitted location and scale per
layer, described first.

Per layer (one tensor x of n elements), ``bucket=0``:

1. Fit by moments: mean mu, std sigma, mean absolute deviation. ``dist=auto``
   picks the better-likelihood fit of Gaussian(mu, sigma) and Laplace(mu, MAD)
   (log-likelihoods ``-log(sigma sqrt(2 pi e))`` vs ``-log(2 e MAD)``);
   ``dist=gaussian|laplace`` forces one; ``dist=empirical`` uses quantiles.
2. Levels. Stochastic rounding is unbiased only if the outer levels cover the
   data, so the outer levels sit at +-T, ``T >= max|x - mu| / sigma`` (T rounded
   up on the grid ``2^(k/16)``, k sent in the header). The 2^b - 2 inner
   levels minimize the expected squared error of *stochastic* rounding
   ``sum_k int_{a_k}^{a_{k+1}} (x - a_k)(a_{k+1} - x) p(x) dx`` for the unit-variance
   shape p -- the Lloyd-Max conditions for unbiased rounding:
   ``int_{a_{k-1}}^{a_k} (x - a_{k-1}) p = int_{a_k}^{a_{k+1}} (a_{k+1} - x) p`` --
   solved once per (shape, b, k) from the compander start (density p^(1/3)) by
   red-black coordinate bisection, and cached. (Classic deterministic Lloyd-Max
   levels would have to clip the tails, which is biased.)
   ``dist=empirical``: the 2^b levels are the data's quantiles at ``i / (2^b - 1)``
   (outer ones = exact min and max), sent as float32.
3. Each value is rounded to one of its two neighbouring levels with the
   probabilities that make the expectation exact (unbiased); the level index is
   a b-bit code, packed densely (``bitpack``).
4. ``budget=B`` (average bits per element over a bucket, 1 <= B <= 8): bits per
   layer are allocated greedily (one bit at a time to the layer whose expected
   squared error, sigma^2 n J(b) with J from the level table, drops most per
   bit) under ``sum b_l n_l <= floor(B sum n_l)``, via the pipeline's
   ``prepare_bucket`` hook; each layer's b is in its header.

Per-bucket scales with per-layer fitted levels (``bucket=B > 0``). One scale per layer wastes
levels wherever the magnitude varies inside a layer (output channels, rows of a weight matrix):
QSGD's per-bucket max-norm scaling beats it on real gradients. So each bucket j of B elements gets
its own scale s_j >= max_j |x| and the layer's values are normalized to z = x / s_j in [-1, 1],
whose distribution *shape* (the same for the whole layer) the levels are fitted to:

a. Scales: M = max|x| of the layer (f32); bucket j sends one byte c_j with
   ``s_j = M 2^(-c_j/16)`` the smallest such value >= max_j |x| (c_j = 255: an all-zero bucket,
   s_j = 0). A byte per bucket instead of QSGD's f32 buys buckets 4x smaller at equal overhead;
   the rounding up costs about 2% of scale.
b. Levels: 2^b sorted levels on [-1, 1] with the ends at -1 and 1, so stochastic rounding is
   unbiased. They minimize the layer's expected error of stochastic rounding
   ``sum_i s_j(i)^2 (z_i - a_k)(a_{k+1} - z_i)`` (each element weighted by its bucket's scale^2,
   i.e. the error in x units; ALQ, Faghri et al. 2020, fits levels to this objective by gradient
   steps). ``dist=auto|empirical`` at b <= 4: the exact minimum over levels on a fixed grid of 129
   points ``sign(t) t^2`` (t uniform on [-1, 1], fine near 0) by dynamic programming over a
   128-bin weighted histogram of z (from at most 32768 evenly strided elements): the optimal
   partition of a line into K - 1 intervals of closed-form cost (prefix sums of w, wz, wz^2; Bruce
   1965, Wu 1991 for the Lloyd-Max analogue). Sent as K - 2 one-byte grid indices. ``dist=auto``
   skips the fit (and the bytes) for layers where they would exceed 1/8 of the codes
   (``n b < 64 (K - 2)``) and above 4 bits. Otherwise (and for ``dist=gaussian|laplace``): the
   Gaussian or Laplace table above on [-T, T], divided by T, with T fitted by moments
   (``T^2 = sum_j s_j^2 / sum x^2`` on the sample: the normalized body has unit variance);
   ``dist=auto`` keeps the shape with the smaller sampled error.
c. Stochastic rounding of z onto the levels as in 3., decoded value ``s_j a_code``.

Payload of one layer (allgather; header then codes):
  ``bucket=B``: ``u8 b | u8 16+form | u16 k | f32 M`` then ``K - 2`` u8 level indices (form 2,
      fitted levels; form 0/1: the Gaussian/Laplace table of grid index k), then ``ceil(n / B)``
      u8 scale codes, then the codes:
      wire bytes = ``8 + (K - 2 if fitted) + ceil(n / B) + ceil(n * b / 8)``
  ``bucket=0``, gaussian/laplace: ``u8 b | u8 dist | u16 k | f32 mu | f32 sigma`` then codes:
      wire bytes = ``12 + ceil(n * b / 8)``
  empirical: ``u8 b | u8 dist | u16 0 | 2^b x f32 levels`` then codes:
      wire bytes = ``4 + 4 * 2^b + ceil(n * b / 8)``
(n = 0: no bytes.)  Randomness: generator seeded by (seed, step, crc32(name), rank).

Kernels (``hvd_ext.kernels``): codes go through ``kernels.pack_bits`` /
``unpack_bits``. On CUDA (kernels not forced off) step 3 is one
``kernels.quantize_pack`` pass of z onto the same levels (round up with
probability (z - a)/(b - a), the same unbiased rule), its random numbers a
counter hash seeded by ``derive_seed(seed, name, rank)`` and the step; the CPU
path draws the dither from the same counter hash (``_fast.uniform``), in one fused
pass for up to 16 levels (selects over the level table; more levels: a search).
(NaN inputs give arbitrary codes; such steps are skipped anyway.) The bucket format uses the
same ``kernels.quantize_pack`` on CUDA, with z = x / s_j computed by torch first (levels on
[-1, 1], scale 1), and decodes with ``kernels.unpack_bits`` and a torch gather; on CPU one fused
pass (up to 16 levels) rounds the flat padded buckets with the per-bucket reciprocal scales
expanded inside the kernel, and one fused pass decodes and sums all ranks. A non-finite layer
sends M = NaN/Inf, so every rank decodes non-finite values and skips the step.
"""
from __future__ import annotations

import heapq
import math
from functools import lru_cache
from typing import Dict, Tuple

import torch

from .. import kernels as _K
from ..options import Option, non_negative
from . import _fast, _quant
from .base import Compressor, as_bytes, from_bytes, register
from .bitpack import packed_bytes

DISTS = ("gaussian", "laplace", "empirical")
_GRID = 16  # T = 2 ** (k / _GRID)
_SQRT2 = math.sqrt(2.0)


# ---- level tables ---------------------------------------------------------------------------

def _moments(dist: str, x: torch.Tensor):
    """Partial moments F0, F1, F2 (int_{-inf}^x t^j p(t) dt) of the unit-variance shape, and p."""
    if dist == "gaussian":
        phi = torch.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)
        F0 = torch.special.ndtr(x)
        return F0, -phi, F0 - x * phi, phi
    beta = 1.0 / _SQRT2  # Laplace with variance 2 beta^2 = 1
    a = -x.abs()
    e = 0.5 * torch.exp(a / beta)
    f0 = e
    f1 = e * (a - beta)
    f2 = e * (a * a - 2 * beta * a + 2 * beta * beta)
    pos = x > 0
    F0 = torch.where(pos, 1 - f0, f0)
    F1 = f1  # symmetric: int_{-inf}^{x} t p = int_{-inf}^{-|x|} t p
    F2 = torch.where(pos, 2 * beta * beta - f2, f2)
    return F0, F1, F2, e / beta


def _interval_error(dist, lo, hi):
    F0a, F1a, F2a, _ = _moments(dist, lo)
    F0b, F1b, F2b, _ = _moments(dist, hi)
    return -(F2b - F2a) + (lo + hi) * (F1b - F1a) - lo * hi * (F0b - F0a)


def _grad(dist, prev, cur, nxt):
    """dJ/da_k: int_{prev}^{cur}(x - prev)p - int_{cur}^{nxt}(nxt - x)p (increasing in cur)."""
    F0p, F1p, _, _ = _moments(dist, prev)
    F0c, F1c, _, _ = _moments(dist, cur)
    F0n, F1n, _, _ = _moments(dist, nxt)
    left = (F1c - F1p) - prev * (F0c - F0p)
    right = nxt * (F0n - F0c) - (F1n - F1c)
    return left - right


def _total_error(dist, a):
    return float(_interval_error(dist, a[:-1], a[1:]).sum())


def _newton(dist, a, iters: int = 100):
    """Minimize J over the inner levels: Newton steps with the tridiagonal Hessian and a
    backtracking line search that keeps the levels ordered and J decreasing."""
    K = a.numel()
    J = _total_error(dist, a)
    for _ in range(iters):
        prev, cur, nxt = a[:-2], a[1:-1], a[2:]
        g = _grad(dist, prev, cur, nxt)
        F0 = _moments(dist, a)[0]
        p = _moments(dist, cur)[3]
        H = torch.diag((nxt - prev) * p)
        off = -(F0[2:-1] - F0[1:-2])  # -int_{a_k}^{a_{k+1}} p for inner neighbours
        if K > 3:
            H = H + torch.diag(off, 1) + torch.diag(off, -1)
        try:
            step = torch.linalg.solve(H, g)
            if not bool(torch.isfinite(step).all()) or float((step * g).sum()) <= 0:
                raise RuntimeError
        except RuntimeError:
            step = g / ((nxt - prev) * p).clamp(min=1e-12)  # diagonal (coordinate Newton) step
        lam, improved = 1.0, False
        for _ls in range(40):
            b = a.clone()
            b[1:-1] = cur - lam * step
            if bool((b[1:] > b[:-1]).all()):
                Jb = _total_error(dist, b)
                if Jb <= J:
                    improved = True
                    break
            lam *= 0.5
        if not improved:
            break
        b = 0.5 * (b - b.flip(0))  # the shapes are symmetric
        done = float((b - a).abs().max()) < 1e-11
        a, J = b, _total_error(dist, b)
        if done:
            break
    return a


@lru_cache(maxsize=4096)
def level_table(dist: str, bits: int, k: int) -> Tuple[torch.Tensor, float]:
    """(2^bits sorted float32 levels on [-T, T], T = 2^(k/16); expected error J per sigma^2).

    J is the stochastic-rounding error of a unit-variance ``dist`` sample within +-T."""
    if dist not in ("gaussian", "laplace"):
        raise ValueError(f"no level table for dist={dist!r}")
    T = 2.0 ** (k / _GRID)
    K = 2 ** bits
    dt = torch.float64
    if K == 2:
        a = torch.tensor([-T, T], dtype=dt)
    else:
        # compander start: levels at equal steps of int p^(1/3) over [-T, T]
        xs = torch.linspace(-T, T, 20001, dtype=dt)
        dens = _moments(dist, xs)[3] ** (1.0 / 3.0)
        cdf = torch.cumsum(dens, 0)
        cdf = (cdf - cdf[0]) / (cdf[-1] - cdf[0])
        targets = torch.linspace(0, 1, K, dtype=dt)
        idx = torch.searchsorted(cdf, targets).clamp(0, xs.numel() - 1)
        a = xs[idx].clone()
        a[0], a[-1] = -T, T
        a = _newton(dist, a)
    J = float(_interval_error(dist, a[:-1], a[1:]).sum())
    return a.to(torch.float32), J


def grid_index(t: float) -> int:
    """Smallest k >= 0 with 2^(k/16) >= t."""
    if t <= 1.0:
        return 0
    k = math.ceil(_GRID * math.log2(t) - 1e-12)
    while 2.0 ** (k / _GRID) < t:
        k += 1
    return k


# ---- per-bucket scales and fitted levels (bucket > 0) ----------------------------------------

_SCALE_STEPS = 16                 # s_j = M * 2^(-c_j / 16)
_ZERO_BUCKET = 255                # c_j of an all-zero bucket (s_j = 0)
_SCALE_POW = torch.tensor([2.0 ** (-c / _SCALE_STEPS) for c in range(255)] + [0.0], dtype=torch.float32)
_FIT_BINS = 128                   # level grid: 129 points sign(t) t^2, t = -1 + 2 i / 128
_FIT_SAMPLE = 32768               # elements the fit looks at (evenly strided)
_FIT_MAX_BITS = 4                 # fitted levels up to 16 of them
_FIT_EDGES64 = None
_FIT_PAIRS = None


def fit_edges() -> torch.Tensor:
    """The 129 float64 candidate level positions on [-1, 1] (index 64 is 0)."""
    global _FIT_EDGES64, _FIT_PAIRS
    if _FIT_EDGES64 is None:
        t = torch.linspace(-1.0, 1.0, _FIT_BINS + 1, dtype=torch.float64)
        e = t.sign() * t * t
        e[0], e[_FIT_BINS // 2], e[-1] = -1.0, 0.0, 1.0
        lo, hi = e.view(-1, 1), e.view(1, -1)
        _FIT_PAIRS = (lo + hi, lo * hi, hi > lo)
        _FIT_EDGES64 = e
    return _FIT_EDGES64


_FIT_EDGES32 = fit_edges().to(torch.float32)


def bucket_scale_codes(amax: torch.Tensor, M: float) -> torch.Tensor:
    """uint8 codes c_j with ``M 2^(-c_j/16) >= amax_j`` (smallest such), 255 for amax_j = 0."""
    if not M > 0 or not math.isfinite(M):
        return torch.zeros(amax.shape, dtype=torch.uint8, device=amax.device)
    r = (amax.to(torch.float32) / M).clamp(min=2.0 ** -40)
    # a margin of 1e-3 steps (4e-5 relative) keeps the float32 scale above amax despite rounding
    c = torch.floor(-_SCALE_STEPS * torch.log2(r) - 1e-3).clamp_(0, _ZERO_BUCKET - 1)
    c = torch.where(amax > 0, c, torch.full_like(c, _ZERO_BUCKET))
    return c.to(torch.uint8)


def bucket_scales(codes: torch.Tensor, M) -> torch.Tensor:
    """float32 scales ``M 2^(-c/16)`` (0 for code 255) of the uint8 scale codes."""
    return _SCALE_POW.to(codes.device)[codes.long()] * M


def dp_levels(z: torch.Tensor, w: torch.Tensor, K: int) -> torch.Tensor:
    """Indices (int64, K of them, 0 and 128 included) into :func:`fit_edges` of the K levels that
    minimize ``sum_i w_i (z_i - a_k)(a_{k+1} - z_i)`` (stochastic-rounding error) over levels on
    the grid, exactly: dynamic programming over the weighted histogram (prefix sums make every
    interval's cost closed-form, and exact since the levels sit on bin edges)."""
    e = fit_edges()
    E = _FIT_BINS
    z = z.to(torch.float64)
    w = w.to(torch.float64)
    t = z.sign() * z.abs().sqrt()
    b = ((t + 1.0) * (E / 2)).floor().clamp_(0, E - 1).long()
    C = torch.zeros(E + 1, dtype=torch.float64)
    S, Q = C.clone(), C.clone()
    C[1:] = torch.bincount(b, w, minlength=E)
    wz = w * z
    S[1:] = torch.bincount(b, wz, minlength=E)
    Q[1:] = torch.bincount(b, wz * z, minlength=E)
    C, S, Q = C.cumsum(0), S.cumsum(0), Q.cumsum(0)
    total = float(C[-1])
    if not total > 0 or not math.isfinite(total):
        return torch.linspace(0, E, K).round().long()
    C, S, Q = C / total, S / total, Q / total
    plus, prod, valid = _FIT_PAIRS
    # Candidates: a level inside a stretch of empty bins changes the error linearly, so an optimum
    # has its levels on edges of occupied bins (or +-1); the others are left out (exact, and cheap
    # for small layers). Too few of them: any other edges complete the K (they cost nothing).
    occupied = (C[1:] > C[:-1]).nonzero().squeeze(1)
    keep = torch.zeros(E + 1, dtype=torch.bool)
    keep[0] = keep[E] = True
    keep[occupied] = True
    keep[occupied + 1] = True
    if int(keep.sum()) < K:
        keep[torch.linspace(0, E, K).round().long()] = True  # K distinct edges: enough with the rest
    cand = keep.nonzero().squeeze(1)
    m = cand.numel()
    if m < E + 1:
        C, S, Q = C[cand], S[cand], Q[cand]
        plus, prod, valid = plus[cand][:, cand], prod[cand][:, cand], valid[cand][:, cand]
    # cost[i, j] = sum over bins between candidate edges i < j of w (z - e_i)(e_j - z)
    cost = (S.view(1, -1) - S.view(-1, 1)).mul_(plus)
    cost.sub_(Q.view(1, -1) - Q.view(-1, 1)).sub_((C.view(1, -1) - C.view(-1, 1)).mul_(prod))
    cost.clamp_(min=0.0).masked_fill_(~valid, float("inf"))
    D = cost[0]
    back = []
    for _ in range(K - 2):  # D[j]: least error of [-1, e_j] cut into (step + 2) intervals
        D, arg = (D.view(-1, 1) + cost).min(0)
        back.append(arg)
    idx = [m - 1]
    if back:
        back = torch.stack(back).tolist()
        for row in reversed(back):
            idx.append(row[idx[-1]])
    idx.append(0)
    return cand[torch.tensor(idx[::-1], dtype=torch.long)]


def sampled_error(z: torch.Tensor, w: torch.Tensor, levels: torch.Tensor) -> float:
    """``sum w (z - a)(c - z)`` of stochastic rounding onto ``levels`` (a <= z <= c neighbours)."""
    lv = levels.to(torch.float64)
    z = z.to(torch.float64).clamp(-1.0, 1.0)
    i = (torch.searchsorted(lv, z, right=True) - 1).clamp_(0, lv.numel() - 2)
    return float((w.to(torch.float64) * (z - lv[i]) * (lv[i + 1] - z)).sum())


def table_levels(dist: str, bits: int, k: int) -> torch.Tensor:
    """The ``dist`` table of grid index k scaled from [-T, T] to [-1, 1] (ends exactly +-1), float32."""
    return _table_levels(dist, bits, k)


@lru_cache(maxsize=4096)
def _table_levels(dist, bits, k):
    lv = level_table(dist, bits, k)[0].to(torch.float64) / 2.0 ** (k / _GRID)
    lv[0], lv[-1] = -1.0, 1.0
    return lv.to(torch.float32)


def _bucket_amax(v):
    """max |x| of each bucket (row) of v (k, c)."""
    return v.to(torch.float32).abs().amax(1)


def _round_buckets(x, inv, levels, key, codes_out, *, K: int):
    """Stochastic rounding of z = x * inv (x: k*c padded buckets, flat; inv: (k, 1) reciprocal
    scales, 0 for an all-zero bucket) onto the K sorted levels on [-1, 1]; one-byte codes of all
    k*c elements to ``codes_out``. (Flat, with the scales expanded inside: a (k, c) grid compiles
    to a loop several times slower.)"""
    z = (x.to(torch.float32) * inv.expand(-1, x.numel() // inv.shape[0]).reshape(-1)).clamp(-1.0, 1.0)
    codes_out.copy_(_stochastic_codes(z, levels, key, K).to(torch.uint8))


def _level_of(codes, levels, K: int):
    """levels[code] for one-byte codes: a chain of selects over the small level table (no gather).
    Shared by both payload formats' decoders (inlined when compiled)."""
    c = codes.to(torch.float32)
    v = levels[0]
    for j in range(1, K):
        v = torch.where(c > j - 0.5, levels[j], v)
    return v


def _decode_buckets(out, codes_list, levels_list, scales_list, *, K: int):
    """out (k*c) = sum over ranks of s_j * levels[code] (codes: k*c one-byte codes, scales (k, 1))."""
    acc = None
    for codes, levels, s in zip(codes_list, levels_list, scales_list):
        v = _level_of(codes, levels, K)
        x = v * s.expand(-1, codes.numel() // s.shape[0]).reshape(-1)
        acc = x if acc is None else acc + x
    out.copy_(acc)


# ---- fused CPU kernels (see ``_fast``) -------------------------------------------------------

def _stats(x):
    """(mean, std, mean |x - mean|, max |x - mean|) as 0-d float32 tensors, fused."""
    x = x.to(torch.float32)
    mu = x.mean()
    d = x - mu
    return mu, d.pow(2).mean().sqrt(), d.abs().mean(), d.abs().amax()


def _select(z, levels, lo: int, hi: int):
    """levels[j] for the largest j in lo..hi with levels[j] <= z (levels[lo] if none): a chain of
    selects over a small level table, exact and vectorisable (no gather, no search)."""
    out = levels[lo]
    for j in range(lo + 1, hi + 1):
        out = torch.where(z >= levels[j], levels[j], out)
    return out


def _stochastic_codes(z, levels, key, K: int):
    """Codes (float) of the unbiased stochastic rounding of z onto the K sorted levels: up from
    a = levels[idx] to b = levels[idx + 1] with probability (z - a) / (b - a); outside the end
    levels, the end level. Shared by both payload formats' encoders (inlined when compiled)."""
    idx = torch.zeros_like(z)
    for j in range(1, K - 1):
        idx = idx + torch.where(z >= levels[j], 1.0, 0.0)
    a = _select(z, levels, 0, K - 2)      # levels[idx]
    c = levels[1]                          # levels[idx + 1]
    for j in range(1, K - 1):
        c = torch.where(z >= levels[j], levels[j + 1], c)
    width = c - a
    p = torch.where(width > 0, (z - a) / torch.where(width > 0, width, torch.ones_like(width)),
                    torch.zeros_like(z)).clamp(0, 1)
    return idx + torch.where(_fast.uniform(z.numel(), key, z.device) < p, 1.0, 0.0)


def _round(x, musig, levels, key, codes_out, *, K: int, zero: bool):
    """Stochastic rounding of z = (x - mu) / sigma onto the K sorted levels (up with probability
    (z - a) / (b - a), a <= z < b neighbouring levels; outside: the end levels), one-byte codes to
    ``codes_out``. ``zero``: a degenerate fit, every z is 0."""
    x = x.to(torch.float32)
    z = torch.zeros_like(x) if zero else (x - musig[0]) / musig[1]
    codes_out.copy_(_stochastic_codes(z, levels, key, K).to(torch.uint8))


def _decode(out, codes_list, levels_list, musig_list, *, K: int):
    """out = sum over ranks of mu + sigma * levels[code] (selects over the small level table)."""
    acc = None
    for codes, levels, musig in zip(codes_list, levels_list, musig_list):
        v = _level_of(codes, levels, K)
        x = musig[0] + musig[1] * v
        acc = x if acc is None else acc + x
    out.copy_(acc)


_STATS = _fast.Kernel(_stats, "qdist fit")
_ROUND = _fast.Kernel(_round, "qdist encode")
_DECODE = _fast.Kernel(_decode, "qdist decode")
_AMAX_B = _fast.Kernel(_bucket_amax, "qdist bucket max")
_ROUND_B = _fast.Kernel(_round_buckets, "qdist bucket encode")
_DECODE_B = _fast.Kernel(_decode_buckets, "qdist bucket decode")


# ---- the compressor -------------------------------------------------------------------------

@register("qdist")
class QDistCompressor(Compressor):
    exchange = "allgather"
    options = {
        "bits": Option(int, 3, "1 <= bits <= 8", lambda v: 1 <= v <= 8),
        "dist": Option(str, "auto", choices=("auto",) + DISTS),
        "budget": Option(float, 0.0, "0 (off) or 1 <= budget <= 8 (average bits per element)",
                         lambda v: v == 0 or 1 <= v <= 8),
        "bucket": Option(int, 256, "integer >= 0 (0 = one location and scale per layer)", non_negative,
                         help="elements per bucket scale (levels are fitted per layer)"),
        "seed": Option(int, 0, "integer >= 0", non_negative),
    }

    def __init__(self, **kw):
        if "bits" in kw and "budget" in kw:
            raise ValueError("compressor 'qdist': give either bits= (fixed) or budget= (allocated per layer), "
                             "not both")
        super().__init__(**kw)
        self._alloc: Dict[str, Tuple[int, int]] = {}  # name -> (step, bits)
        if self.budget:
            self.fixed_size = False

    # ---- fitting ----------------------------------------------------------------------------
    def fit(self, flat: torch.Tensor):
        """(dist, mu, sigma, t) of a flat float tensor; t = max|x - mu| / sigma."""
        mu, sigma, mad, dmax = _STATS(flat.numel(), flat.device, flat)
        dist = self.dist
        if dist == "auto":
            # Gaussian LL: -log(sigma) - 0.5 log(2 pi e); Laplace LL: -log(2 MAD) - 1
            gauss = -torch.log(sigma) - 0.5 * math.log(2 * math.pi * math.e)
            lap = -torch.log(2 * mad) - 1.0
            dist = "laplace" if bool(lap > gauss) else "gaussian"
        t = dmax / sigma if float(sigma) > 0 else torch.zeros(())
        return dist, float(mu), float(sigma), float(t)

    def bits_for(self, info) -> int:
        got = self._alloc.get(getattr(info, "base_name", None) or info.name)
        if got is not None and got[0] == info.step:
            return got[1]
        if self.budget:
            return max(1, min(8, int(self.budget)))
        return self.bits

    def prepare_bucket(self, items):
        """Allocate bits per layer under the budget (items: [(u, info)] of one bucket)."""
        if not self.budget:
            return
        layers = []
        for u, info in items:
            flat = u.reshape(-1).float()
            n = flat.numel()
            if n == 0:
                continue
            dist, mu, sigma, t = self.fit(flat)
            if not (math.isfinite(sigma) and math.isfinite(t)):
                sigma, t = 0.0, 1.0
            shape = dist if dist != "empirical" else "gaussian"
            layers.append((info, n, sigma * sigma, shape, grid_index(t)))
        if not layers:
            return
        total = math.floor(self.budget * sum(n for _, n, _, _, _ in layers) + 1e-9)
        bits = [1] * len(layers)
        used = sum(n for _, n, _, _, _ in layers)

        def gain(i):
            _, n, var, shape, k = layers[i]
            b = bits[i]
            return var * (level_table(shape, b, k)[1] - level_table(shape, b + 1, k)[1])

        heap = [(-gain(i), i) for i in range(len(layers))]
        heapq.heapify(heap)
        while heap:
            g, i = heapq.heappop(heap)
            n = layers[i][1]
            if used + n > total:
                continue  # this layer no longer fits; smaller ones may
            bits[i] += 1
            used += n
            if bits[i] < 8:
                heapq.heappush(heap, (-gain(i), i))
        for (info, *_), b in zip(layers, bits):
            self._alloc[info.name] = (info.step, b)

    # ---- codec -----------------------------------------------------------------------------
    def fitted(self, numel: int, bits: int) -> bool:
        """Whether a layer of ``numel`` elements at ``bits`` sends fitted grid levels (bucket format)."""
        K = 2 ** bits
        if K <= 2 or bits > _FIT_MAX_BITS or self.dist in ("gaussian", "laplace"):
            return False
        return self.dist == "empirical" or numel * bits >= 64 * (K - 2)

    def compress(self, tensor, info):
        flat = tensor.reshape(-1).float()
        n = flat.numel()
        dev = flat.device
        if n == 0:
            return torch.empty(0, dtype=torch.uint8, device=dev), None
        b = self.bits_for(info)
        if self.bucket:
            return self._compress_buckets(flat, b, info), None
        K = 2 ** b
        dist, mu, sigma, t = self.fit(flat) if self.dist != "empirical" else ("empirical", 0.0, 0.0, 0.0)
        if dist == "empirical":
            levels = self._empirical_levels(flat, K)
            z = flat
            head = as_bytes(torch.tensor([b, DISTS.index(dist), 0, 0], dtype=torch.uint8, device=dev), levels)
        else:
            finite = math.isfinite(mu) and math.isfinite(sigma) and math.isfinite(t)
            if not finite or sigma == 0:
                k = 0
                sig_out = sigma if finite else float("nan")
                levels = torch.zeros(K, device=dev)
                z = torch.zeros_like(flat)
            else:
                k = grid_index(t)
                sig_out = sigma
                levels = level_table(dist, b, k)[0].to(dev)
                z = None  # (flat - mu) / sigma, computed where it is used
            head = as_bytes(torch.tensor([b, DISTS.index(dist)], dtype=torch.uint8, device=dev),
                            torch.tensor([k], dtype=torch.int16, device=dev),
                            torch.tensor([mu, sig_out], dtype=torch.float32, device=dev))
        if z is None and (_K.backend(flat) == "cuda" or K > 16):
            z = (flat - mu) / sigma
        if _K.backend(flat) == "cuda":
            packed = _K.quantize_pack(z, levels, 1.0, b,
                                      seed=_K.derive_seed(self.seed, info.name, info.rank), step=info.step)
        elif K <= 16:
            n = flat.numel()
            key = _fast.stream_key_tensor(self.seed, info.name, info.rank, info.step, dev)
            musig = torch.tensor([mu, sigma if sigma > 0 else 1.0], dtype=torch.float32) if dist != "empirical" \
                else torch.tensor([0.0, 1.0])
            zero = dist != "empirical" and (sigma == 0 or not math.isfinite(sigma) or not math.isfinite(mu)
                                            or not math.isfinite(t))
            buf = _fast.codes_buffer("qdist", n, dev)
            _ROUND(n, dev, flat, musig.to(dev), levels.to(torch.float32), key, buf[:n], K=K, zero=zero)
            packed = _fast.pack_buffer(buf, n, b)
        else:
            packed = _K.pack_bits(self._round(z, levels, info), b)
        return torch.cat([head, packed]), None

    # ---- bucket format ----------------------------------------------------------------------
    def _fit_bucket_levels(self, flat, scales, M, b):
        """(form, k, level indices or None, float32 levels on [-1, 1]) for the bucket format."""
        K = 2 ** b
        n = flat.numel()
        B = self.bucket
        st = max(1, -(-n // _FIT_SAMPLE))
        pos = torch.arange(0, n, st, device=flat.device)
        s = scales[pos // B].to(torch.float64)
        z = torch.where(s > 0, flat[pos].to(torch.float64) / torch.where(s > 0, s, torch.ones_like(s)),
                        torch.zeros_like(s)).clamp_(-1.0, 1.0).cpu()
        w = (s / M).pow(2).cpu()
        if self.fitted(n, b):
            idx = dp_levels(z, w, K)
            return 2, 0, idx, _FIT_EDGES32[idx].to(flat.device)
        # moments: the body of z * T has unit variance (weighted like the error)
        ez2 = float((w * z * z).sum())
        T = math.sqrt(float(w.sum()) / ez2) if ez2 > 0 else 1.0
        k = grid_index(T) if math.isfinite(T) else 0
        shapes = (self.dist,) if self.dist in ("gaussian", "laplace") else ("gaussian", "laplace")
        best = None
        for shape in shapes:
            lv = table_levels(shape, b, k)
            err = sampled_error(z, w, lv) if len(shapes) > 1 else 0.0
            if best is None or err < best[0]:
                best = (err, DISTS.index(shape), lv)
        return best[1], k, None, best[2].to(flat.device)

    def _compress_buckets(self, flat, b, info):
        n = flat.numel()
        dev = flat.device
        K = 2 ** b
        B = self.bucket
        v = _quant.padded_view(flat, B)
        amax = _AMAX_B(v.numel(), dev, v)
        M = float(amax.max())
        finite = math.isfinite(M)
        codes_s = bucket_scale_codes(amax, M)
        scales = bucket_scales(codes_s, M if finite else 0.0)
        if finite and M > 0:
            form, k, idx, levels = self._fit_bucket_levels(flat, scales, M, b)
        else:  # all zero, or non-finite (the step is skipped): every value decodes to M * 0 or NaN
            form, k, idx, levels = DISTS.index("gaussian"), 0, None, table_levels("gaussian", b, 0).to(dev)
        if self.fitted(n, b) and idx is None:
            idx = torch.linspace(0, _FIT_BINS, K).round().long()
            form = 2
            levels = _FIT_EDGES32[idx].to(dev)
        head = [torch.tensor([b, 16 + form], dtype=torch.uint8, device=dev),
                torch.tensor([k], dtype=torch.int16, device=dev),
                torch.tensor([M], dtype=torch.float32, device=dev)]
        if idx is not None:
            head.append(idx[1:-1].to(torch.uint8).to(dev))
        head.append(codes_s)
        head = as_bytes(*head)
        s2 = scales.view(-1, 1)
        inv = torch.where(s2 > 0, 1.0 / torch.where(s2 > 0, s2, torch.ones_like(s2)), torch.zeros_like(s2))
        if _K.backend(flat) == "cuda":
            z = v * inv
            packed = _K.quantize_pack(z.reshape(-1)[:n].clamp(-1.0, 1.0), levels, 1.0, b,
                                      seed=_K.derive_seed(self.seed, info.name, info.rank), step=info.step)
        elif K <= 16:
            key = _fast.stream_key_tensor(self.seed, info.name, info.rank, info.step, dev)
            total = v.numel()
            buf = _fast.scratch("qdist/b", max(total, 8 * ((n + 7) // 8)), torch.uint8, dev)
            _ROUND_B(total, dev, v.reshape(-1), inv, levels.to(torch.float32).contiguous(), key, buf[:total], K=K)
            buf[n:].zero_()
            packed = _fast.pack_buffer(buf[:8 * ((n + 7) // 8)], n, b)
        else:
            z = v * inv
            packed = _K.pack_bits(self._round(z.reshape(-1)[:n].clamp(-1.0, 1.0), levels, info), b)
        return torch.cat([head, packed])

    def _bucket_parts(self, data, n):
        """(bits, float32 levels, (k, 1) float32 scales, packed codes) of one bucket-format payload."""
        b, form = int(data[0]), int(data[1]) - 16
        if not 1 <= b <= 8 or not 0 <= form < len(DISTS):
            raise ValueError(f"qdist: corrupt header (bits={b}, form={form + 16}; bucket={self.bucket})")
        K = 2 ** b
        k = int(from_bytes(data, 2, torch.int16, 1)[0][0]) & 0xFFFF
        Mt, off = from_bytes(data, 4, torch.float32, 1)
        if form == 2:
            idx = data[off:off + K - 2].long()
            off += K - 2
            grid = _FIT_EDGES32.to(data.device)
            levels = torch.cat([grid[:1], grid[idx], grid[-1:]])
        else:
            levels = table_levels(DISTS[form], b, k).to(data.device)
        nb = _quant.chunks(n, self.bucket)
        scales = bucket_scales(data[off:off + nb], Mt[0]).view(-1, 1)
        return b, levels, scales, data[off + nb:]

    def _sum_buckets(self, datas, n):
        parts = [self._bucket_parts(d, n) for d in datas]
        dev = datas[0].device
        B = self.bucket
        total = _quant.chunks(n, B) * B
        K = 2 ** parts[0][0]
        if _K.backend(*datas) != "cuda" and K <= 16 and all(p[0] == parts[0][0] for p in parts):
            codes = [_fast.padded(_fast.unpack_to_buffer(p[3], p[0], n, f"qdist/b{r}"), total, f"qdist/bpad{r}")
                     for r, p in enumerate(parts)]
            out = _fast.empty(total, device=dev)
            _DECODE_B(total, dev, out, codes, [p[1].contiguous() for p in parts], [p[2] for p in parts], K=K)
            return out[:n]
        out = None
        for b, levels, scales, packed in parts:
            codes = _K.unpack_bits(packed, b, n).long()
            x = levels[codes] * scales.expand(-1, B).reshape(-1)[:n]
            out = x if out is None else out.add_(x)
        return out

    def _empirical_levels(self, flat, K):
        n = flat.numel()
        lo, hi = flat.min(), flat.max()
        sample = flat if n <= 65536 else flat[:: math.ceil(n / 65536)]
        s = sample.sort().values
        pos = torch.linspace(0, s.numel() - 1, K, device=flat.device).round().long()
        levels = s[pos].clone()
        levels[0], levels[-1] = lo, hi
        return levels.contiguous()

    def _round(self, z, levels, info):
        K = levels.numel()
        idx = (torch.searchsorted(levels, z.contiguous(), right=True) - 1).clamp_(0, K - 2)
        a, c = levels[idx], levels[idx + 1]
        width = c - a
        p = torch.where(width > 0, (z - a) / torch.where(width > 0, width, torch.ones_like(width)),
                        torch.zeros_like(z)).clamp_(0, 1)
        key = _fast.stream_key_tensor(self.seed, info.name, info.rank, info.step, z.device)
        up = _fast.uniform(z.numel(), key, z.device) < p
        return (idx + up.long()).to(torch.uint8)

    def decode(self, data, ctx, info):
        n = info.numel
        if n == 0:
            return torch.zeros(0, device=data.device)
        if self.bucket:
            return self._sum_buckets([data], n)
        b, dcode = int(data[0]), int(data[1])
        if not 1 <= b <= 8 or dcode >= len(DISTS):
            raise ValueError(f"qdist: corrupt header (bits={b}, dist={dcode})")
        K = 2 ** b
        dist = DISTS[dcode]
        if dist == "empirical":
            levels, off = from_bytes(data, 4, torch.float32, K)
            return levels[_K.unpack_bits(data[off:], b, n).long()]
        k = int(from_bytes(data, 2, torch.int16, 1)[0][0]) & 0xFFFF
        musig, off = from_bytes(data, 4, torch.float32, 2)
        mu, sigma = musig[0], musig[1]
        if float(sigma) == 0 or not math.isfinite(float(sigma)):
            return (mu + sigma * torch.zeros(n, device=data.device)).expand(n).clone()
        levels = level_table(dist, b, k)[0].to(data.device)
        if _K.backend(data) != "cuda" and K <= 16:
            return self.aggregate([data], ctx, info)
        codes = _K.unpack_bits(data[off:], b, n).long()
        return mu + sigma * levels[codes]

    def _fused_parts(self, datas, n):
        """[(codes, levels, (mu, sigma))] of every rank for the fused CPU sum, or None when a payload
        needs the general path (CUDA, more than 16 levels, ranks with different bits, a degenerate fit)."""
        if not datas or _K.backend(*datas) == "cuda":
            return None
        parts = []
        for r, data in enumerate(datas):
            b, dcode = int(data[0]), int(data[1])
            if not 1 <= b <= 4 or dcode >= len(DISTS) or (parts and b != parts[0][3]):
                return None
            K = 2 ** b
            if DISTS[dcode] == "empirical":
                levels, off = from_bytes(data, 4, torch.float32, K)
                musig = torch.tensor([0.0, 1.0], device=data.device)
            else:
                k = int(from_bytes(data, 2, torch.int16, 1)[0][0]) & 0xFFFF
                musig, off = from_bytes(data, 4, torch.float32, 2)
                sigma = float(musig[1])
                if sigma == 0 or not math.isfinite(sigma):
                    return None
                levels = level_table(DISTS[dcode], b, k)[0].to(data.device)
            parts.append((_fast.unpack_to_buffer(data[off:], b, n, f"qdist/{r}"), levels.contiguous(),
                          musig.contiguous(), b))
        return parts

    def aggregate(self, datas, ctx, info):
        """Sum of the ranks' decoded payloads; on CPU one fused pass over all ranks."""
        n = info.numel
        if n and self.bucket and datas:
            return self._sum_buckets(datas, n)
        parts = self._fused_parts(datas, n) if n else None
        if parts is None:
            return super().aggregate(datas, ctx, info)
        dev = datas[0].device
        out = _fast.empty(n, device=dev)
        _DECODE(n, dev, out, [p[0] for p in parts], [p[1] for p in parts], [p[2] for p in parts],
                K=2 ** parts[0][3])
        return out

    def wire_bytes(self, numel):
        if self.budget:
            return None
        return self.payload_bytes(numel, self.bits)

    def payload_bytes(self, numel: int, bits: int) -> int:
        """Exact bytes of one layer of ``numel`` elements at ``bits`` (see the module docstring)."""
        if numel == 0:
            return 0
        if self.bucket:
            fit = 2 ** bits - 2 if self.fitted(numel, bits) else 0
            return 8 + fit + _quant.chunks(numel, self.bucket) + packed_bytes(numel, bits)
        head = 4 + 4 * 2 ** bits if self.dist == "empirical" else 12
        return head + packed_bytes(numel, bits)
