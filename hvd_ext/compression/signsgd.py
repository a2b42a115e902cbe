"""signSGD with majority vote (Bernstein et al. 2018, "signSGD: Compressed Optimisation for
Non-Convex Problems"; Bernstein et al. 2019, "signSGD with Majority Vote is Communication
Efficient and Fault Tolerant").

Each rank sends one sign bit per coordinate (bit 1 for ``g_i >= 0``, 0 for
``g_i < 0``), exchanged by allgather; every rank then votes: the applied
update is ``sign(sum_r sign_r)`` (0 on ties). ``aggregate`` returns
``N * vote`` so that the exchange's averaging (1/N) yields exactly the vote.
No error feedback by default (the paper has none); with momentum use ``signum``.

Wire bytes (allgather, fixed size): ``ceil(n / 8)``.

Kernels (``hvd_ext.kernels``): the bits are made by ``kernels.sign_pack`` (same
convention: bit 1 iff ``x >= 0``, NaN -> 0) and read by ``kernels.unpack_bits``;
on CUDA the vote is ``kernels.majority_vote`` (tie -> +1 there, so for an even
number of ranks the vote of the complemented bits is subtracted to get this
module's tie -> 0 exactly). CPU / forced reference: the torch code below.
"""
from __future__ import annotations

import torch

from .. import kernels as _K
from . import _quant
from .base import Compressor, register
from .bitpack import packed_bytes


def sign_bits(flat: torch.Tensor) -> torch.Tensor:
    """ceil(n/8) bytes, bit 1 where ``flat >= 0`` (kernel on CUDA float32, else bitpack)."""
    return _K.sign_pack(flat)


def bits_to_sign(data: torch.Tensor, n: int) -> torch.Tensor:
    return _K.unpack_bits(data, 1, n).float() * 2 - 1


def vote_sum(datas, n: int) -> torch.Tensor:
    """``sign(sum_r (2 bit_r - 1)) * N`` (0 on ties), float32, from N ``sign_bits`` payloads."""
    N = len(datas)
    if N and all(d.dtype == torch.uint8 for d in datas) and _K.backend(*datas) == "cuda":
        mv = _K.majority_vote(datas, n)                 # +1 where 2*ones >= N, else -1
        if N % 2 == 0:                                   # ties possible: make them 0
            mv = mv.sub_(_K.majority_vote([torch.bitwise_not(d) for d in datas], n)).mul_(0.5)
        return mv.mul_(N)
    votes = None
    for d in datas:
        s = bits_to_sign(d, n)
        votes = s if votes is None else votes.add_(s)
    return torch.sign(votes).mul_(N)


class MajorityVote(Compressor):
    """Sign bits out, majority vote in."""

    exchange = "allgather"
    owner_feedback = False  # the owner's vote is already a sign: nothing to remember

    def _vector(self, tensor, info):
        return tensor.reshape(-1).float()

    def recompress(self, tensor, info):
        """Two-phase exchange: the owner re-sends its shard's vote as plain signs; a tied vote (0)
        becomes a seeded fair coin, so the shard stays unbiased where one bit cannot say 0."""
        v = tensor.reshape(-1).float()
        ties = v == 0
        if bool(ties.any()):
            coin = torch.rand(v.numel(), generator=_quant.generator(0, info.step, info.name, info.rank)) < 0.5
            v = torch.where(ties, torch.where(coin.to(v.device), 1.0, -1.0), v)
        return sign_bits(v), None

    def compress(self, tensor, info):
        return sign_bits(self._vector(tensor, info)), None

    def decode(self, data, ctx, info):
        return bits_to_sign(data, info.numel)

    def aggregate(self, datas, ctx, info):
        return vote_sum(datas, info.numel)

    def wire_bytes(self, numel):
        return packed_bytes(numel, 1)


@register("signsgd")
class SignSGDCompressor(MajorityVote):
    pass
