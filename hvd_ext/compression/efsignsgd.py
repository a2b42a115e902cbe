"""EF-signSGD (Karimireddy et al. 2019, "Error Feedback Fixes SignSGD and other Gradient
Compression Schemes").

Each rank sends the scaled sign ``(||p_c||_1 / |c|) * sign(p_c)`` of its
error-compensated gradient ``p = g + e`` (``feedback=residual`` by default keeps
``e <- p - sent``); the ranks' scaled signs are averaged. Sign bit 1 means
``p_i >= 0``. The paper scales each layer by one number (``bucket=0``); with
``bucket=B`` every chunk c of B consecutive coordinates gets its own scale,
which follows the gradient's magnitude much more closely for 1/32 bit more per
element at B=1024 (our default).

Momentum: under ``torch.optim.SGD`` with momentum the momentum is compressed, as 1-bit
Adam does (see ``hvd_ext.feedback.residual.compress_momentum``); under Adam the warm-up and frozen second moment
of ``hvd_ext.variance_freeze`` apply, which together make 1-bit Adam.

Wire bytes (allgather, fixed size): ``4 * chunks + ceil(n / 8)``, chunks =
``ceil(n / bucket)`` (1 for ``bucket=0``): float32 scales + sign bits.
"""
from __future__ import annotations

import torch

from ..ops.device import on_host
from ..feedback.residual import compress_momentum
from ..options import Option, non_negative
from ._quant import chunk_means, chunks, expand_chunks
from .base import Compressor, as_bytes, from_bytes, register
from ..ops.bits import packed_bytes
from .signsgd import bits_to_sign, sign_aggregate_cpu, sign_bits, sign_compress_cpu


@register("efsignsgd")
class EFSignSGDCompressor(Compressor):
    collective = "allgather"
    default_feedback = "residual"
    options = {"bucket": Option(int, 1024, "integer >= 0 (0 = one scale per tensor)", non_negative,
                                help="coordinates per scale")}

    def default_warmup(self, frozen_moment: bool) -> int:
        return 200 if frozen_moment else 0  # 1-bit Adam's warm-up: under Adam these diverged without it

    def bind_optimizer(self, optimizer):
        # SGD only: under Adam, 1-bit Adam's dense warm-up and frozen second moment apply instead
        compress_momentum(self, optimizer, adam=False)  # before the feedback takes the momentum over
        super().bind_optimizer(optimizer)

    def compress(self, tensor, info):
        flat = tensor.reshape(-1).float()
        n = flat.numel()
        if n == 0:
            return torch.empty(0, dtype=torch.uint8, device=flat.device), None
        if on_host(flat):
            scales, bits = sign_compress_cpu(flat, self.bucket, True, "efsignsgd")
            return as_bytes(scales, bits), None
        scales = chunk_means(flat.abs(), self.bucket)
        return as_bytes(scales, sign_bits(flat)), None

    def decode(self, data, ctx, info):
        return self.aggregate([data], ctx, info)

    def aggregate(self, datas, ctx, info):
        """Sum of the ranks' scaled signs (fused on CPU: one write of the dense result)."""
        n = info.numel
        if n == 0:
            return torch.zeros(0, device=datas[0].device if datas else None)
        parts = [from_bytes(d, 0, torch.float32, chunks(n, self.bucket)) for d in datas]
        if on_host(datas[0]):
            return sign_aggregate_cpu([d[off:] for d, (_, off) in zip(datas, parts)], [s for s, _ in parts], n,
                                      self.bucket, False, "efsignsgd")
        out = None
        for d, (s, off) in zip(datas, parts):
            dense = bits_to_sign(d[off:], n) * expand_chunks(s, n, self.bucket)
            out = dense if out is None else out.add_(dense)
        return out

    def wire_bytes(self, numel):
        return (4 * chunks(numel, self.bucket) + packed_bytes(numel, 1)) if numel else 0
