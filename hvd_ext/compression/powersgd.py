"""PowerSGD (Vogels et al. 2019, "PowerSGD: Practical Low-Rank Gradient Compression for
Distributed Optimization"; as PyTorch DDP's ``powerSGD_hook``).

A gradient of shape (n, ...) is viewed as the matrix M (n x m, m = numel / n)
of the error-compensated gradient. One power-iteration step with warm start:

    P = M Q            allreduce-average P, orthonormalize its columns (QR)
    Q = M^T P          allreduce-average Q
    approx = P Q^T     (the same on every rank)

Q is kept per tensor between steps (warm start, ``warm_start=1``) and saved in
``state_dict`` so a checkpoint resumes exactly; the first Q is drawn from a
generator seeded by (seed, crc32(name)) -- identical on every rank. Error
feedback (``feedback=residual``, the default) keeps ``e_i = M_i - approx``
(``local_contribution`` returns the ranks' mean approximation, as DDP does; with
``op=Sum`` or pre/postscale factors the exchanged result is divided back), so
sum over ranks of memory + N * applied update = sum of the ranks' inputs.

Tensors with fewer than 2 dimensions, and matrices where low rank does not save at
least a factor ``min_compression`` (``n * m < min_compression * (n + m) * r``),
are sent uncompressed (dense, original dtype) in the first round; so are all
tensors during the dense warm-up, ``warmup=`` exchanges (DDP's ``start_powerSGD_iter``;
the old key ``start_step`` still spells it).
Effective rank ``r = min(rank, n, m)``.

Defaults ``rank=4, warmup=100``: Vogels et al. use rank 2-4 (rank 4 for their
language model) and DDP's hook runs dense for its first ``start_powerSGD_iter``
steps (default 1000; "about 10% of training"). In an ordinary loop a lower rank, or
no dense warm-up, converges clearly slower (``benchmarks/defaults_check.py``).

Wire bytes (allreduce, two rounds, float32): ``4 * (n + m) * r`` for a compressed
tensor, ``itemsize * numel`` otherwise (see ``wire_bytes_for(shape)``).
"""
from __future__ import annotations

import zlib

import torch

from ..options import Option, non_negative, positive
from ..ops.device import upload_tensor
from .base import Compressor, Continue, register


@register("powersgd")
class PowerSGDCompressor(Compressor):
    collective = "allreduce"
    default_feedback = "residual"
    options = {
        "rank": Option(int, 4, "integer >= 1", positive),
        "min_compression": Option(float, 2.0, "min_compression >= 1", lambda v: v >= 1),
        "warm_start": Option(bool, True, "0 or 1"),
        "seed": Option(int, 0, "integer >= 0", non_negative),
    }

    aliases = {"start_step": "warmup"}

    def default_warmup(self, frozen_moment: bool) -> int:
        return 100  # DDP's start_powerSGD_iter warm-up (module docstring)

    def __init__(self, **kw):
        super().__init__(**kw)
        self.q_memory = {}
        self._staged_q = {}  # this step's Q, the warm start from the next step on (commit)
        self._q0 = {}

    # ---- shape decisions (identical on every rank: shapes and step only) ----------------
    def matrix_shape(self, shape):
        if len(shape) < 2:
            return None
        n = int(shape[0])
        numel = 1
        for s in shape:
            numel *= int(s)
        if n == 0 or numel == 0:
            return None
        m = numel // n
        r = min(self.rank, n, m)
        if numel < self.min_compression * (n + m) * r:
            return None
        return n, m, r

    def wire_bytes_for(self, shape, itemsize: int = 4) -> int:
        ms = self.matrix_shape(torch.Size(shape))
        if ms is None:
            numel = 1
            for s in shape:
                numel *= int(s)
            return itemsize * numel
        n, m, r = ms
        return 4 * (n + m) * r

    def own_warmup(self) -> int:
        return self.warmup_length()

    def compressed_shape(self, info):
        """(n, m, r) of the low-rank exchange of ``info``'s tensor at its step, or None (sent dense)."""
        return self.matrix_shape(info.shape) if info.step >= self.warmup_length() else None

    def rounds(self, info):
        return 1 if self.compressed_shape(info) is None else 2  # P, then Q

    def round_bytes(self, info):
        ms = self.compressed_shape(info)
        return None if ms is None else [4 * ms[0] * ms[2], 4 * ms[1] * ms[2]]  # float32 P (n x r), Q (m x r)

    def wire_bytes(self, numel):
        return None  # depends on the shape: use wire_bytes_for(shape)

    def _initial_q(self, name, m, r, device):
        """The first Q of a tensor: drawn on the host from (seed, name) -- the same on every rank --
        and copied to the device once, without waiting (kept for later cold starts)."""
        key = (name, m, r, str(device))
        q = self._q0.get(key)
        if q is None:
            g = torch.Generator()
            g.manual_seed((self.seed * 1_000_003 + zlib.crc32(name.encode())) & 0x7FFF_FFFF_FFFF_FFFF)
            q = self._q0[key] = upload_tensor(torch.randn(m, r, generator=g), device)
        return q

    # ---- codec ----------------------------------------------------------------------------------
    def compress(self, tensor, info):
        ms = self.compressed_shape(info)
        if ms is None:
            return tensor.reshape(-1), ("dense",)
        n, m, r = ms
        M = tensor.reshape(n, m).float()
        q = self.q_memory.get(info.name) if self.warm_start else None
        if q is None or q.shape != (m, r):
            q = self._initial_q(info.name, m, r, M.device)
        q = q.to(M.device)
        P = M @ q
        return P.reshape(-1), ("P", M, tensor.dtype, q)

    def decompress(self, payload, ctx, info):
        kind = ctx[0]
        if kind == "dense":
            return payload.reshape(info.shape)
        if kind == "P":
            _, M, dtype, q = ctx
            P = payload.reshape(M.shape[0], -1)
            P = torch.nan_to_num(P)  # a NaN/Inf step is skipped; the QR must not fail on it
            P = torch.linalg.qr(P, mode="reduced").Q
            Q = M.t() @ P
            return Continue(Q.reshape(-1), ("Q", P, dtype, q))
        _, P, dtype, q = ctx
        Q = payload.reshape(-1, P.shape[1])
        # the warm start keeps the last finite Q (decided on the device: no read), from the step's end
        # on: staged until the pipeline commits a finite step (a trial coding of auto's is discarded)
        self._staged_q[info.name] = torch.where(torch.isfinite(Q).all(), Q, q.to(Q.dtype)).detach().clone()
        return (P @ Q.t()).to(dtype).reshape(info.shape)

    def local_contribution(self, payload, ctx, info, result):
        if ctx[0] == "dense":
            return payload.reshape(info.shape)
        # result = scale * sum over ranks of the approximation; this rank's share is the mean
        f = info.scale
        if f and info.size:
            k = f * info.size
            return result if k == 1 else result / k
        return result

    # ---- state -----------------------------------------------------------------------------------
    def commit(self) -> None:
        self.q_memory.update(self._staged_q)
        self._staged_q = {}

    def discard(self) -> None:
        self._staged_q = {}

    def state_dict(self):
        return {"q_memory": {k: v.clone() for k, v in self.q_memory.items()}}

    def load_state_dict(self, state):
        self.q_memory = {k: v.clone() for k, v in state.get("q_memory", {}).items()}
        self._staged_q = {}
