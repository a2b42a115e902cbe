"""Sparse gradients (``nn.Embedding(sparse=True)``) exchanged as indices + values.

As Horovod's sparse path (``horovod/torch/optimizer.py``, ``_sparse_allreduce_grad_async``):
every rank allgathers its coalesced (indices, values), the union is summed by
``coalesce()`` and scaled as the dense exchange would (1/N for ``op=Average``),
and the gradient is handed back sparse, so ``torch.optim.SparseAdam`` and SGD
keep working. Bytes per rank are proportional to the rows touched, not to the
embedding size. Values travel in the gradient's dtype (fp16 with the ``fp16``
codec). Collectives go through :class:`hvd_ext.exchange.Exchange` (one
allgather per sparse parameter, non-finite flag included).
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch


def encode(grad: Optional[torch.Tensor], shape: torch.Size, sparse_dim: int,
           value_dtype: Optional[torch.dtype]) -> Tuple[List[torch.Tensor], bool, torch.dtype]:
    """(uint8 payloads [indices, values], non-finite flag, dtype of the values on the wire)."""
    if grad is None:
        idx = torch.zeros(sparse_dim, 0, dtype=torch.int64)
        vals = torch.zeros((0,) + tuple(shape[sparse_dim:]))
    else:
        g = grad.coalesce()
        idx, vals = g.indices(), g.values()
    wire = value_dtype or vals.dtype
    vals = vals.to(wire).contiguous()
    head = torch.tensor([idx.shape[0], idx.shape[1]], dtype=torch.int64)
    payload_idx = torch.cat([head, idx.reshape(-1)]).view(torch.uint8)
    payload_val = vals.reshape(-1).view(torch.uint8) if vals.numel() else torch.zeros(0, dtype=torch.uint8)
    nonfinite = bool(vals.numel()) and not bool(torch.isfinite(vals).all())
    return [payload_idx, payload_val], nonfinite, wire


def decode(per_rank_idx: List[torch.Tensor], per_rank_val: List[torch.Tensor], shape: torch.Size,
           wire: torch.dtype, out_dtype: torch.dtype, scale: float) -> torch.Tensor:
    """Sum of every rank's sparse gradient times ``scale``, coalesced, in ``out_dtype``."""
    idxs, vals = [], []
    for bi, bv in zip(per_rank_idx, per_rank_val):
        a = bi.clone().view(torch.int64)
        sd, nnz = int(a[0]), int(a[1])
        idxs.append(a[2:2 + sd * nnz].reshape(sd, nnz))
        vals.append(bv.clone().view(wire).reshape((nnz,) + tuple(shape[sd:])).to(out_dtype))
    out = torch.sparse_coo_tensor(torch.cat(idxs, dim=1), torch.cat(vals, dim=0), size=shape).coalesce()
    return out * scale if scale != 1.0 else out


class SparseExchange:
    """Starts one allgather per sparse parameter (from its hook) and finishes them in ``finish``."""

    def __init__(self, exchange, value_dtype: Optional[torch.dtype] = None):
        self.exchange = exchange
        self.value_dtype = value_dtype
        self.pending: Dict[int, tuple] = {}

    @property
    def in_flight(self) -> bool:
        return bool(self.pending)

    def start(self, name: str, p: torch.Tensor, sparse_dim: int) -> None:
        g = p.grad if (p.grad is not None and p.grad.is_sparse) else (
            p.grad.to_sparse(sparse_dim) if p.grad is not None else None)
        payloads, nonfinite, wire = encode(g, p.shape, sparse_dim, self.value_dtype)
        pend = self.exchange.start_allgather(f"hvd_ext.sparse.{name}", payloads, nonfinite)
        self.pending[id(p)] = (p, pend, wire)

    def finish(self, params: List[Tuple[str, torch.Tensor, int]]) -> bool:
        """Start what was not started (no gradient this step: sends nothing), wait for all, write
        the sparse averages into ``p.grad``. Returns the global non-finite flag."""
        for name, p, sd in params:
            if id(p) not in self.pending:
                self.start(name, p, sd)
        nonfinite = False
        scale = self.exchange.scale()
        for name, p, sd in params:
            _, pend, wire = self.pending.pop(id(p))
            per_tensor, nf = self.exchange.finish_allgather(pend)
            nonfinite = nonfinite or nf
            p.grad = decode(per_tensor[0], per_tensor[1], p.shape, wire, p.dtype, scale)
        return nonfinite

    def reset(self) -> None:
        self.pending.clear()


class SparseGradients:
    """Which parameters have sparse gradients, and their exchange.

    Learnt at the first exchange (in each world): the hooks note which gradients arrive sparse,
    the ranks agree on the union (one allgather), and from then on those parameters leave the
    dense pipeline and travel as indices + values. With ``as_dense`` (``sparse_as_dense=True``,
    or Adasum) nothing is learnt: every gradient goes through the dense pipeline."""

    def __init__(self, exchange, params: List[Tuple[str, torch.Tensor]], value_dtype: Optional[torch.dtype],
                 as_dense: bool, requested_as_dense: bool, active: bool):
        self.exchange = SparseExchange(exchange, value_dtype)
        self.params = params                  # (name, param) of every trainable parameter
        self.as_dense = as_dense
        self.requested_as_dense = requested_as_dense  # the user's sparse_as_dense (configuration check)
        self.forget(learnt=not active or as_dense)

    def forget(self, learnt: Optional[bool] = None) -> None:
        """Drop the agreement (a new world learns it again) and anything in flight."""
        self.exchange.reset()
        self.agreed: List[Tuple[str, torch.Tensor, int]] = []   # (name, param, sparse_dim)
        self._dims: Dict[int, int] = {}
        self._seen: Dict[str, int] = {}
        self.learnt = self.as_dense if learnt is None else learnt

    @property
    def in_flight(self) -> bool:
        return self.exchange.in_flight

    def owns(self, p: torch.Tensor) -> bool:
        return id(p) in self._dims

    def saw(self, name: str, grad: Optional[torch.Tensor]) -> None:
        """A gradient arrived (a hook, or ``synchronize``): note it if it is sparse."""
        if not self.learnt and grad is not None and grad.is_sparse:
            self._seen[name] = grad.sparse_dim()

    def start(self, name: str, p: torch.Tensor) -> None:
        self.exchange.start(name, p, self._dims[id(p)])

    def finish(self) -> bool:
        """Wait for the sparse exchanges; the global non-finite flag."""
        return self.exchange.finish(self.agreed) if self.agreed else False

    def learn(self, allgather_object) -> bool:
        """Once per world, after its first exchange: agree on the union over ranks and hand this step's
        dense averages of those parameters back sparse. True when the dense pipeline must be rebuilt
        without them."""
        self.learnt = True
        seen = allgather_object(sorted(self._seen.items()), "hvd_ext.sparse.names")
        dims = {n: d for per_rank in seen for n, d in per_rank}
        if not dims:
            return False
        self.agreed = [(n, p, dims[n]) for n, p in self.params if n in dims]
        self._dims = {id(p): d for _, p, d in self.agreed}
        for _, p, d in self.agreed:
            if p.grad is not None and not p.grad.is_sparse:
                p.grad = p.grad.to_sparse(d)
        return True
