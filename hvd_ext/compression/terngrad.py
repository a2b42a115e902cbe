"""TernGrad (Wen et al. 2017, "TernGrad: Ternary Gradients to Reduce Communication in Distributed Deep Learning").

Per layer scaler ``s = max|g|``; each coordinate becomes ``s * sign(g_i) * b_i``
with ``b_i ~ Bernoulli(|g_i| / s)``, so ``E[Q(g)] = g`` (unbiased). Optional
layer-wise gradient clipping (the paper's ``c = 2.5``): ``clip=c > 0`` first
clips ``|g_i| <= c * std(g)`` (biased, lower variance; 0 = off). Default 2.5
as in the paper: unclipped, a few outliers set s, the rest rounds to 0 with high
variance, and training in an ordinary loop degrades after its peak. Scaler sharing
across workers (the paper's max over workers) is not done: each rank sends its
own scaler, so no extra collective is needed.

Ternary value ``t in {-1, 0, 1}`` is sent as the 2-bit code ``t + 1``.
Wire bytes (allgather, fixed size): ``4 + ceil(2 * n / 8)`` (float32 scaler + codes).

Kernels (``hvd_ext.ops.cuda_kernels``): codes go through ``kernels.pack_bits`` /
``unpack_bits``; on CUDA (kernels not forced off) rounding + packing are one
``kernels.quantize_pack`` of ``g / s`` onto the levels (-1, 0, 1) (same
Bernoulli(|g_i|/s) rule, code = t + 1), seeded by ``derive_seed(seed, name,
rank)`` and the step; the CPU path draws the
dither from the same counter hash (``_cpu.uniform``) inside one fused pass.
"""
from __future__ import annotations

import torch

from ..ops import cuda_kernels as _K
from ..ops.device import on_host
from ..options import Option, non_negative
from ..ops import cpu_kernels as _cpu
from .base import Compressor, as_bytes, from_bytes, register
from ..ops.bits import packed_bytes


def _encode(x, key, codes_out, *, clip: float):
    """Clip to clip * std (clip > 0), scaler s = max|g|, ternary code sign(g_i) * Bernoulli(|g_i| / s) + 1
    (one-byte codes written to ``codes_out``), dithered by the counter hash. Returns s."""
    g = x.to(torch.float32)
    n = g.numel()
    if clip > 0 and n > 1:
        mu = g.mean()
        c = clip * ((g - mu).pow(2).sum() / (n - 1)).sqrt()
        g = torch.maximum(torch.minimum(g, c), -c)
    s = g.abs().amax()
    p = g.abs() / torch.where(s > 0, s, torch.ones_like(s))
    keep = _cpu.uniform(n, key, g.device) < p
    codes_out.copy_(torch.where(keep, torch.where(g < 0, 0.0, 2.0), 1.0).to(torch.uint8))
    return s


def _decode_sum(out, scalers, codes_list):
    acc = None
    for s, codes in zip(scalers, codes_list):
        x = (codes.to(torch.float32) - 1) * s
        acc = x if acc is None else acc + x
    out.copy_(acc)


_ENCODE = _cpu.Kernel(_encode, "terngrad encode")
_DECODE_SUM = _cpu.Kernel(_decode_sum, "terngrad decode")


@register("terngrad")
class TernGradCompressor(Compressor):
    collective = "allgather"
    options = {
        "clip": Option(float, 2.5, "clip >= 0 (multiples of the std; 0 = no clipping)", non_negative),
        "seed": Option(int, 0, "integer >= 0", non_negative),
    }

    def compress(self, tensor, info):
        flat = tensor.reshape(-1).float()
        n = flat.numel()
        if n == 0:
            return torch.empty(0, dtype=torch.uint8, device=flat.device), None
        if not on_host(flat):
            if self.clip > 0 and n > 1:
                c = self.clip * flat.std()
                flat = flat.clamp(-c, c)
            s = flat.abs().max()
            levels = torch.arange(-1, 2, dtype=torch.float32, device=flat.device)
            packed = _K.quantize_pack(flat / torch.where(s > 0, s, torch.ones_like(s)), levels, 1.0, 2,
                                      seed=_K.derive_seed(self.seed, info.name, info.rank), step=info.step)
            return as_bytes(s.reshape(1), packed), None
        key = _cpu.stream_key_tensor(self.seed, info.name, info.rank, info.step)
        buf = _cpu.codes_buffer("terngrad", n, flat.device)
        s = _ENCODE(n, flat.device, tensor.reshape(-1), key, buf[:n], clip=float(self.clip))
        return as_bytes(s.reshape(1), _cpu.pack_buffer(buf, n, 2)), None

    def decode(self, data, ctx, info):
        return self.aggregate([data], ctx, info)

    def aggregate(self, datas, ctx, info):
        n = info.numel
        dev = datas[0].device if datas else None
        if n == 0:
            return torch.zeros(0, device=dev)
        parts = [from_bytes(d, 0, torch.float32, 1) for d in datas]
        if not on_host(datas[0]):
            out = None
            for d, (s, off) in zip(datas, parts):
                dense = (_K.unpack_bits(d[off:], 2, n).float() - 1) * s
                out = dense if out is None else out.add_(dense)
            return out
        codes = [_cpu.unpack_to_buffer(d[off:], 2, n, f"terngrad/{r}") for r, (d, (_, off)) in
                 enumerate(zip(datas, parts))]
        out = _cpu.empty(n, device=dev)
        _DECODE_SUM(n, dev, out, [s for s, _ in parts], codes)
        return out

    def wire_bytes(self, numel):
        return (4 + packed_bytes(numel, 2)) if numel else 0
