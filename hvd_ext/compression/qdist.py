"""qdist: layer-wise quantization fitted to the gradient's distribution (thesis technique 5).

Related work: Lloyd 1982 / Max 1960 (optimal scalar quantizers), Faghri et al. 2020
("Adaptive Gradient Quantization for Data-Parallel SGD", ALQ/AMQ) and Ramezani-Kebrya
et al. 2021 ("NUQSGD") for unbiased non-uniform levels.

Per layer (one tensor x of n elements):

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

Payload of one layer (allgather; header then codes):
  gaussian/laplace: ``u8 b | u8 dist | u16 k | f32 mu | f32 sigma`` then codes:
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
(NaN inputs give arbitrary codes; such steps are skipped anyway.)
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


def _round(x, musig, levels, key, codes_out, *, K: int, zero: bool):
    """Stochastic rounding of z = (x - mu) / sigma onto the K sorted levels (up with probability
    (z - a) / (b - a), a <= z < b neighbouring levels; outside: the end levels), one-byte codes to
    ``codes_out``. ``zero``: a degenerate fit, every z is 0."""
    x = x.to(torch.float32)
    z = torch.zeros_like(x) if zero else (x - musig[0]) / musig[1]
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
    up = torch.where(_fast.uniform(x.numel(), key, x.device) < p, 1.0, 0.0)
    codes_out.copy_((idx + up).to(torch.uint8))


def _decode(out, codes_list, levels_list, musig_list, *, K: int):
    """out = sum over ranks of mu + sigma * levels[code] (selects over the small level table)."""
    acc = None
    for codes, levels, musig in zip(codes_list, levels_list, musig_list):
        c = codes.to(torch.float32)
        v = levels[0]
        for j in range(1, K):
            v = torch.where(c > j - 0.5, levels[j], v)
        x = musig[0] + musig[1] * v
        acc = x if acc is None else acc + x
    out.copy_(acc)


_STATS = _fast.Kernel(_stats, "qdist fit")
_ROUND = _fast.Kernel(_round, "qdist encode")
_DECODE = _fast.Kernel(_decode, "qdist decode")


# ---- the compressor -------------------------------------------------------------------------

@register("qdist")
class QDistCompressor(Compressor):
    exchange = "allgather"
    options = {
        "bits": Option(int, 3, "1 <= bits <= 8", lambda v: 1 <= v <= 8),
        "dist": Option(str, "auto", choices=("auto",) + DISTS),
        "budget": Option(float, 0.0, "0 (off) or 1 <= budget <= 8 (average bits per element)",
                         lambda v: v == 0 or 1 <= v <= 8),
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
    def compress(self, tensor, info):
        flat = tensor.reshape(-1).float()
        n = flat.numel()
        dev = flat.device
        if n == 0:
            return torch.empty(0, dtype=torch.uint8, device=dev), None
        b = self.bits_for(info)
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
        return self.payload_bytes(numel, self.bits, self.dist == "empirical")

    @staticmethod
    def payload_bytes(numel: int, bits: int, empirical: bool = False) -> int:
        if numel == 0:
            return 0
        head = 4 + 4 * 2 ** bits if empirical else 12
        return head + packed_bytes(numel, bits)
