"""Transports: the primitive collectives an :class:`~hvd_ext.exchange.Exchange` is built on.

Two implementations of one small interface:

* :class:`HorovodTransport` -- Horovod's asynchronous collectives on a process
  set (``allreduce_async_``, ``allgather_async``, ``alltoall_async``,
  ``synchronize``, ``allgather_object``, ``broadcast_object``). The only code in
  hvd_ext that calls Horovod collectives.
* :class:`~hvd_ext.exchange.simulated.SimulatedTransport` -- an in-process
  N-rank world (one thread per rank) with the same semantics, so unit tests
  run the real pipeline for any N without launching processes.

Every method is called by every rank of the process set in the same order
with the same ``name`` (the rule of consistency); handles are completed by
:meth:`Transport.wait`.
"""
from __future__ import annotations

from typing import Any, List, Sequence, Tuple

import torch


class Transport:
    """Interface. ``op`` values are ``"sum"`` and ``"average"`` (plus ``"adasum"`` on Horovod)."""

    def rank(self) -> int:
        raise NotImplementedError

    def size(self) -> int:
        raise NotImplementedError

    def included(self) -> bool:
        return True

    def local_size(self) -> int:
        """Ranks of this process set on this rank's node (1 when unknown)."""
        return 1

    def allreduce_async(self, tensor: torch.Tensor, name: str, op: str = "sum",
                        prescale: float = 1.0, postscale: float = 1.0) -> Any:
        """In-place reduction of ``tensor``; ``wait`` returns the reduced tensor."""
        raise NotImplementedError

    def allgather_async(self, tensor: torch.Tensor, name: str) -> Any:
        """1-D tensors of possibly different lengths; ``wait`` returns their concatenation in rank order."""
        raise NotImplementedError

    def alltoall_async(self, tensor: torch.Tensor, splits: Sequence[int], name: str) -> Any:
        """Send ``tensor[sum(splits[:j]):sum(splits[:j+1])]`` to rank j; ``wait`` returns
        ``(received, received_splits)`` with the pieces in source-rank order."""
        raise NotImplementedError

    def wait(self, handle: Any):
        raise NotImplementedError

    def allgather_object(self, obj: Any, name: str) -> List[Any]:
        raise NotImplementedError

    def broadcast_object(self, obj: Any, root: int, name: str) -> Any:
        raise NotImplementedError


class HorovodTransport(Transport):
    """Horovod's collectives on ``process_set`` (default: the global set)."""

    def __init__(self, process_set=None):
        import horovod.torch as hvd

        self.hvd = hvd
        self.process_set = hvd.global_process_set if process_set is None else process_set
        self._ops = {"sum": hvd.Sum, "average": hvd.Average, "adasum": hvd.Adasum}

    def rank(self) -> int:
        return self.process_set.rank()

    def size(self) -> int:
        return self.process_set.size()

    def included(self) -> bool:
        return self.process_set.included()

    def local_size(self) -> int:
        if self.process_set is self.hvd.global_process_set:
            return self.hvd.local_size()
        return 1

    def allreduce_async(self, tensor, name, op="sum", prescale=1.0, postscale=1.0):
        return ("ar", self.hvd.allreduce_async_(tensor, name=name, op=self._ops[op], prescale_factor=prescale,
                                                postscale_factor=postscale, process_set=self.process_set))

    def allgather_async(self, tensor, name):
        return ("ag", self.hvd.allgather_async(tensor, name=name, process_set=self.process_set))

    def alltoall_async(self, tensor, splits, name):
        sp = torch.tensor([int(s) for s in splits], dtype=torch.int32)
        return ("a2a", self.hvd.alltoall_async(tensor, splits=sp, name=name, process_set=self.process_set))

    def wait(self, handle):
        kind, h = handle
        out = self.hvd.synchronize(h)
        if kind == "a2a":
            if isinstance(out, tuple):
                received, rsplits = out
            else:  # older Horovod: no received splits
                received, rsplits = out, None
            return received, ([int(x) for x in rsplits.tolist()] if rsplits is not None else None)
        return out

    def allgather_object(self, obj, name):
        # hvd.allgather_object has no process_set argument in Horovod 0.28: pickle, gather sizes and bytes
        import pickle

        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        ps = self.process_set
        sizes = self.hvd.allgather(torch.tensor([data.numel()], dtype=torch.int64), name=f"{name}.size",
                                   process_set=ps).tolist()
        buf = self.hvd.allgather(data, name=f"{name}.data", process_set=ps)
        out, off = [], 0
        for s in sizes:
            out.append(pickle.loads(buf[off:off + s].numpy().tobytes()))
            off += s
        return out

    def broadcast_object(self, obj, root, name):
        return self.hvd.broadcast_object(obj, root_rank=root, name=name, process_set=self.process_set)


def split_sizes(total: int, parts: int) -> List[int]:
    """``total`` split into ``parts`` contiguous pieces differing by at most one (the first are larger)."""
    q, r = divmod(int(total), int(parts))
    return [q + (1 if j < r else 0) for j in range(parts)]


def offsets(sizes: Sequence[int]) -> List[Tuple[int, int]]:
    out, a = [], 0
    for s in sizes:
        out.append((a, a + int(s)))
        a += int(s)
    return out
