"""signSGD with majority vote (Bernstein et al. 2018, "signSGD: Compressed Optimisation for
Non-Convex Problems"; Bernstein et al. 2019, "signSGD with Majority Vote is Communication
Efficient and Fault Tolerant").

Each rank sends one sign bit per coordinate (bit 1 for ``g_i >= 0``, 0 for
``g_i < 0``), exchanged by allgather; every rank then votes: the applied
update is ``sign(sum_r sign_r)`` (0 on ties). ``aggregate`` returns
``N * vote`` so that the exchange's averaging (1/N) yields exactly the vote.
No error feedback by default (the paper has none); with momentum use ``signum``.

Wire bytes (allgather, fixed size): ``ceil(n / 8)``.
"""
from __future__ import annotations

import torch

from .base import Compressor, register
from .bitpack import pack_bits, packed_bytes, unpack_bits


def sign_bits(flat: torch.Tensor) -> torch.Tensor:
    return pack_bits((flat >= 0).to(torch.uint8), 1, check=False)


def bits_to_sign(data: torch.Tensor, n: int) -> torch.Tensor:
    return unpack_bits(data, 1, n).float() * 2 - 1


class MajorityVote(Compressor):
    """Sign bits out, majority vote in."""

    exchange = "allgather"

    def _vector(self, tensor, info):
        return tensor.reshape(-1).float()

    def compress(self, tensor, info):
        return sign_bits(self._vector(tensor, info)), None

    def decode(self, data, ctx, info):
        return bits_to_sign(data, info.numel)

    def aggregate(self, datas, ctx, info):
        votes = None
        for d in datas:
            s = bits_to_sign(d, info.numel)
            votes = s if votes is None else votes.add_(s)
        return torch.sign(votes).mul_(len(datas))

    def wire_bytes(self, numel):
        return packed_bytes(numel, 1)


@register("signsgd")
class SignSGDCompressor(MajorityVote):
    pass
