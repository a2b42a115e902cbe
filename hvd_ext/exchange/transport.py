"""Transports: the primitive collectives an :class:`~hvd_ext.exchange.Exchange` is built on.

Two implementations of one small interface:

* :class:`HorovodTransport` -- Horovod's asynchronous collectives on a process
  set (``allreduce_async_``, ``allgather_async``, ``alltoall_async``,
  ``synchronize``, ``allgather_object``, ``broadcast_object``). The only code in
  hvd_ext that calls Horovod collectives.
* :class:`~hvd_ext.testing.simulated.SimulatedTransport` -- an in-process
  N-rank world (one thread per rank) with the same semantics, so unit tests
  run the real pipeline for any N without launching processes.

Every method is called by every rank of the process set in the same order
with the same ``name`` (the rule of consistency); handles are completed by
:meth:`Transport.wait`.

Nodes: ``topology()`` says how the ranks sit on nodes (Horovod's local and
cross ranks) and ``node_groups()`` returns two transports, over this rank's
node and over the ranks with this local rank on every node, for the
node-aware exchange (:mod:`hvd_ext.exchange.routes.hierarchical`). Two ways to make
them on Horovod (``HVD_EXT_NODE_GROUPS``):

* ``alltoall`` (default): :class:`GroupTransport` -- every group collective
  is one alltoall on the global process set in which a rank sends only to
  the members of its group (zero bytes to the others), so all groups of a
  phase run as one Horovod operation, nothing is needed at ``hvd.init``,
  and no process set is added. Every added process set raises the latency
  of every small global allreduce, because Horovod's background loop
  coordinates every process set on every cycle;
* ``process_sets``: Horovod process sets for the nodes, which must be
  declared at ``hvd.init`` or be addable at run time, else one warning and
  the flat exchange::

      hvd.init(process_sets="dynamic")      # or HOROVOD_DYNAMIC_PROCESS_SETS=1
      # or, declared up front (ranks placed node by node, as horovodrun and mpirun do):
      hvd.init(process_sets=hvd_ext.exchange.node_process_sets())
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from .waiting import sleep_until, wait_mode


@dataclass(frozen=True)
class Topology:
    """Where this rank sits: ``local_rank`` of ``local_size`` on node ``cross_rank`` of ``cross_size``.
    ``homogeneous``: every node runs the same number of ranks (the same on every rank)."""

    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int
    homogeneous: bool = True

    @property
    def multi_node(self) -> bool:
        """More than one node and more than one rank per node, every node alike."""
        return self.homogeneous and self.cross_size > 1 and self.local_size > 1


class NodeGroupsUnavailable(RuntimeError):
    """The local / cross groups of the node-aware exchange cannot be made (the message says why)."""


class Transport:
    """Interface. ``op`` values are ``"sum"`` and ``"average"`` (plus ``"adasum"`` on Horovod).
    ``measurable``: timing its collectives says something about the links (not in a simulated world)."""

    measurable = False

    def rank(self) -> int:
        raise NotImplementedError

    def size(self) -> int:
        raise NotImplementedError

    def included(self) -> bool:
        return True

    def local_size(self) -> int:
        """Ranks of this process set on this rank's node (1 when unknown)."""
        return 1

    def topology(self) -> Optional[Topology]:
        """This rank's place among the nodes, or None when unknown (a single flat group)."""
        return None

    def node_groups(self) -> Tuple["Transport", "Transport"]:
        """(transport over this rank's node, transport over the ranks with this local rank on every
        node). Called by every rank, in the same order. Raises :class:`NodeGroupsUnavailable`."""
        raise NodeGroupsUnavailable("this transport has no node groups")

    def allreduce_async(self, tensor: torch.Tensor, name: str, op: str = "sum",
                        prescale: float = 1.0, postscale: float = 1.0) -> Any:
        """In-place reduction of ``tensor``; ``wait`` returns the reduced tensor."""
        raise NotImplementedError

    def allgather_async(self, tensor: torch.Tensor, name: str) -> Any:
        """1-D tensors of possibly different lengths; ``wait`` returns their concatenation in rank order."""
        raise NotImplementedError

    def allgather_equal_async(self, tensor: torch.Tensor, name: str) -> Any:
        """:meth:`allgather_async` when every rank passes a tensor of the same length (a transport may
        then skip exchanging the lengths)."""
        return self.allgather_async(tensor, name)

    def alltoall_async(self, tensor: torch.Tensor, splits: Sequence[int], name: str) -> Any:
        """Send ``tensor[sum(splits[:j]):sum(splits[:j+1])]`` to rank j; ``wait`` returns
        ``(received, received_splits)`` with the pieces in source-rank order."""
        raise NotImplementedError

    def broadcast_async(self, tensor: torch.Tensor, root: int, name: str) -> Any:
        """In-place: ``tensor`` takes rank ``root``'s values; ``wait`` returns it. Dtypes: those
        Horovod broadcasts (:data:`BROADCAST_DTYPES`); callers send others as their bytes."""
        raise NotImplementedError

    def wait(self, handle: Any):
        raise NotImplementedError

    def allgather_object(self, obj: Any, name: str) -> List[Any]:
        raise NotImplementedError

    def broadcast_object(self, obj: Any, root: int, name: str) -> Any:
        raise NotImplementedError


class HorovodTransport(Transport):
    """Horovod's collectives on ``process_set`` (default: the global set)."""

    measurable = True

    def __init__(self, process_set=None, wait: Optional[str] = None):
        """``wait``: ``spin`` (Horovod's ``synchronize``) or ``sleep``; None: ``HVD_EXT_WAIT``'s rule
        (:mod:`hvd_ext.exchange.waiting`)."""
        import horovod.torch as hvd

        self.hvd = hvd
        self.process_set = hvd.global_process_set if process_set is None else process_set
        self._ops = {"sum": hvd.Sum, "average": hvd.Average, "adasum": hvd.Adasum}
        if wait not in (None, "spin", "sleep"):
            raise ValueError(f"HorovodTransport: wait must be 'spin', 'sleep' or None, got {wait!r}")
        self.sleeps = (wait == "sleep") if wait is not None else (
            wait_mode(hvd.local_size()) == "sleep" if hvd.is_initialized() else None)

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

    def topology(self) -> Optional[Topology]:
        hvd = self.hvd
        if self.process_set is not hvd.global_process_set:
            return None  # a sub-process-set's ranks need not fill whole nodes: flat
        homog = getattr(hvd, "is_homogeneous", None)
        if homog is None:
            from horovod.torch.mpi_ops import _basics

            homog = _basics.is_homogeneous
        return Topology(local_rank=hvd.local_rank(), local_size=hvd.local_size(), cross_rank=hvd.cross_rank(),
                        cross_size=hvd.cross_size(), homogeneous=bool(homog()))

    def node_groups(self):
        key = ("horovod", id(self.process_set), self.sleeps)  # the groups wait as the transport they are built on
        if key in _NODE_GROUPS:
            return _NODE_GROUPS[key]
        topo = self.topology()
        if topo is None or not topo.multi_node:
            raise NodeGroupsUnavailable("not a homogeneous multi-node job on the global process set")
        hvd = self.hvd
        # Where every rank sits (one small allgather; layouts other than node by node work too).
        places = self.allgather_object((topo.cross_rank, topo.local_rank), "hvd_ext.node_layout")
        local_sets, cross_sets = layout_sets(places, topo.cross_size, topo.local_size)
        mode = node_groups_mode()
        if mode == "alltoall":
            out = (GroupTransport(self, local_sets[topo.cross_rank]), GroupTransport(self, cross_sets[topo.local_rank]))
            _NODE_GROUPS[key] = out
            return out
        from horovod.common import process_sets as ps_mod

        known = {tuple(r): i for i, r in ps_mod._basics._get_process_set_ids_and_ranks().items()}
        missing = [r for r in local_sets + cross_sets if tuple(r) not in known]
        if missing and not dynamic_process_sets():
            raise NodeGroupsUnavailable(
                f"Horovod process sets for the nodes are not declared (missing e.g. ranks {missing[0]}) and "
                "dynamic process sets are off: call hvd.init(process_sets='dynamic') or set "
                "HOROVOD_DYNAMIC_PROCESS_SETS=1, or declare them with "
                "hvd.init(process_sets=hvd_ext.exchange.node_process_sets())")
        made: Dict[Tuple[int, ...], Any] = {}
        for ranks in local_sets + cross_sets:  # same order on every rank: add_process_set is collective
            t = tuple(ranks)
            if t in known:
                ps = hvd.ProcessSet(list(ranks))
                ps.process_set_id = known[t]
            else:
                ps = hvd.add_process_set(list(ranks))
            made[t] = ps
        mine_local = made[tuple(local_sets[topo.cross_rank])]
        mine_cross = made[tuple(cross_sets[topo.local_rank])]
        out = (HorovodTransport(mine_local), HorovodTransport(mine_cross))
        _NODE_GROUPS[key] = out
        return out

    def allreduce_async(self, tensor, name, op="sum", prescale=1.0, postscale=1.0):
        return ("ar", self.hvd.allreduce_async_(tensor, name=name, op=self._ops[op], prescale_factor=prescale,
                                                postscale_factor=postscale, process_set=self.process_set))

    def allgather_async(self, tensor, name):
        return ("ag", self.hvd.allgather_async(tensor, name=name, process_set=self.process_set))

    def alltoall_async(self, tensor, splits, name):
        sp = torch.tensor([int(s) for s in splits], dtype=torch.int32)
        return ("a2a", self.hvd.alltoall_async(tensor, splits=sp, name=name, process_set=self.process_set))

    def broadcast_async(self, tensor, root, name):
        return ("bc", self.hvd.broadcast_async_(tensor, root_rank=root, name=name, process_set=self.process_set))

    def wait(self, handle):
        kind, h = handle
        if self.sleeps is None:  # made before hvd.init
            self.sleeps = wait_mode(self.hvd.local_size()) == "sleep"
        if self.sleeps:  # ranks share cores: poll and sleep instead of Horovod's spin (waiting.py)
            sleep_until(lambda: self.hvd.poll(h))
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


# what Horovod's broadcast carries (no bfloat16, bool, complex or float8: those travel as their bytes)
BROADCAST_DTYPES = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16,
                    torch.float32, torch.float64)

# (transport kind, id of its process set or group, ...) -> (node group, cross group)
_NODE_GROUPS: Dict[tuple, Tuple[Transport, Transport]] = {}


def forget_node_groups(group: Any) -> None:
    """Drop every node group made over ``group`` (a process set or torch group): the world changed."""
    for key in [k for k in _NODE_GROUPS if k[1] == id(group)]:
        del _NODE_GROUPS[key]


NODE_GROUP_MODES = ("alltoall", "process_sets")


def node_groups_mode() -> str:
    """How node groups are made on Horovod: ``HVD_EXT_NODE_GROUPS`` = alltoall (default) | process_sets."""
    mode = os.environ.get("HVD_EXT_NODE_GROUPS", "alltoall").strip().lower() or "alltoall"
    if mode not in NODE_GROUP_MODES:
        raise ValueError(f"HVD_EXT_NODE_GROUPS must be one of {', '.join(NODE_GROUP_MODES)}, got {mode!r}")
    return mode


class GroupTransport(Transport):
    """Collectives of a group of ranks (``members``, sorted global ranks) built on the parent's
    alltoall: a rank sends only to the members of its group. Every rank of the parent takes part in
    each call (the other groups run their own instance of the same call at the same time), so one
    parent operation carries one phase for all groups, and no process set is needed.

    allgather: each member sends its tensor to every member ((G-1) copies out, as many bytes as a
    ring allgather moves per rank); allreduce: the same gather, summed in member order (every member
    gets the same bits)."""

    def __init__(self, parent: Transport, members: Sequence[int]):
        self.parent = parent
        self.members = [int(g) for g in members]
        self.world = parent.size()
        me = parent.rank()
        if me not in self.members:
            raise ValueError(f"GroupTransport: rank {me} is not among {self.members}")
        self._rank = self.members.index(me)

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return len(self.members)

    def _global_splits(self, splits: Sequence[int]) -> List[int]:
        gs = [0] * self.world
        for g, s in zip(self.members, splits):
            gs[g] = int(s)
        return gs

    def alltoall_async(self, tensor, splits, name):
        splits = [int(s) for s in splits]
        if len(splits) != len(self.members):
            raise ValueError(f"alltoall {name!r}: {len(splits)} splits for a group of {len(self.members)}")
        return ("g-a2a", self.parent.alltoall_async(tensor, self._global_splits(splits), name))

    def allgather_async(self, tensor, name):
        t = tensor.reshape(-1)
        buf = t.repeat(len(self.members)) if t.numel() else t
        return ("g-ag", self.parent.alltoall_async(buf, self._global_splits([t.numel()] * len(self.members)), name))

    def allreduce_async(self, tensor, name, op="sum", prescale=1.0, postscale=1.0):
        if op not in ("sum", "average"):
            raise NotImplementedError(f"GroupTransport: op {op!r}")
        t = tensor.detach().reshape(-1)
        if prescale != 1.0:
            t = t * prescale
        buf = t.repeat(len(self.members))
        h = self.parent.alltoall_async(buf, self._global_splits([t.numel()] * len(self.members)), name)
        return ("g-ar", h, tensor, op, postscale)

    def wait(self, handle):
        kind = handle[0]
        received, rsplits = self.parent.wait(handle[1])
        if kind == "g-a2a":
            return received, ([rsplits[g] for g in self.members] if rsplits is not None else None)
        if kind == "g-ag":
            return received
        _, _, tensor, op, postscale = handle
        parts = received.view(len(self.members), -1)
        acc = parts[0].clone()
        for j in range(1, len(self.members)):
            acc.add_(parts[j])
        if op == "average":
            acc.div_(len(self.members))
        if postscale != 1.0:
            acc.mul_(postscale)
        tensor.copy_(acc.view_as(tensor))
        return tensor

    def allgather_object(self, obj, name):
        import pickle

        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        received, rsplits = self.wait(self.alltoall_async(data.repeat(len(self.members)),
                                                          [data.numel()] * len(self.members), name))
        out, off = [], 0
        for s in rsplits:
            out.append(pickle.loads(received[off:off + s].numpy().tobytes()))
            off += s
        return out

    def broadcast_object(self, obj, root, name):
        return self.allgather_object(obj if self._rank == root else None, name)[root]


def horovod_elastic() -> bool:
    """True when this process runs under an elastic ``horovodrun`` (``--min-np``/``--max-np``,
    host discovery): workers may join later, so no collective may run at construction."""
    return os.environ.get("HOROVOD_ELASTIC", "0").strip() not in ("", "0")


def dynamic_process_sets() -> bool:
    """True when Horovod may add process sets after ``hvd.init`` (``HOROVOD_DYNAMIC_PROCESS_SETS``)."""
    return os.environ.get("HOROVOD_DYNAMIC_PROCESS_SETS", "").strip().lower() in ("1", "true", "yes", "on")


def layout_sets(places: Sequence[Tuple[int, int]], cross_size: int, local_size: int):
    """From every rank's (cross_rank, local_rank): the ranks of each node and of each local rank
    across the nodes (each list sorted, as Horovod orders a process set)."""
    local_sets = [sorted(r for r, (c, _) in enumerate(places) if c == m) for m in range(cross_size)]
    cross_sets = [sorted(r for r, (_, lr) in enumerate(places) if lr == j) for j in range(local_size)]
    return local_sets, cross_sets


def node_process_sets(size: Optional[int] = None, local_size: Optional[int] = None) -> list:
    """Process sets to pass to ``hvd.init(process_sets=...)`` for the node-aware exchange, before
    Horovod is initialised: ranks placed node by node (horovodrun's and mpirun's default), ``size``
    and ``local_size`` from the launcher's environment unless given. Returns [] on one node."""
    from horovod.common.process_sets import ProcessSet

    env = os.environ
    N = size if size is not None else int(env.get("HOROVOD_SIZE") or env.get("OMPI_COMM_WORLD_SIZE") or 1)
    L = local_size if local_size is not None else int(env.get("HOROVOD_LOCAL_SIZE")
                                                        or env.get("OMPI_COMM_WORLD_LOCAL_SIZE") or 1)
    if L <= 1 or N <= L or N % L:
        return []
    M = N // L
    places = [(r // L, r % L) for r in range(N)]
    local_sets, cross_sets = layout_sets(places, M, L)
    return [ProcessSet(r) for r in local_sets + cross_sets]


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
