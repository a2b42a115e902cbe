"""``broadcast_parameters`` and ``broadcast_optimizer_state``: Horovod's, for every dtype.

Horovod's own (``hvd.broadcast_parameters``, ``hvd.broadcast_optimizer_state``) raise on a
bfloat16 model (``Tensor type torch.BFloat16Tensor is not supported``, horovod#4047), so the first
line of every Horovod recipe fails for it. These take the same arguments and do the same: rank
``root_rank``'s values, in place, on every rank. A tensor of a dtype Horovod cannot broadcast
(bfloat16, bool, complex, float8) travels as its bytes (:meth:`hvd_ext.exchange.core.Exchange.broadcast_`),
so it arrives bit-exact.

``broadcast_optimizer_state`` broadcasts the torch optimizer's state and its param-group options
(learning rate, momentum, ...). Rank ``root_rank`` first sends the state's layout (which parameter
has which entry, each tensor's shape and dtype; scalars by value); a rank without state (a fresh
optimizer) creates the entries from it, so no zero-gradient step is needed. hvd_ext's own state
(error-feedback memories, the compressor's counters) is not touched: the optimizer agrees on it
before its first exchange, and residual memories are per rank by design.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch

from .exchange.core import Exchange


def _exchange(process_set) -> Exchange:
    return Exchange(process_set=process_set)


def _named(params) -> List[tuple]:
    if isinstance(params, dict):
        return sorted(params.items())
    if isinstance(params, (list, tuple)) or hasattr(params, "__iter__") and not isinstance(params, torch.Tensor):
        return [p if isinstance(p, tuple) else (None, p) for p in params]
    raise ValueError(f"broadcast_parameters: invalid params of type {type(params).__name__}; accepted: a dict "
                     "(model.state_dict()), or a list of tensors or of (name, tensor) pairs "
                     "(model.parameters(), model.named_parameters())")


def broadcast_parameters(params, root_rank: int, process_set=None) -> None:
    """Every rank's ``params`` take rank ``root_rank``'s values, in place (``model.state_dict()``,
    ``model.named_parameters()`` or ``model.parameters()``), whatever their dtype."""
    named = _named(params)
    tensors = []
    for name, p in named:
        if not isinstance(p, torch.Tensor):
            raise ValueError(f"broadcast_parameters: {name or 'an entry'} is a {type(p).__name__}, not a tensor")
        tensors.append(p.detach())
    with torch.no_grad():
        _exchange(process_set).broadcast_(tensors, root_rank, "hvd_ext.broadcast_parameters")


def _layout(optimizer) -> Dict[str, Any]:
    """The optimizer's param-group options and state entries, tensors by shape and dtype only."""
    groups, state = [], []
    for gi, group in enumerate(optimizer.param_groups):
        groups.append({k: v for k, v in group.items() if k != "params"})
        for pi, p in enumerate(group["params"]):
            for key, v in sorted(optimizer.state.get(p, {}).items()):
                if isinstance(v, torch.Tensor):
                    state.append((gi, pi, key, ("tensor", tuple(v.shape), str(v.dtype), v.device.type)))
                else:
                    state.append((gi, pi, key, ("value", v)))
    return {"groups": groups, "state": state}


def broadcast_optimizer_state(optimizer, root_rank: int, model=None, process_set=None) -> None:
    """Every rank's ``optimizer`` (a torch optimizer, or hvd_ext's / Horovod's DistributedOptimizer)
    takes rank ``root_rank``'s state and param-group options, in place. ``model`` is accepted for
    Horovod's signature (it marks sparse parameters there); it is not needed here."""
    if isinstance(optimizer, torch.optim.LBFGS):
        raise ValueError("broadcast_optimizer_state: cannot broadcast torch.optim.LBFGS state (its state is "
                         "nested history); accepted: optimizers whose state is tensors and scalars per parameter")
    ex = _exchange(process_set)
    layout = ex.broadcast_object(_layout(optimizer) if ex.rank == root_rank else None, root_rank,
                                 "hvd_ext.broadcast_optimizer_state.layout")
    if len(layout["groups"]) != len(optimizer.param_groups):
        raise ValueError(f"broadcast_optimizer_state: rank {root_rank} has {len(layout['groups'])} param groups, "
                         f"this rank {len(optimizer.param_groups)}; every rank must build the same optimizer")
    for group, opts in zip(optimizer.param_groups, layout["groups"]):
        group.update(opts)
    tensors = []
    for gi, pi, key, (kind, *rest) in layout["state"]:
        p = optimizer.param_groups[gi]["params"][pi]
        st = optimizer.state.setdefault(p, {})
        if kind == "value":
            st[key] = rest[0]
            continue
        shape, dtype, dev = rest
        dtype = getattr(torch, dtype.split(".")[-1])
        device = p.device if dev != "cpu" else torch.device("cpu")  # e.g. Adam's step lives on the host
        cur: Optional[torch.Tensor] = st.get(key)
        if not (isinstance(cur, torch.Tensor) and tuple(cur.shape) == shape and cur.dtype == dtype
                and cur.device == device and cur.is_contiguous()):
            st[key] = cur = torch.empty(shape, dtype=dtype, device=device)
        tensors.append(cur)
    with torch.no_grad():
        ex.broadcast_(tensors, root_rank, "hvd_ext.broadcast_optimizer_state")
