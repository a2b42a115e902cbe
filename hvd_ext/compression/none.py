"""No compression: the dense gradient rides on Horovod's allreduce (Horovod ``Compression.none``)."""
from __future__ import annotations

import torch

from .base import Compressor, register


@register("none")
class NoneCompressor(Compressor):
    lossless = True
    elementwise = True
    transient_results = True
    collective = "allreduce"
    wire_dtype = torch.float32
    shardable = True

    def compress(self, tensor, info):
        return tensor.reshape(-1), None

    def decompress(self, payload, ctx, info):
        return payload.reshape(info.shape)

    def wire_bytes(self, numel):
        return 4 * numel
