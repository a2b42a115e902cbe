"""``TorchDistTransport``: the exchange's collectives over ``torch.distributed`` (gloo on CPU, NCCL on
GPUs) instead of Horovod, behind the same seam (:class:`hvd_ext.exchange.transport.Transport`).

Every collective starts with ``async_op=True`` and returns a handle that ``wait`` completes, so the
routes overlap communication as they do under Horovod:

* ``allreduce_async`` -- ``all_reduce`` (SUM; ``average`` divides after, as gloo has no AVG);
* ``allgather_async`` -- tensors of different lengths: the lengths first (one small
  ``all_gather``, waited for), then ``all_gather`` of the tensors padded to the longest
  (``allgather_equal_async``: equal lengths, known to every rank: one ``all_gather_into_tensor``);
* ``alltoall_async`` -- the split sizes first (one small ``all_to_all_single``, waited for: every
  rank then knows what it receives), then ``all_to_all_single`` with those splits;
* ``broadcast_async`` -- ``broadcast`` in place.

Pure data movement (gather, all-to-all, broadcast) carries any dtype as its bytes, so bfloat16 and
float8 travel as they do over Horovod (as int16 / uint8 of the same bits). ``group``: a
``torch.distributed`` process group (default: the whole world). Node groups for the node-aware
route are made as under Horovod's default (:class:`GroupTransport` over this transport's
all-to-all); the node layout comes from the ranks' host names.
"""
from __future__ import annotations

import socket
from typing import Any, Optional, Tuple

import torch

from .transport import _NODE_GROUPS, GroupTransport, NodeGroupsUnavailable, Topology, Transport, layout_sets

# dtypes gloo and NCCL move and sum natively; everything else moves as bytes
_NATIVE = (torch.uint8, torch.int8, torch.int32, torch.int64, torch.float16, torch.float32, torch.float64)


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype in _NATIVE else t.reshape(-1).view(torch.uint8)


def _wire(flat: torch.Tensor) -> Tuple[torch.Tensor, int]:
    """A 1-D tensor as the collective carries it, and how many wire elements one element takes."""
    if flat.dtype in _NATIVE:
        return flat, 1
    return flat.view(torch.uint8), flat.element_size()


class TorchDistTransport(Transport):
    """The exchange's collectives on a ``torch.distributed`` process group (see module doc)."""

    measurable = True

    def __init__(self, group=None):
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("TorchDistTransport needs torch.distributed initialised: call "
                               "torch.distributed.init_process_group(...) first (torchrun sets the environment)")
        self.dist = dist
        self.group = group
        self.process_set = group  # the key node groups and measured links are kept under
        self._topology: Optional[Topology] = None

    def rank(self) -> int:
        return self.dist.get_rank(self.group)

    def size(self) -> int:
        return self.dist.get_world_size(self.group)

    def _device(self) -> torch.device:
        backend = self.dist.get_backend(self.group)
        if backend == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    # ---- topology ------------------------------------------------------------------------------
    def topology(self) -> Optional[Topology]:
        if self.group is not None:
            return None  # a subgroup need not fill whole nodes: flat
        if self._topology is None:
            hosts = self.allgather_object(socket.gethostname(), "hvd_ext.torch.hosts")
            nodes = list(dict.fromkeys(hosts))
            me = self.rank()
            local = [r for r, h in enumerate(hosts) if h == hosts[me]]
            sizes = {h: hosts.count(h) for h in nodes}
            self._topology = Topology(local_rank=local.index(me), local_size=len(local),
                                      cross_rank=nodes.index(hosts[me]), cross_size=len(nodes),
                                      homogeneous=len(set(sizes.values())) == 1)
        return self._topology

    def local_size(self) -> int:
        topo = self.topology()
        return topo.local_size if topo is not None else 1

    def node_groups(self) -> Tuple[Transport, Transport]:
        key = ("torch", id(self.group))
        if key in _NODE_GROUPS:
            return _NODE_GROUPS[key]
        topo = self.topology()
        if topo is None or not topo.multi_node:
            raise NodeGroupsUnavailable("not a homogeneous multi-node job on the default group")
        places = self.allgather_object((topo.cross_rank, topo.local_rank), "hvd_ext.node_layout")
        local_sets, cross_sets = layout_sets(places, topo.cross_size, topo.local_size)
        out = (GroupTransport(self, local_sets[topo.cross_rank]), GroupTransport(self, cross_sets[topo.local_rank]))
        _NODE_GROUPS[key] = out
        return out

    # ---- collectives ---------------------------------------------------------------------------
    def allreduce_async(self, tensor, name, op="sum", prescale=1.0, postscale=1.0):
        if op not in ("sum", "average"):
            raise ValueError(f"TorchDistTransport: op {op!r}; accepted: sum, average")
        if prescale != 1.0:
            tensor.mul_(prescale)
        work = self.dist.all_reduce(tensor, op=self.dist.ReduceOp.SUM, group=self.group, async_op=True)
        scale = postscale / (self.size() if op == "average" else 1)
        return ("ar", work, tensor, scale)

    def allgather_async(self, tensor, name):
        t = tensor.reshape(-1)
        n = torch.tensor([t.numel()], dtype=torch.int64, device=self._device())
        lens = [torch.zeros_like(n) for _ in range(self.size())]
        self.dist.all_gather(lens, n, group=self.group)
        lens = [int(x.item()) for x in lens]
        wire, per = _wire(t)
        padded = torch.zeros(max(lens) * per, dtype=wire.dtype, device=wire.device)
        padded[:wire.numel()] = wire
        outs = [torch.empty_like(padded) for _ in range(self.size())]
        work = self.dist.all_gather(outs, padded, group=self.group, async_op=True)
        return ("ag", work, outs, lens, per, t.dtype)

    def allgather_equal_async(self, tensor, name):
        wire, _ = _wire(tensor.reshape(-1))
        out = torch.empty(self.size() * wire.numel(), dtype=wire.dtype, device=wire.device)
        work = self.dist.all_gather_into_tensor(out, wire, group=self.group, async_op=True)
        return ("agt", work, out, tensor.dtype)

    def alltoall_async(self, tensor, splits, name):
        splits = [int(s) for s in splits]
        if len(splits) != self.size() or sum(splits) != tensor.shape[0]:
            raise ValueError(f"alltoall {name!r}: splits {splits} do not cover {tensor.shape[0]} rows over "
                             f"{self.size()} ranks")
        send = torch.tensor(splits, dtype=torch.int64, device=self._device())
        recv = torch.empty_like(send)
        self.dist.all_to_all_single(recv, send, group=self.group)
        rsplits = [int(x) for x in recv.tolist()]
        row = tensor[0].numel() if tensor.dim() > 1 and tensor.shape[0] else 1
        wire, per = _wire(tensor.reshape(-1))
        per *= row
        out = torch.empty(sum(rsplits) * per, dtype=wire.dtype, device=wire.device)
        work = self.dist.all_to_all_single(out, wire, output_split_sizes=[s * per for s in rsplits],
                                           input_split_sizes=[s * per for s in splits], group=self.group,
                                           async_op=True)
        return ("a2a", work, out, rsplits, tensor.dtype, tuple(tensor.shape[1:]))

    def broadcast_async(self, tensor, root, name):
        wire = _as_bytes(tensor)
        return ("bc", self.dist.broadcast(wire, src=self._global(root), group=self.group, async_op=True), tensor)

    def _global(self, rank: int) -> int:
        return rank if self.group is None else self.dist.get_global_rank(self.group, rank)

    def wait(self, handle):
        kind, work = handle[0], handle[1]
        work.wait()
        if kind == "ar":
            _, _, tensor, scale = handle
            if scale != 1.0:
                tensor.mul_(scale)
            return tensor
        if kind == "ag":
            _, _, outs, lens, per, dtype = handle
            parts = [o[:n * per] for o, n in zip(outs, lens)]
            flat = torch.cat(parts) if parts else outs[0][:0]
            return flat.view(dtype) if flat.dtype != dtype else flat
        if kind == "agt":
            _, _, out, dtype = handle
            return out.view(dtype) if out.dtype != dtype else out
        if kind == "a2a":
            _, _, out, rsplits, dtype, rest = handle
            out = out.view(dtype) if out.dtype != dtype else out
            return out.reshape(-1, *rest) if rest else out, rsplits
        if kind == "bc":
            return handle[2]
        raise ValueError(f"unknown handle {kind!r}")

    # ---- objects -------------------------------------------------------------------------------
    def allgather_object(self, obj: Any, name: str):
        out = [None] * self.size()
        self.dist.all_gather_object(out, obj, group=self.group)
        return out

    def broadcast_object(self, obj: Any, root: int, name: str) -> Any:
        box = [obj]
        self.dist.broadcast_object_list(box, src=self._global(root), group=self.group)
        return box[0]
