"""bfloat16 values on the wire (PyTorch DDP ``bf16_compress_hook``): fp32's exponent range, 2 bytes per element.

Floating gradients are cast to bfloat16 and summed as an allreduce. Horovod 0.28's torch
collectives have no bfloat16 type ("Tensor type torch.BFloat16Tensor is not supported", CPU and
CUDA alike), so ``hvd_ext.exchange.Exchange`` carries the bits as int16 and sums the ranks' values
in float32 itself (one allgather at 2 ranks; alltoall reduce-scatter plus allgather beyond: the
ring's bytes), rounding the sum back to bfloat16 as DDP's hook does.

Wire bytes: ``2 * n``.
"""
from __future__ import annotations

import torch

from .base import register
from .fp16 import CastCompressor


@register("bf16")
class BF16Compressor(CastCompressor):
    wire_dtype = torch.bfloat16
