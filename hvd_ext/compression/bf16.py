"""bfloat16 values on the wire (PyTorch DDP ``bf16_compress_hook``): fp32's exponent range, 2 bytes per element.

Horovod 0.28's torch collectives have no bfloat16 type ("Tensor type
torch.BFloat16Tensor is not supported", CPU and CUDA alike), so unlike ``fp16``
this codec cannot ride on allreduce: each rank sends its gradient rounded to
bfloat16 as raw bytes (allgather), and the receivers sum the ranks' values in
float32 (more accurate than a bfloat16 ring sum).

Wire bytes (allgather, fixed size): ``2 * n``.
"""
from __future__ import annotations

import torch

from ._fast import sum_float32
from .base import Compressor, as_bytes, from_bytes, register


@register("bf16")
class BF16Compressor(Compressor):
    lossless = True
    exchange = "allgather"
    wire_dtype = torch.bfloat16

    def compress(self, tensor, info):
        return as_bytes(tensor.reshape(-1).to(torch.bfloat16)), None

    def decode(self, data, ctx, info):
        vals, _ = from_bytes(data, 0, torch.bfloat16, info.numel)
        return vals.float()

    def aggregate(self, datas, ctx, info):
        """The ranks' bfloat16 values summed in float32 in one pass over memory (``sum_float32``)."""
        return sum_float32([from_bytes(d, 0, torch.bfloat16, info.numel)[0] for d in datas])

    def wire_bytes(self, numel):
        return 2 * numel
