"""bfloat16 casting (PyTorch DDP ``bf16_compress_hook``): fp32's exponent range, 2 bytes per element."""
from __future__ import annotations

import torch

from .base import register
from .fp16 import CastCompressor


@register("bf16")
class BF16Compressor(CastCompressor):
    wire_dtype = torch.bfloat16
