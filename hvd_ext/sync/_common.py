"""Shared pieces of the sync strategies: flat parameter/state vectors, the fused parameter
allreduce (one Horovod collective on one flat buffer), argument checks and stats plumbing."""
from __future__ import annotations

from typing import Any, Dict, List, Tuple

import torch

from ..exchange import Exchange
from ..stats import CommStats


def is_distributed_optimizer(optimizer) -> bool:
    return callable(getattr(optimizer, "set_gradient_exchange", None))


def check_optimizer_model(owner: str, optimizer, model) -> None:
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ValueError(f"{owner}: optimizer must be a torch.optim.Optimizer (plain or hvd_ext.DistributedOptimizer), "
                         f"got {type(optimizer).__name__}")
    if not isinstance(model, torch.nn.Module):
        raise ValueError(f"{owner}: model must be a torch.nn.Module, got {type(model).__name__}")


class FlatState:
    """The tensors a strategy averages, in a fixed order every rank agrees on:
    the model's floating-point parameters, optionally its floating-point buffers
    (BatchNorm statistics) and optionally the optimizer's per-parameter floating
    state tensors of the parameter's shape (SGD momentum, Adam moments)."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, buffers: bool, momentum: bool):
        self.model = model
        self.optimizer = optimizer
        self.params: List[torch.Tensor] = [p for p in model.parameters() if p.is_floating_point()]
        self.buffers: List[torch.Tensor] = ([b for b in model.buffers() if b.is_floating_point()]
                                            if buffers else [])
        self.momentum = momentum

    def momentum_tensors(self) -> List[torch.Tensor]:
        if not self.momentum:
            return []
        out = []
        for p in self.params:
            st = self.optimizer.state.get(p, {})
            for key in sorted(st):
                v = st[key]
                if torch.is_tensor(v) and v.is_floating_point() and v.shape == p.shape:
                    out.append(v)
        return out

    def params_vector(self, dtype=torch.float64) -> torch.Tensor:
        with torch.no_grad():
            return torch.cat([p.detach().reshape(-1).to(dtype) for p in self.params])

    def set_params_vector(self, vec: torch.Tensor) -> None:
        with torch.no_grad():
            off = 0
            for p in self.params:
                n = p.numel()
                p.copy_(vec[off:off + n].view_as(p).to(p.dtype))
                off += n


_EXCHANGES: Dict[Any, Exchange] = {}


def exchange_for(process_set=None, optimizer=None) -> Exchange:
    """The Exchange the strategies' collectives go through: the DistributedOptimizer's own
    (so its stats count them) or one per process set around a plain torch optimizer."""
    ex = getattr(optimizer, "exchange", None) if optimizer is not None else None
    if isinstance(ex, Exchange):
        return ex
    import horovod.torch as hvd

    ps = hvd.global_process_set if process_set is None else process_set
    key = id(ps)
    if key not in _EXCHANGES:
        _EXCHANGES[key] = Exchange(op="average", process_set=ps)
    return _EXCHANGES[key]


def allreduce_average(tensors: List[torch.Tensor], name: str, process_set=None, exchange=None) -> Tuple[int, float]:
    """Average ``tensors`` in place over the ranks with ONE fused allreduce per dtype
    (all tensors concatenated into one flat buffer). Returns (payload bytes, seconds)."""
    ex = exchange if exchange is not None else exchange_for(process_set)
    return ex.allreduce_average(tensors, name)


def allreduce_scalar_mean(value: float, name: str, process_set=None, exchange=None) -> float:
    ex = exchange if exchange is not None else exchange_for(process_set)
    return ex.allreduce_scalar(value, name, op="average")


def stats_for(optimizer) -> CommStats:
    """Record into the DistributedOptimizer's stats (so its summary counts parameter exchanges),
    or into a fresh CommStats around a plain torch optimizer."""
    st = getattr(optimizer, "stats", None)
    return st if isinstance(st, CommStats) else CommStats()


def model_buffers(model: torch.nn.Module) -> List[torch.Tensor]:
    """The model's floating-point buffers (BatchNorm running mean/var), in registration order."""
    return [b for b in model.buffers() if b.is_floating_point()]


def buffer_spread(model: torch.nn.Module, process_set=None, exchange=None) -> float:
    """Collective: max over ranks and elements of |b_rank - b_mean| / (max |b_mean| + 1e-12), the
    relative disagreement of the floating-point buffers across ranks (0.0 when identical or
    when the model has none). Every rank gets the same value."""
    bufs = model_buffers(model)
    if not bufs:
        return 0.0
    ex = exchange if exchange is not None else exchange_for(process_set)
    local = torch.cat([b.detach().reshape(-1).double() for b in bufs])
    mean = local.clone()
    ex.allreduce_average([mean], "hvd_ext.sync.buffer_spread.mean")
    mine = float((local - mean).abs().max()) / (float(mean.abs().max()) + 1e-12)
    return float(max(ex.allgather_object(mine, "hvd_ext.sync.buffer_spread")))


def average_buffers(model: torch.nn.Module, process_set=None, exchange=None) -> int:
    """Collective: average the model's floating-point buffers (BatchNorm running statistics)
    over the ranks in place with one fused allreduce; returns the payload bytes.

    Horovod averages gradients only, so with BatchNorm each rank's running statistics follow
    its own batches and drift apart (far apart on non-IID shards). Averaging them before an
    evaluation or a checkpoint gives every rank the same model; the mean of the per-rank
    running means is the running mean over all ranks' batches, and the mean of the running
    variances is the pooled within-batch variance (what SyncBatchNorm would track, up to the
    between-rank spread of the means)."""
    bufs = model_buffers(model)
    if not bufs:
        return 0
    ex = exchange if exchange is not None else exchange_for(process_set)
    nbytes, _ = ex.allreduce_average(bufs, "hvd_ext.sync.buffers")
    return nbytes
