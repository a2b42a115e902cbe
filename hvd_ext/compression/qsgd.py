"""QSGD (Alistarh et al. 2017, "QSGD: Communication-Efficient SGD via Gradient Quantization and Encoding").

Each bucket v of ``bucket`` consecutive elements (0 = whole tensor) is scaled
by its norm (``norm=l2`` as in the paper, or ``linf``) and every coordinate is
stochastically rounded to one of ``s`` uniform levels:
``Q(v_i) = norm * sign(v_i) * l_i / s`` with ``l_i = floor(s|v_i|/norm)`` plus
one with probability ``s|v_i|/norm - floor(s|v_i|/norm)`` -- unbiased.
The signed level ``l_i + s`` in ``[0, 2s]`` is sent as a b-bit code,
``b = ceil(log2(2s + 1))``; ``bits=b`` means ``s = 2**(b-1) - 1``, or give
``levels=s`` directly (1..127).

Wire bytes (exchanged by allgather, fixed size):
``4 * ceil(n / bucket) + ceil(n * b / 8)`` (one float32 norm per bucket,
then the packed codes; ``bucket=0``: one norm).

Kernels (``hvd_ext.ops.cuda_kernels``): codes are packed / unpacked by ``kernels.pack_bits``
/ ``unpack_bits``. On CUDA (kernels not forced off) the rounding and packing are
one ``kernels.quantize_pack`` pass over the signed level ``+-s|v_i|/norm`` with
the integer levels ``-s..s`` (the same unbiased rule, code = level + s), its
random numbers a counter hash seeded by ``derive_seed(seed, name, rank)`` and
the step; the CPU path draws the
dither from the same counter hash (``_cpu.uniform``) inside one fused pass.
"""
from __future__ import annotations

import math

import torch

from ..ops import cuda_kernels as _K
from ..ops.device import on_host
from ..options import Option, non_negative
from . import _quant
from ..ops import cpu_kernels as _cpu
from .base import Compressor, as_bytes, from_bytes, register
from ..ops.bits import packed_bytes


def _encode(v, key, codes_out, n: int, *, s: int, l2: bool):
    """(k, c) padded float32 buckets -> k norms; writes the n one-byte codes (level + s) to
    ``codes_out``: one fused pass of scaling, counter-hash dither and stochastic rounding."""
    norms = v.norm(dim=1, keepdim=True) if l2 else v.abs().amax(dim=1, keepdim=True)
    safe = torch.where(norms > 0, norms, torch.ones_like(norms))
    r = v.abs() / safe * s
    lo = r.floor()
    u = _cpu.uniform(v.numel(), key, v.device).view(v.shape)
    lvl = (lo + torch.where(u < r - lo, 1.0, 0.0)).clamp(max=s)
    signed = torch.where(v < 0, -lvl, lvl) + s
    # all k*c codes (padding included): compiled, a copy of a slice [:n] can lose the last partial
    # bucket, so the caller keeps the padded tail out of the packed stream instead
    codes_out.copy_(signed.reshape(-1).to(torch.uint8))
    return norms.reshape(-1)


def _dequantize(norms, codes, c: int, s: int):
    """one-byte codes (level + s) of whole buckets of c -> float32 values norm * level / s."""
    k = norms.numel()
    x = codes.to(torch.float32) - s
    return (x.view(k, c) * (norms / s).view(k, 1)).reshape(-1)


def _decode_sum(out, norms_list, codes_list, c: int, *, s: int):
    """out = sum over ranks of the dequantized codes (one fused pass, one write of the result)."""
    acc = None
    for norms, codes in zip(norms_list, codes_list):
        x = _dequantize(norms, codes, c, s)
        acc = x if acc is None else acc + x
    out.copy_(acc)


_ENCODE = _cpu.Kernel(_encode, "qsgd encode")
_DECODE_SUM = _cpu.Kernel(_decode_sum, "qsgd decode")


@register("qsgd")
class QSGDCompressor(Compressor):
    collective = "allgather"
    options = {
        "bits": Option(int, 4, "2 <= bits <= 8", lambda v: 2 <= v <= 8, help="bits per element (with sign)"),
        "levels": Option(int, 0, "0 (from bits) or 1 <= levels <= 127", lambda v: 0 <= v <= 127,
                         help="quantization levels s per sign"),
        "bucket": Option(int, 512, "integer >= 0 (0 = whole tensor)", non_negative),
        "norm": Option(str, "l2", choices=("l2", "linf")),
        "seed": Option(int, 0, "integer >= 0", non_negative),
    }

    def validate(self):
        if self.levels:
            b = max(1, math.ceil(math.log2(2 * self.levels + 1)))
            if "bits" in self._given and self._given_bits != b:
                raise ValueError(f"compressor 'qsgd': levels={self.levels} needs bits={b}, "
                                 f"but bits={self._given_bits} was given; give one of bits, levels")
            self.s, self.b = self.levels, b
        else:
            self.s, self.b = 2 ** (self.bits - 1) - 1, self.bits

    def noise_inflates_live_moment(self):
        # Below 8 bits the quantization variance inflates a live second moment: Adam on the 681k CNN,
        # 24 epochs, 93.05% with it live, 97.85% frozen (benchmarks/results/defaults_check_qsgd_adam_683k.json).
        return self.b < 8

    def __init__(self, **kw):
        self._given = set(kw)
        self._given_bits = kw.get("bits")
        if self._given_bits is not None:
            self._given_bits = self.options["bits"].convert("compressor 'qsgd'", "bits", self._given_bits)
        super().__init__(**kw)

    def compress(self, tensor, info):
        flat = tensor.reshape(-1).float()
        n = flat.numel()
        if n == 0:
            return torch.empty(0, dtype=torch.uint8, device=flat.device), None
        v = _quant.padded_view(flat, self.bucket)
        if not on_host(flat):
            if self.norm == "l2":
                norms = v.norm(dim=1, keepdim=True)
            else:
                norms = v.abs().amax(dim=1, keepdim=True)
            safe = torch.where(norms > 0, norms, torch.ones_like(norms))
            r = (v.abs() / safe * self.s).reshape(-1)[:n]
            levels = torch.arange(-self.s, self.s + 1, dtype=torch.float32, device=flat.device)
            packed = _K.quantize_pack(torch.where(flat < 0, -r, r), levels, 1.0, self.b,
                                      seed=_K.derive_seed(self.seed, info.name, info.rank), step=info.step)
            return as_bytes(norms.reshape(-1).contiguous(), packed), None
        key = _cpu.stream_key_tensor(self.seed, info.name, info.rank, info.step)
        k = v.shape[0]
        if self.b == 8 and k * v.shape[1] == n:  # codes are the payload bytes: write them after the norms
            payload = _cpu.empty(4 * k + n, torch.uint8, flat.device)
            norms = _ENCODE(n, flat.device, v, key, payload[4 * k:], n, s=self.s, l2=self.norm == "l2")
            payload[:4 * k].copy_(norms.view(torch.uint8))
            return payload, None
        m = max(v.numel(), 8 * ((n + 7) // 8))
        buf = _cpu.scratch("qsgd", m, torch.uint8, flat.device)
        norms = _ENCODE(n, flat.device, v, key, buf[:v.numel()], n, s=self.s, l2=self.norm == "l2")
        buf[n:].zero_()
        return as_bytes(norms, _cpu.pack_buffer(buf[:8 * ((n + 7) // 8)], n, self.b)), None

    def _split(self, data, n):
        norms, off = from_bytes(data, 0, torch.float32, _quant.chunks(n, self.bucket))
        return norms, data[off:]

    def decode(self, data, ctx, info):
        return self.aggregate([data], ctx, info)

    def aggregate(self, datas, ctx, info):
        n = info.numel
        dev = datas[0].device if datas else None
        if n == 0:
            return torch.zeros(0, device=dev)
        parts = [self._split(d, n) for d in datas]
        c = self.bucket if self.bucket > 0 else n
        if not on_host(datas[0]):
            out = None
            for norms, codes in parts:
                codes = _K.unpack_bits(codes, self.b, n)
                total = norms.numel() * c
                if total != n:
                    codes = torch.cat([codes, codes.new_zeros(total - n)])
                dense = _dequantize(norms, codes, c, self.s)[:n]
                out = dense if out is None else out.add_(dense)
            return out
        total = parts[0][0].numel() * c
        codes = [_cpu.padded(_cpu.unpack_to_buffer(d, self.b, n, f"qsgd/{r}"), total, f"qsgd/pad{r}")
                 for r, (_, d) in enumerate(parts)]
        out = _cpu.empty(total, device=dev)
        _DECODE_SUM(n, dev, out, [p[0] for p in parts], codes, c, s=self.s)
        return out[:n]

    def wire_bytes(self, numel):
        return 4 * _quant.chunks(numel, self.bucket) + packed_bytes(numel, self.b)
