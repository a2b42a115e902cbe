"""Half-precision casting (Horovod ``Compression.fp16``; PyTorch DDP ``fp16_compress_hook``).

Floating tensors are cast to float16 for the allreduce and back afterwards:
2 bytes per element on the wire. Linear, so it rides on allreduce.
"""
from __future__ import annotations

import torch

from .base import Compressor, register


class CastCompressor(Compressor):
    lossless = True
    """Cast floating gradients to ``wire_dtype`` for the allreduce, back after it."""

    exchange = "allreduce"
    wire_dtype = torch.float16

    def compress(self, tensor, info):
        flat = tensor.reshape(-1)
        if flat.is_floating_point():
            return flat.to(self.wire_dtype), flat.dtype
        return flat, flat.dtype

    def decompress(self, payload, ctx, info):
        return payload.to(ctx).reshape(info.shape)

    def wire_bytes(self, numel):
        return torch.empty(0, dtype=self.wire_dtype).element_size() * numel


@register("fp16")
class FP16Compressor(CastCompressor):
    wire_dtype = torch.float16
