"""Random-k sparsification (Stich et al. 2018, "Sparsified SGD with memory"; GRACE ``randomk``).

Each step sends k = ceil(ratio * n) coordinates chosen uniformly without
replacement; the rest stays in the residual feedback memory (default
``feedback=residual``). Indices come from a counter-based seed
(seed, step, tensor name[, rank]) so nothing random is kept as state and a
resumed run draws the same indices.

Defaults that converge in an ordinary loop (``benchmarks/defaults_check.py``). A
coordinate waits ~1/ratio steps in memory and then arrives as one burst; the
optimizer's momentum applied to those bursts diverges under SGD and stalls Adam's
first moment. So, as in 1-bit Adam (Tang et al. 2021), the momentum is compressed
instead (``hvd_ext.feedback.residual.compress_momentum``: SGD's momentum, or
Adam/AdamW/RAdam's first moment, taken over; ``velocity=exchanged``), Adam's second
moment is frozen after 10 dense exchanges, and the default ratio is 0.1: far below
it SGD converges slowly, hence the warning below 5% under SGD.

* ``shared=0`` (default): each rank draws its own indices; payload = k int32
  indices + k float32 values = 8k bytes, exchanged by allgather.
* ``shared=1``: all ranks draw the same indices, so the k values are summed by
  allreduce (4k bytes) and nothing else is sent.
"""
from __future__ import annotations

import math
import warnings
import zlib

import torch

from ..ops import cuda_kernels as _K
from ..ops.device import in_range
from ..feedback.residual import compress_momentum
from ..options import Option, fraction, non_negative
from .base import Compressor, as_bytes, from_bytes, register


def _generator(seed: int, step: int, name: str, rank: int) -> torch.Generator:
    g = torch.Generator()
    key = (seed * 1_000_003 + step) * 1_000_033 + zlib.crc32(name.encode()) * 8191 + rank
    g.manual_seed(key & 0x7FFF_FFFF_FFFF_FFFF)
    return g


def count_for(ratio: float, numel: int) -> int:
    return min(numel, max(1, math.ceil(ratio * numel))) if numel else 0


@register("randomk")
class RandomKCompressor(Compressor):
    collective = "allgather"
    sparse = True
    default_feedback = "residual"
    options = {
        "ratio": Option(float, 0.1, "0 < ratio <= 1", fraction, help="fraction of coordinates sent"),
        "shared": Option(bool, False, "0 or 1", help="same indices on every rank (rides on allreduce)"),
        "seed": Option(int, 0, "integer >= 0", non_negative),
    }

    def default_warmup(self, frozen_moment: bool) -> int:
        return 10 if frozen_moment else 0  # Adam: second moment from 10 dense exchanges, then frozen (module docstring)

    def validate(self) -> None:
        if self.shared:  # same indices on every rank: the payloads sum, so they ride on allreduce
            self.collective = "allreduce"  # instance attribute: the route is chosen from it

    def indices(self, info, device=None) -> torch.Tensor:
        """k indices drawn without replacement from (seed, step, name[, rank]): on the host the first k
        of a seeded ``randperm``; on a device the k largest of a counter hash of every index (drawn
        there: no permutation to copy over)."""
        n = info.numel
        k = count_for(self.ratio, n)
        rank = 0 if self.shared else info.rank
        if device is None or torch.device(device).type == "cpu":
            g = _generator(self.seed, info.step, info.name, rank)
            return torch.randperm(n, generator=g)[:k].sort().values
        key = _K.stream_key(_K.derive_seed(self.seed, info.name, rank), info.step)
        h = _K.hash_u32(key, torch.arange(n, device=device), n <= 2 ** 32)
        return torch.topk(h, k, sorted=False).indices.sort().values

    def bind_optimizer(self, optimizer):
        compress_momentum(self, optimizer, adam=True)  # before the feedback takes the momentum over
        if self.ratio < 0.05 and (isinstance(optimizer, torch.optim.SGD) or self.feedback is None
                                  or self.feedback.name != "residual"):
            warnings.warn(
                f"hvd_ext randomk: random-k at ratio={self.ratio} converges slowly in an ordinary training loop "
                "(benchmarks/defaults_check.py): with memory each coordinate waits ~1/ratio steps "
                "(Stich et al. 2018). For the same bytes use compression='topk:ratio="
                f"{self.ratio}', or keep randomk's default ratio=0.1.", stacklevel=3)
        super().bind_optimizer(optimizer)

    def compress(self, tensor, info):
        flat = tensor.reshape(-1).float()
        idx = self.indices(info, flat.device)
        values = flat[idx]
        if self.shared:
            return values, idx
        return as_bytes(idx.to(torch.int32).to(flat.device), values), None

    # shared=1: allreduce path
    def decompress(self, payload, ctx, info):
        out = torch.zeros(info.numel, dtype=payload.dtype, device=payload.device)
        out[ctx.to(payload.device)] = payload
        return out.reshape(info.shape)

    # shared=0: allgather path
    def _split(self, data, n):
        k = data.numel() // 8
        idx, off = from_bytes(data, 0, torch.int32, k)
        val, _ = from_bytes(data, off, torch.float32, k)
        idx = in_range(idx.long(), n, "randomk") if k else idx.long()
        return idx, val

    def sparse_entries(self, payload, ctx, info):
        return self._split(payload, info.numel)

    def decode(self, data, ctx, info):
        idx, val = self._split(data, info.numel)
        out = torch.zeros(info.numel, dtype=torch.float32, device=data.device)
        out[idx] = val
        return out

    def aggregate(self, datas, ctx, info):
        # CUDA: one kernels.sparse_scatter_add launch for all ranks; else index_add_ per rank in order
        out = torch.zeros(info.numel, dtype=torch.float32, device=datas[0].device)
        pairs = [self._split(d, info.numel) for d in datas]
        return _K.sparse_scatter_add(out, [i for i, _ in pairs], [v for _, v in pairs], 1.0)

    def local_contribution(self, payload, ctx, info, result):
        if self.shared:
            return self.decompress(payload, ctx, info).reshape(-1)
        return self.decode(payload, ctx, info)

    def wire_bytes(self, numel):
        k = count_for(self.ratio, numel)
        return 4 * k if self.shared else 8 * k
