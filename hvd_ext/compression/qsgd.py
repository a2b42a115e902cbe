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

Kernels (``hvd_ext.kernels``): codes are packed / unpacked by ``kernels.pack_bits``
/ ``unpack_bits``. On CUDA (kernels not forced off) the rounding and packing are
one ``kernels.quantize_pack`` pass over the signed level ``+-s|v_i|/norm`` with
the integer levels ``-s..s`` (the same unbiased rule, code = level + s), its
random numbers a counter hash seeded by ``derive_seed(seed, name, rank)`` and
the step; the CPU path keeps its ``torch.Generator`` stream.
"""
from __future__ import annotations

import math

import torch

from .. import kernels as _K
from ..options import Option, non_negative
from . import _quant
from .base import Compressor, as_bytes, from_bytes, register
from .bitpack import packed_bytes


@register("qsgd")
class QSGDCompressor(Compressor):
    exchange = "allgather"
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
        if self.norm == "l2":
            norms = v.norm(dim=1, keepdim=True)
        else:
            norms = v.abs().amax(dim=1, keepdim=True)
        safe = torch.where(norms > 0, norms, torch.ones_like(norms))
        r = (v.abs() / safe * self.s).reshape(-1)[:n]
        if _K.backend(flat) == "cuda":
            levels = torch.arange(-self.s, self.s + 1, dtype=torch.float32, device=flat.device)
            packed = _K.quantize_pack(torch.where(flat < 0, -r, r), levels, 1.0, self.b,
                                      seed=_K.derive_seed(self.seed, info.name, info.rank), step=info.step)
            return as_bytes(norms.reshape(-1).contiguous(), packed), None
        g = _quant.generator(self.seed, info.step, info.name, info.rank, flat.device)
        lo = r.floor()
        lvl = lo + (_quant.uniform(n, g, flat.device) < (r - lo)).float()
        lvl = lvl.clamp_(max=self.s)
        signed = torch.where(flat < 0, -lvl, lvl) + self.s
        codes = signed.to(torch.uint8)
        return as_bytes(norms.reshape(-1).contiguous(), _K.pack_bits(codes, self.b)), None

    def decode(self, data, ctx, info):
        n = info.numel
        if n == 0:
            return torch.zeros(0, device=data.device)
        k = _quant.chunks(n, self.bucket)
        norms, off = from_bytes(data, 0, torch.float32, k)
        codes = _K.unpack_bits(data[off:], self.b, n).float() - self.s
        c = self.bucket if self.bucket > 0 else n
        scale = norms.repeat_interleave(c)[:n] if k > 1 else norms.expand(n)
        return codes * (scale / self.s)

    def wire_bytes(self, numel):
        return 4 * _quant.chunks(numel, self.bucket) + packed_bytes(numel, self.b)
