"""qdist: layer-wise quantization fitted to the gradient's distribution (technique 5 in docs/techniques.md).

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
QSGD's per-bucket max-norm scaling beats it on real gradients (``benchmarks/quant_error.py``).
So each bucket j of B elements gets its own scale s_j >= max_j |x| and the layer's values are
normalized to z = x / s_j in [-1, 1], whose distribution *shape* (the same for the whole layer)
the levels are fitted to:

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

Kernels (``hvd_ext.ops.cuda_kernels``): codes go through ``kernels.pack_bits`` /
``unpack_bits``. On CUDA (kernels not forced off) step 3 is one
``kernels.quantize_pack`` pass of z onto the same levels (round up with
probability (z - a)/(b - a), the same unbiased rule), its random numbers a
counter hash seeded by ``derive_seed(seed, name, rank)`` and the step; the CPU
path draws the dither from the same counter hash (``_cpu.uniform``), in one fused
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
from typing import Dict, Tuple

import torch

from ..ops import cuda_kernels as _K
from ..ops.device import expect, on_host, read, upload
from ..options import Option, non_negative
from . import _quant
from ..ops import cpu_kernels as _cpu
from .base import Compressor, as_bytes, from_bytes, register
from ..ops.bits import packed_bytes

from .qdist_levels import (DISTS, FIT_BINS, FIT_MAX_BITS, FIT_SAMPLE, GRID_MAX, bucket_scale_codes, bucket_scales,
                           dp_levels, dp_levels_device, edges_device, fit_edges32, grid_index, grid_index_device, level_table,
                           sampled_error, sampled_error_device, table_levels, tables_device)
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


# ---- fused CPU kernels (see ``ops.cpu_kernels``) -------------------------------------------------------

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
    return idx + torch.where(_cpu.uniform(z.numel(), key, z.device) < p, 1.0, 0.0)


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


_STATS = _cpu.Kernel(_stats, "qdist fit")
_ROUND = _cpu.Kernel(_round, "qdist encode")
_DECODE = _cpu.Kernel(_decode, "qdist decode")
_AMAX_B = _cpu.Kernel(_bucket_amax, "qdist bucket max")
_ROUND_B = _cpu.Kernel(_round_buckets, "qdist bucket encode")
_DECODE_B = _cpu.Kernel(_decode_buckets, "qdist bucket decode")


# ---- the compressor -------------------------------------------------------------------------

def allocate_bits(layers, budget: float) -> list:
    """Whole bits per layer (1 to 8) under ``budget`` bits per element over the layers, each layer
    given as (elements, variance, shape, grid index): greedily the next bit where it lowers the
    variance-weighted distortion most and still fits."""
    total = math.floor(budget * sum(n for n, _, _, _ in layers) + 1e-9)
    bits = [1] * len(layers)
    used = sum(n for n, _, _, _ in layers)

    def gain(i):
        _, var, shape, k = layers[i]
        b = bits[i]
        return var * (level_table(shape, b, k)[1] - level_table(shape, b + 1, k)[1])

    heap = [(-gain(i), i) for i in range(len(layers))]
    heapq.heapify(heap)
    while heap:
        g, i = heapq.heappop(heap)
        n = layers[i][0]
        if used + n > total:
            continue  # this layer no longer fits; smaller ones may
        bits[i] += 1
        used += n
        if bits[i] < 8:
            heapq.heappush(heap, (-gain(i), i))
    return bits


@register("qdist")
class QDistCompressor(Compressor):
    collective = "allgather"
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

    @property
    def reads_device(self) -> bool:
        """Under a budget the bits of every layer are allocated on the host from the layers' fits."""
        return bool(self.budget)

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
        """This step's allocation for the layer: under its own name (a node-aware route's inner record is
        allocated as such), else its tensor's (a two-phase segment); else :meth:`uniform_bits`."""
        for key in (info.name, getattr(info, "base_name", None)):
            got = self._alloc.get(key) if key else None
            if got is not None and got[0] == info.step:
                return got[1]
        return self.uniform_bits()

    def prepare_bucket(self, items):
        """Allocate bits per layer under the budget (items: [(u, info)] of one bucket)."""
        if not self.budget:
            return
        layers = []
        for info, n, dist, sigma, t in self._layer_fits(items):
            if not (math.isfinite(sigma) and math.isfinite(t)):
                sigma, t = 0.0, 1.0
            shape = dist if dist != "empirical" else "gaussian"
            layers.append((info, n, sigma * sigma, shape, grid_index(t)))
        if not layers:
            return
        bits = allocate_bits([(n, var, shape, k) for _, n, var, shape, k in layers], self.budget)
        for (info, *_), b in zip(layers, bits):
            self._alloc[info.name] = (info.step, b)

    def _layer_fits(self, items):
        """[(info, n, dist, sigma, t)] of the non-empty layers: on a device fitted there and read once."""
        fits, rows = [], []
        for u, info in items:
            flat = u.reshape(-1).float()
            if flat.numel() == 0:
                continue
            if on_host(flat):
                dist, _, sigma, t = self.fit(flat)
                fits.append((info, flat.numel(), dist, sigma, t))
            else:
                code, _, sigma, t = self._fit_device(flat)
                rows.append(torch.stack([sigma.double(), t.double(), code.double()]))
                fits.append((info, flat.numel(), None, None, None))
        if rows:  # one read for the bucket
            vals = iter(read(torch.cat(rows)))
            done = []
            for info, n, dist, sigma, t in fits:
                if dist is None:
                    sigma, t, code = next(vals), next(vals), next(vals)
                    dist = DISTS[int(code)]
                done.append((info, n, dist, sigma, t))
            fits = done
        return fits

    # ---- codec -----------------------------------------------------------------------------
    def fitted(self, numel: int, bits: int) -> bool:
        """Whether a layer of ``numel`` elements at ``bits`` sends fitted grid levels (bucket format)."""
        K = 2 ** bits
        if K <= 2 or bits > FIT_MAX_BITS or self.dist in ("gaussian", "laplace"):
            return False
        return self.dist == "empirical" or numel * bits >= 64 * (K - 2)

    def uniform_bits(self) -> int:
        """The bits of a layer without an allocation of its own (``bits``, or the budget rounded down)."""
        return max(1, min(8, int(self.budget))) if self.budget else self.bits

    def payload_size(self, info, recoded=False):
        """Known from the shape unless a budget allocated this rank's bits from its own gradient."""
        if self.budget and not recoded:
            return None
        return self.payload_bytes(info.numel, self.uniform_bits())

    def recompress(self, tensor, info):
        """A two-phase owner re-codes the average at :meth:`uniform_bits` (under a budget, no allocation of
        its own): every rank then knows the sizes of the second phase without reading them."""
        return self._encode(tensor, info, self.uniform_bits())

    def compress(self, tensor, info):
        return self._encode(tensor, info, self.bits_for(info))

    def _encode(self, tensor, info, b: int):
        flat = tensor.reshape(-1).float()
        n = flat.numel()
        dev = flat.device
        if n == 0:
            return torch.empty(0, dtype=torch.uint8, device=dev), None
        if not on_host(flat):
            return self._compress_device(flat, b, info), None
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
        if z is None and K > 16:
            z = (flat - mu) / sigma
        if K <= 16:
            n = flat.numel()
            key = _cpu.stream_key_tensor(self.seed, info.name, info.rank, info.step)
            musig = torch.tensor([mu, sigma if sigma > 0 else 1.0], dtype=torch.float32) if dist != "empirical" \
                else torch.tensor([0.0, 1.0])
            zero = dist != "empirical" and (sigma == 0 or not math.isfinite(sigma) or not math.isfinite(mu)
                                            or not math.isfinite(t))
            buf = _cpu.codes_buffer("qdist", n, dev)
            _ROUND(n, dev, flat, musig.to(dev), levels.to(torch.float32), key, buf[:n], K=K, zero=zero)
            packed = _cpu.pack_buffer(buf, n, b)
        else:
            packed = _K.pack_bits(self._round(z, levels, info), b)
        return torch.cat([head, packed]), None

    # ---- bucket format ----------------------------------------------------------------------
    def _fit_bucket_levels(self, flat, scales, M, b):
        """(form, k, level indices or None, float32 levels on [-1, 1]) for the bucket format."""
        K = 2 ** b
        n = flat.numel()
        B = self.bucket
        st = max(1, -(-n // FIT_SAMPLE))
        pos = torch.arange(0, n, st, device=flat.device)
        s = scales[pos // B].to(torch.float64)
        z = torch.where(s > 0, flat[pos].to(torch.float64) / torch.where(s > 0, s, torch.ones_like(s)),
                        torch.zeros_like(s)).clamp_(-1.0, 1.0).cpu()
        w = (s / M).pow(2).cpu()
        if self.fitted(n, b):
            idx = dp_levels(z, w, K)
            return 2, 0, idx, fit_edges32()[idx].to(flat.device)
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
            idx = torch.linspace(0, FIT_BINS, K).round().long()
            form = 2
            levels = fit_edges32()[idx].to(dev)
        head = [torch.tensor([b, 16 + form], dtype=torch.uint8, device=dev),
                torch.tensor([k], dtype=torch.int16, device=dev),
                torch.tensor([M], dtype=torch.float32, device=dev)]
        if idx is not None:
            head.append(idx[1:-1].to(torch.uint8).to(dev))
        head.append(codes_s)
        head = as_bytes(*head)
        s2 = scales.view(-1, 1)
        inv = torch.where(s2 > 0, 1.0 / torch.where(s2 > 0, s2, torch.ones_like(s2)), torch.zeros_like(s2))
        if K <= 16:
            key = _cpu.stream_key_tensor(self.seed, info.name, info.rank, info.step)
            total = v.numel()
            buf = _cpu.scratch("qdist/b", max(total, 8 * ((n + 7) // 8)), torch.uint8, dev)
            _ROUND_B(total, dev, v.reshape(-1), inv, levels.to(torch.float32).contiguous(), key, buf[:total], K=K)
            buf[n:].zero_()
            packed = _cpu.pack_buffer(buf[:8 * ((n + 7) // 8)], n, b)
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
            grid = fit_edges32().to(data.device)
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
        if K <= 16 and all(p[0] == parts[0][0] for p in parts):
            codes = [_cpu.padded(_cpu.unpack_to_buffer(p[3], p[0], n, f"qdist/b{r}"), total, f"qdist/bpad{r}")
                     for r, p in enumerate(parts)]
            out = _cpu.empty(total, device=dev)
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
        key = _cpu.stream_key_tensor(self.seed, info.name, info.rank, info.step)
        up = _cpu.uniform(z.numel(), key, z.device) < p
        return (idx + up.long()).to(torch.uint8)

    def decode(self, data, ctx, info):
        n = info.numel
        if n == 0:
            return torch.zeros(0, device=data.device)
        if not on_host(data):
            return self._decode_device(data, n)
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
        if K <= 16:
            return self.aggregate([data], ctx, info)
        codes = _K.unpack_bits(data[off:], b, n).long()
        return mu + sigma * levels[codes]

    def _fused_parts(self, datas, n):
        """[(codes, levels, (mu, sigma))] of every rank for the fused CPU sum, or None when a payload
        needs the general path (CUDA, more than 16 levels, ranks with different bits, a degenerate fit)."""
        if not datas:
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
            parts.append((_cpu.unpack_to_buffer(data[off:], b, n, f"qdist/{r}"), levels.contiguous(),
                          musig.contiguous(), b))
        return parts

    def aggregate(self, datas, ctx, info):
        """Sum of the ranks' decoded payloads; on CPU one fused pass over all ranks."""
        n = info.numel
        if n and datas and not on_host(datas[0]):
            out = None
            for d in datas:
                x = self._decode_device(d, n)
                out = x if out is None else out.add_(x)
            return out
        if n and self.bucket and datas:
            return self._sum_buckets(datas, n)
        parts = self._fused_parts(datas, n) if n else None
        if parts is None:
            return super().aggregate(datas, ctx, info)
        dev = datas[0].device
        out = _cpu.empty(n, device=dev)
        _DECODE(n, dev, out, [p[0] for p in parts], [p[1] for p in parts], [p[2] for p in parts],
                K=2 ** parts[0][3])
        return out

    def wire_bytes(self, numel):
        if self.budget:
            return None
        return self.payload_bytes(numel, self.bits)

    def expected_piece_bytes(self, numels, pieces):
        """Under a budget the bits of each layer are allocated over the bucket from its gradients: priced by
        the same allocation for layers alike in all but size (a variance and a fit none yet has)."""
        if not self.budget:
            return super().expected_piece_bytes(numels, pieces)
        bits = allocate_bits([(int(n), 1.0, "gaussian", grid_index(4.0)) for n in numels], self.budget)
        return [[float(self.payload_bytes(int(k), b)) for k in ps] for ps, b in zip(pieces, bits)]

    def payload_bytes(self, numel: int, bits: int) -> int:
        """Exact bytes of one layer of ``numel`` elements at ``bits`` (see the module docstring)."""
        if numel == 0:
            return 0
        if self.bucket:
            fit = 2 ** bits - 2 if self.fitted(numel, bits) else 0
            return 8 + fit + _quant.chunks(numel, self.bucket) + packed_bytes(numel, bits)
        head = 4 + 4 * 2 ** bits if self.dist == "empirical" else 12
        return head + packed_bytes(numel, bits)

    # ---- on a device (docs/gpu.md): the same formats, fitted there, nothing read back -----------
    def _fit_device(self, flat):
        """(dist code 0-d int64 -- 0 gaussian, 1 laplace --, mu, sigma, t) as tensors on flat's device."""
        mu, sigma, mad, dmax = _stats(flat)
        if self.dist == "auto":
            gauss = -torch.log(sigma) - 0.5 * math.log(2 * math.pi * math.e)
            lap = -torch.log(2 * mad) - 1.0
            code = (lap > gauss).long()
        else:
            code = torch.full((), DISTS.index(self.dist) if self.dist != "empirical" else 0, dtype=torch.long,
                              device=flat.device)
        pos = sigma > 0
        t = torch.where(pos, dmax / torch.where(pos, sigma, torch.ones_like(sigma)), torch.zeros_like(sigma))
        return code, mu, sigma, t

    def _shape_levels(self, code, k, bits, device, unit=True):
        """The table levels of grid index ``k`` (0-d tensor) for the shape ``code`` (0-d tensor)."""
        k = k.reshape(1)
        if self.dist in ("gaussian", "laplace"):
            return tables_device(self.dist, bits, device, unit).index_select(0, k)[0]
        g = tables_device("gaussian", bits, device, unit).index_select(0, k)[0]
        lap = tables_device("laplace", bits, device, unit).index_select(0, k)[0]
        return torch.where(code == 1, lap, g)

    def _compress_device(self, flat, b, info):
        dev, K = flat.device, 2 ** b
        seed = _K.derive_seed(self.seed, info.name, info.rank)
        if self.bucket:
            return self._compress_buckets_device(flat, b, seed, info.step)
        if self.dist == "empirical":
            levels = self._empirical_levels(flat, K)
            head = as_bytes(upload([b, DISTS.index("empirical"), 0, 0], torch.uint8, dev), levels)
            z = flat
        else:
            code, mu, sigma, t = self._fit_device(flat)
            finite = torch.isfinite(mu) & torch.isfinite(sigma) & torch.isfinite(t)
            good = finite & (sigma != 0)
            k = torch.where(good, grid_index_device(t), 0)
            levels = torch.where(good, self._shape_levels(code, k, b, dev, unit=False),
                                 torch.zeros(K, dtype=torch.float32, device=dev))
            sig_out = torch.where(finite, sigma, torch.full_like(sigma, float("nan")))
            head = as_bytes(upload([b], torch.uint8, dev), code.to(torch.uint8).reshape(1),
                            k.to(torch.int16).reshape(1), torch.stack([mu, sig_out]).to(torch.float32))
            z = torch.where(good, (flat - mu) / torch.where(good, sigma, torch.ones_like(sigma)), torch.zeros_like(flat))
        return torch.cat([head, _K.quantize_pack(z, levels, 1.0, b, seed=seed, step=info.step)])

    def _compress_buckets_device(self, flat, b, seed, step):
        n, dev, K, B = flat.numel(), flat.device, 2 ** b, self.bucket
        v = _quant.padded_view(flat, B)
        amax = v.abs().amax(1)
        M = amax.max()
        good = torch.isfinite(M) & (M > 0)
        Mf = torch.where(good, M, torch.zeros_like(M))
        codes_s = bucket_scale_codes(amax, M)
        scales = bucket_scales(codes_s, Mf)
        pos = torch.arange(0, n, max(1, -(-n // FIT_SAMPLE)), device=dev)
        s = scales[pos // B].to(torch.float64)
        z = torch.where(s > 0, flat[pos].to(torch.float64) / torch.where(s > 0, s, torch.ones_like(s)),
                        torch.zeros_like(s)).clamp_(-1.0, 1.0)
        w = torch.where(good, (s / torch.where(good, Mf, torch.ones_like(Mf)).to(torch.float64)).pow(2),
                        torch.zeros_like(s))
        extra = []
        if self.fitted(n, b):  # weights all zero (nothing to fit) give evenly spread levels, as on the host
            idx = dp_levels_device(z, w, K)
            levels = edges_device(dev)[idx]
            form = torch.full((), 2, dtype=torch.long, device=dev)
            k = torch.zeros((), dtype=torch.long, device=dev)
            extra = [idx[1:-1].to(torch.uint8)]
        else:
            ez2 = (w * z * z).sum()
            T = torch.where(ez2 > 0, (w.sum() / torch.where(ez2 > 0, ez2, torch.ones_like(ez2))).sqrt(),
                            torch.ones_like(ez2))
            k = torch.where(good, grid_index_device(T), 0)
            if self.dist in ("gaussian", "laplace"):
                form = torch.full((), DISTS.index(self.dist), dtype=torch.long, device=dev)
            else:  # the shape with the smaller sampled error (the Gaussian on a tie, and when nothing is fitted)
                err = [sampled_error_device(z, w, tables_device(d, b, dev).index_select(0, k.reshape(1))[0])
                       for d in ("gaussian", "laplace")]
                form = ((err[1] < err[0]) & good).long()
            levels = self._shape_levels(form, k, b, dev)
        head = as_bytes(upload([b], torch.uint8, dev), (16 + form).to(torch.uint8).reshape(1),
                        k.to(torch.int16).reshape(1), M.to(torch.float32).reshape(1), *extra, codes_s)
        s2 = scales.view(-1, 1)
        inv = torch.where(s2 > 0, 1.0 / torch.where(s2 > 0, s2, torch.ones_like(s2)), torch.zeros_like(s2))
        z_all = (v * inv).reshape(-1)[:n].clamp(-1.0, 1.0)
        return torch.cat([head, _K.quantize_pack(z_all, levels, 1.0, b, seed=seed, step=step)])

    def _bits_of(self, data, n: int) -> int:
        """The bits of a payload: fixed, or under a budget the one whose size matches (sizes grow with it)."""
        if not self.budget:
            return self.bits
        for b in range(1, 9):
            if self.payload_bytes(n, b) == data.numel():
                return b
        raise ValueError(f"qdist: a payload of {data.numel()} bytes fits no bit width for {n} elements")

    def _decode_device(self, data, n: int):
        b = self._bits_of(data, n)
        K = 2 ** b
        expect(data[0] == b, f"qdist: corrupt header (its bits disagree with its size, {b} bits)")
        k = (from_bytes(data, 2, torch.int16, 1)[0][0].long() & 0xFFFF).clamp(max=GRID_MAX)
        if self.bucket:
            form = data[1].long() - 16
            expect((form >= 0) & (form < len(DISTS)), f"qdist: corrupt header (form; bucket={self.bucket})")
            M, off = from_bytes(data, 4, torch.float32, 1)
            if self.fitted(n, b):
                idx = data[off:off + K - 2].long()
                off += K - 2
                grid = edges_device(data.device)
                levels = torch.cat([grid[:1], grid[idx], grid[-1:]])
            else:
                levels = self._shape_levels(form, k, b, data.device)
            nb = _quant.chunks(n, self.bucket)
            scales = bucket_scales(data[off:off + nb], M[0]).view(-1, 1)
            codes = _K.unpack_bits(data[off + nb:], b, n).long()
            return levels[codes] * scales.expand(-1, self.bucket).reshape(-1)[:n]
        if self.dist == "empirical":
            levels, off = from_bytes(data, 4, torch.float32, K)
            return levels[_K.unpack_bits(data[off:], b, n).long()]
        code = data[1].long()
        musig, off = from_bytes(data, 4, torch.float32, 2)
        mu, sigma = musig[0], musig[1]
        x = mu + sigma * self._shape_levels(code, k, b, data.device, unit=False)[_K.unpack_bits(data[off:], b, n).long()]
        degenerate = (sigma == 0) | ~torch.isfinite(sigma)
        return torch.where(degenerate, mu + sigma * torch.zeros_like(x), x)
