"""1-bit SGD (Seide et al. 2014, "1-Bit Stochastic Gradient Descent and its Application to
Data-Parallel Distributed Training of Speech DNNs").

Quantization threshold 0: each coordinate of the error-compensated gradient
``p = g + e`` sends one bit (1 for ``p_i >= 0``), and two reconstruction values
are sent per chunk: the mean of the coordinates with bit 1 and the mean of
those with bit 0 (this minimizes the squared error for the given bits). The
paper keeps one pair per matrix column; ``bucket=B`` keeps one pair per B
consecutive coordinates (default 1024; ``bucket=0``: one pair per tensor).
Error feedback (``feedback=residual``, the default) keeps ``e <- p - sent``.

Wire bytes (allgather, fixed size): ``8 * chunks + ceil(n / 8)``, chunks =
``ceil(n / bucket)`` (1 for ``bucket=0``): two float32 values per chunk + bits.
"""
from __future__ import annotations

import torch

from .. import kernels as _K
from ..options import Option, non_negative
from ._quant import chunk_counts, chunks, padded_view
from .base import Compressor, as_bytes, from_bytes, register
from .bitpack import packed_bytes
from .efsignsgd import warn_if_sgd_momentum


@register("onebit")
class OneBitCompressor(Compressor):
    exchange = "allgather"
    default_feedback = "residual"
    options = {"bucket": Option(int, 1024, "integer >= 0 (0 = one pair per tensor)", non_negative,
                                help="coordinates per pair of reconstruction values")}

    def bind_optimizer(self, optimizer):
        warn_if_sgd_momentum(self, optimizer)  # before the feedback takes the momentum over
        super().bind_optimizer(optimizer)

    def compress(self, tensor, info):
        flat = tensor.reshape(-1).float()
        n = flat.numel()
        if n == 0:
            return torch.empty(0, dtype=torch.uint8, device=flat.device), None
        pos = flat >= 0
        view = padded_view(flat, self.bucket)
        pview = padded_view(pos, self.bucket, False)
        counts = chunk_counts(n, self.bucket, flat.device)
        npos = pview.sum(1).float()
        sp = torch.where(pview, view, torch.zeros_like(view)).sum(1)
        sn = view.sum(1) - sp
        vpos = sp / npos.clamp(min=1)
        vneg = sn / (counts - npos).clamp(min=1)
        vals = torch.stack([vneg, vpos], 1).reshape(-1).float()  # (neg, pos) per chunk
        # kernels.sign_pack: bit 1 iff flat >= 0, i.e. exactly ``pos`` (kernel on CUDA, bitpack else)
        return as_bytes(vals, _K.sign_pack(flat)), None

    def decode(self, data, ctx, info):
        n = info.numel
        if n == 0:
            return torch.zeros(0, device=data.device)
        c = chunks(n, self.bucket)
        vals, off = from_bytes(data, 0, torch.float32, 2 * c)
        bits = _K.unpack_bits(data[off:], 1, n).long()
        size = self.bucket if self.bucket > 0 else n
        chunk_of = torch.arange(n, device=data.device) // size
        return vals[2 * chunk_of + bits]

    def wire_bytes(self, numel):
        return (8 * chunks(numel, self.bucket) + packed_bytes(numel, 1)) if numel else 0
