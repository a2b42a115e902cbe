"""The level math of qdist (technique 5 in docs/techniques.md): tables, grids and fits, on the host and on a device.

* :func:`level_table` -- the 2^b levels of a unit-variance Gaussian or Laplace that minimize the
  expected error of *stochastic* rounding within +-T, T = 2^(k/16) (Newton on the Lloyd-Max
  conditions of unbiased rounding), cached per (shape, bits, k); :func:`table_levels` scales them to
  [-1, 1];
* :func:`dp_levels` -- the exact optimum over a grid of 129 candidate levels for a sampled,
  weighted layer, by dynamic programming over a 128-bin histogram;
* per-bucket scale codes (one byte per bucket, s_j = M 2^(-c_j/16)).

The ``*_device`` variants compute the same on the gradient's device without reading anything
back (``docs/gpu.md``): histograms by ``scatter_add``, the DP's backtracking by gathers, the
grid index as a tensor looked up in tables of every k up to :data:`GRID_MAX` (uploaded once per
device). ``hvd_ext.compression.qdist`` is the codec that uses them.
"""
from __future__ import annotations

import math
from functools import lru_cache
from typing import Dict, Tuple

import torch

from ..ops.device import upload_tensor

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
FIT_BINS = 128                   # level grid: 129 points sign(t) t^2, t = -1 + 2 i / 128
FIT_SAMPLE = 32768               # elements the fit looks at (evenly strided)
FIT_MAX_BITS = 4                 # fitted levels up to 16 of them
_FIT_EDGES64 = None
_FIT_PAIRS = None


def fit_edges() -> torch.Tensor:
    """The 129 float64 candidate level positions on [-1, 1] (index 64 is 0)."""
    global _FIT_EDGES64, _FIT_PAIRS
    if _FIT_EDGES64 is None:
        t = torch.linspace(-1.0, 1.0, FIT_BINS + 1, dtype=torch.float64)
        e = t.sign() * t * t
        e[0], e[FIT_BINS // 2], e[-1] = -1.0, 0.0, 1.0
        lo, hi = e.view(-1, 1), e.view(1, -1)
        _FIT_PAIRS = (lo + hi, lo * hi, hi > lo)
        _FIT_EDGES64 = e
    return _FIT_EDGES64


def fit_edges32() -> torch.Tensor:
    """:func:`fit_edges` as float32."""
    return _on("edges32", "cpu", lambda: fit_edges().to(torch.float32))


def bucket_scale_codes(amax: torch.Tensor, M) -> torch.Tensor:
    """uint8 codes c_j with ``M 2^(-c_j/16) >= amax_j`` (smallest such), 255 for amax_j = 0; all 0 when
    M is not a positive finite number. ``M``: a float, or a 0-d tensor on amax's device."""
    if not isinstance(M, torch.Tensor):
        if not M > 0 or not math.isfinite(M):
            return torch.zeros(amax.shape, dtype=torch.uint8, device=amax.device)
        good = None
    else:
        good = (M > 0) & torch.isfinite(M)
        M = torch.where(good, M, torch.ones_like(M))
    r = (amax.to(torch.float32) / M).clamp(min=2.0 ** -40)
    # a margin of 1e-3 steps (4e-5 relative) keeps the float32 scale above amax despite rounding
    c = torch.floor(-_SCALE_STEPS * torch.log2(r) - 1e-3).clamp_(0, _ZERO_BUCKET - 1)
    c = torch.where(amax > 0, c, torch.full_like(c, _ZERO_BUCKET))
    if good is not None:
        c = torch.where(good, c, torch.zeros_like(c))
    return c.to(torch.uint8)


def bucket_scales(codes: torch.Tensor, M) -> torch.Tensor:
    """float32 scales ``M 2^(-c/16)`` (0 for code 255) of the uint8 scale codes."""
    return _on("scale_pow", codes.device, lambda: _SCALE_POW)[codes.long()] * M


def dp_levels(z: torch.Tensor, w: torch.Tensor, K: int) -> torch.Tensor:
    """Indices (int64, K of them, 0 and 128 included) into :func:`fit_edges` of the K levels that
    minimize ``sum_i w_i (z_i - a_k)(a_{k+1} - z_i)`` (stochastic-rounding error) over levels on
    the grid, exactly: dynamic programming over the weighted histogram (prefix sums make every
    interval's cost closed-form, and exact since the levels sit on bin edges)."""
    fit_edges()  # the grid and its pair tables
    E = FIT_BINS
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


# ---- on a device: the same fits without reading anything back ---------------------------------

GRID_MAX = 128  # the device's grid index stops at T = 2^(128/16) = 256 (levels still end at +-1)
_CACHE: Dict[Tuple[str, str], torch.Tensor] = {}


def _on(key: str, device, make) -> torch.Tensor:
    """A constant table on ``device``, made on the host once and uploaded once (non-blocking)."""
    dev = torch.device(device)
    got = _CACHE.get((key, str(dev)))
    if got is None:
        got = _CACHE[(key, str(dev))] = upload_tensor(make(), dev)
    return got


def edges_device(device) -> torch.Tensor:
    """The 129 fitted-level candidates of :func:`fit_edges` as float32 on ``device``."""
    return _on("edges32", device, fit_edges32)


def tables_device(dist: str, bits: int, device, unit: bool = True) -> torch.Tensor:
    """(GRID_MAX + 1, 2^bits) float32: the levels of grid index k in row k -- :func:`table_levels`
    (on [-1, 1]) or, ``unit=False``, :func:`level_table` (on [-T, T])."""
    def make():
        rows = [table_levels(dist, bits, k) if unit else level_table(dist, bits, k)[0] for k in range(GRID_MAX + 1)]
        return torch.stack(rows).to(torch.float32)
    return _on(f"table/{dist}/{bits}/{int(unit)}", device, make)


def grid_index_device(t: torch.Tensor) -> torch.Tensor:
    """:func:`grid_index` of a 0-d tensor, as an int64 0-d tensor in [0, GRID_MAX] (0 for NaN)."""
    t = t.to(torch.float64)
    k = torch.ceil(_GRID * torch.log2(t.clamp(min=1.0)) - 1e-12)
    k = torch.nan_to_num(k, nan=0.0, posinf=GRID_MAX).clamp(0, GRID_MAX)
    k = k + (torch.pow(2.0, k / _GRID) < t).to(k.dtype)  # one step up where rounding fell short
    return k.clamp(0, GRID_MAX).to(torch.int64)


def dp_levels_device(z: torch.Tensor, w: torch.Tensor, K: int) -> torch.Tensor:
    """:func:`dp_levels` on z's device (int64 indices, K of them): the same optimum, over every edge of
    the grid (the host prunes the edges of empty bins first, which changes nothing but ties); the
    backtracking by gathers. An all-zero weight gives evenly spread edges, as on the host."""
    dev = z.device
    E = FIT_BINS
    plus, prod, valid = (_on(f"pairs/{i}", dev, lambda i=i: _pairs()[i]) for i in range(3))
    z = z.to(torch.float64)
    w = w.to(torch.float64)
    t = z.sign() * z.abs().sqrt()
    b = ((t + 1.0) * (E / 2)).floor().clamp_(0, E - 1).long() + 1
    zero = torch.zeros(E + 1, dtype=torch.float64, device=dev)
    C = zero.index_add(0, b, w).cumsum(0)
    S = zero.index_add(0, b, w * z).cumsum(0)
    Q = zero.index_add(0, b, w * z * z).cumsum(0)
    total = C[-1]
    ok = (total > 0) & torch.isfinite(total)
    total = torch.where(ok, total, torch.ones_like(total))
    C, S, Q = C / total, S / total, Q / total
    cost = (S.view(1, -1) - S.view(-1, 1)).mul_(plus)
    cost.sub_(Q.view(1, -1) - Q.view(-1, 1)).sub_((C.view(1, -1) - C.view(-1, 1)).mul_(prod))
    cost.clamp_(min=0.0).masked_fill_(~valid, float("inf"))
    D = cost[0]
    back = []
    for _ in range(K - 2):
        D, arg = (D.view(-1, 1) + cost).min(0)
        back.append(arg)
    j = torch.full((1,), E, dtype=torch.int64, device=dev)
    idx = [j]
    for row in reversed(back):
        j = row.index_select(0, j)
        idx.append(j)
    idx.append(torch.zeros(1, dtype=torch.int64, device=dev))
    found = torch.cat(idx[::-1])
    even = _on(f"even/{K}", dev, lambda: torch.linspace(0, E, K).round().long())
    return torch.where(ok, found, even)


def _pairs():
    fit_edges()
    return _FIT_PAIRS


def sampled_error_device(z: torch.Tensor, w: torch.Tensor, levels: torch.Tensor) -> torch.Tensor:
    """:func:`sampled_error` as a 0-d float64 tensor on z's device."""
    lv = levels.to(torch.float64)
    z = z.to(torch.float64).clamp(-1.0, 1.0)
    i = (torch.searchsorted(lv, z, right=True) - 1).clamp_(0, lv.numel() - 2)
    return (w.to(torch.float64) * (z - lv[i]) * (lv[i + 1] - z)).sum()
