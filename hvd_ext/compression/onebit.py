"""1-bit SGD (Seide et al. 2014, "1-Bit Stochastic Gradient Descent and its Application to
Data-Parallel Distributed Training of Speech DNNs").

Quantization threshold 0: each coordinate of the error-compensated gradient
``p = g + e`` sends one bit (1 for ``p_i >= 0``), and two reconstruction values
are sent per chunk: the mean of the coordinates with bit 1 and the mean of
those with bit 0 (this minimizes the squared error for the given bits). The
paper keeps one pair per matrix column; ``bucket=B`` keeps one pair per B
consecutive coordinates (default 1024; ``bucket=0``: one pair per tensor).
Error feedback (``feedback=residual``, the default) keeps ``e <- p - sent``. Under
``torch.optim.SGD`` with momentum the momentum is compressed (as in efsignsgd, after 1-bit
Adam); under Adam the second moment is frozen after a dense warm-up (``hvd_ext.variance_freeze``).

Wire bytes (allgather, fixed size): ``8 * chunks + ceil(n / 8)``, chunks =
``ceil(n / bucket)`` (1 for ``bucket=0``): two float32 values per chunk + bits.
"""
from __future__ import annotations

import torch

from ..ops import cuda_kernels as _K
from ..ops.device import on_host
from ..options import Option, non_negative
from ..ops import cpu_kernels as _cpu
from ._quant import chunk_counts, chunks, padded_view
from .signsgd import _chunked
from .base import Compressor, as_bytes, from_bytes, register
from ..ops.bits import packed_bytes
from ..feedback.residual import compress_momentum


def _encode(x, codes_out, *, c: int):
    """Sign codes (1 iff x >= 0) to ``codes_out``; returns (mean of the negatives, mean of the
    non-negatives) per chunk of c coordinates, interleaved, float32."""
    x = x.to(torch.float32)
    n = x.numel()
    pos = torch.where(x >= 0, 1.0, 0.0)  # (bool -> uint8 is not vectorised)
    codes_out.copy_(pos.to(torch.uint8))
    v = _chunked(x, c)
    p = _chunked(pos, c)
    k = v.shape[0]
    counts = torch.full((k,), float(c), device=x.device)
    if k * c != n:
        counts = torch.cat([counts[:-1], torch.full((1,), float(n - (k - 1) * c), device=x.device)])
    npos = p.sum(1)
    sp = torch.where(p > 0, v, 0.0).sum(1)
    sn = v.sum(1) - sp
    vpos = sp / npos.clamp(min=1)
    vneg = sn / (counts - npos).clamp(min=1)
    return torch.stack([vneg, vpos], 1).reshape(-1)


def _decode_sum(out, codes_list, neg_list, pos_list, *, c: int):
    acc = None
    for codes, vneg, vpos in zip(codes_list, neg_list, pos_list):  # codes: whole chunks of c
        b = codes.to(torch.float32).view(-1, c)
        x = torch.where(b > 0.5, vpos.view(-1, 1), vneg.view(-1, 1)).reshape(-1)
        acc = x if acc is None else acc + x
    out.copy_(acc)


_ENCODE = _cpu.Kernel(_encode, "onebit encode")
_DECODE_SUM = _cpu.Kernel(_decode_sum, "onebit decode")


@register("onebit")
class OneBitCompressor(Compressor):
    collective = "allgather"
    default_feedback = "residual"
    options = {"bucket": Option(int, 1024, "integer >= 0 (0 = one pair per tensor)", non_negative,
                                help="coordinates per pair of reconstruction values")}

    def default_warmup(self, frozen_moment: bool) -> int:
        return 200 if frozen_moment else 0  # 1-bit Adam's warm-up: under Adam these diverged without it

    def bind_optimizer(self, optimizer):
        compress_momentum(self, optimizer, adam=False)  # before the feedback takes the momentum over
        super().bind_optimizer(optimizer)

    def compress(self, tensor, info):
        flat = tensor.reshape(-1).float()
        n = flat.numel()
        if n == 0:
            return torch.empty(0, dtype=torch.uint8, device=flat.device), None
        if on_host(flat):
            buf = _cpu.codes_buffer("onebit", n, flat.device)
            vals = _ENCODE(n, flat.device, flat, buf[:n], c=self.bucket if self.bucket > 0 else n)
            return as_bytes(vals, _cpu.pack_buffer(buf, n, 1)), None
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
        return self.aggregate([data], ctx, info)

    def aggregate(self, datas, ctx, info):
        """Sum of the ranks' reconstructions (fused on CPU: one write of the dense result)."""
        n = info.numel
        dev = datas[0].device if datas else None
        if n == 0:
            return torch.zeros(0, device=dev)
        c = chunks(n, self.bucket)
        parts = [from_bytes(d, 0, torch.float32, 2 * c) for d in datas]
        size = self.bucket if self.bucket > 0 else n
        if on_host(datas[0]):
            total = c * size  # whole chunks; the padding is dropped below
            codes = [_cpu.padded(_cpu.unpack_to_buffer(d[off:], 1, n, f"onebit/{r}"), total, f"onebit/pad{r}")
                     for r, (d, (_, off)) in enumerate(zip(datas, parts))]
            out = _cpu.empty(total, device=dev)
            _DECODE_SUM(n, dev, out, codes, [v[0::2].contiguous() for v, _ in parts],
                        [v[1::2].contiguous() for v, _ in parts], c=size)
            return out[:n]
        out = None
        for d, (vals, off) in zip(datas, parts):
            bits = _K.unpack_bits(d[off:], 1, n).long()
            chunk_of = torch.arange(n, device=d.device) // size
            dense = vals[2 * chunk_of + bits]
            out = dense if out is None else out.add_(dense)
        return out

    def wire_bytes(self, numel):
        return (8 * chunks(numel, self.bucket) + packed_bytes(numel, 1)) if numel else 0
