"""An in-process N-rank world: the collectives of :class:`~hvd_ext.exchange.transport.Transport`
computed in one process, one thread per rank.

    world = SimulatedWorld(4)
    results = world.run(lambda rank, transport: train_a_step(rank, transport))

Each collective is matched across ranks by (name, occurrence), exactly as
Horovod matches tensors by name, and completes when every rank has posted
its contribution; a rank waiting longer than ``timeout`` raises (a test that
would deadlock fails instead). Results are computed in rank order and in the
tensor's own dtype, so they are deterministic. Used by the unit tests to run
the real ``GradientPipeline`` for any N without launching processes.

Nodes: ``SimulatedWorld(6, ranks_per_node=3)`` lays ranks out as a launcher
does on a cluster (ranks 0-2 on node 0, 3-5 on node 1), so ``topology()``
reports local and cross ranks, and ``node_groups()`` returns transports over
the node's ranks and over the ranks with the same local rank on every node
(Horovod's local and cross process sets; with ``groups="alltoall"``,
:class:`~hvd_ext.exchange.transport.GroupTransport` over the whole world's
alltoall, as on Horovod by default). ``process_sets=False`` stands for a job
where such process sets cannot be made (``node_groups`` raises).
"""
from __future__ import annotations

import threading
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from ..exchange.transport import GroupTransport, NodeGroupsUnavailable, Topology, Transport


class SimulatedWorld:
    def __init__(self, size: int, timeout: float = 60.0, local_size: int = 1, ranks_per_node: int = 0,
                 process_sets: bool = True, groups: str = "subworld"):
        if not isinstance(size, int) or size < 1:
            raise ValueError(f"SimulatedWorld: size must be an int >= 1, got {size!r}")
        if ranks_per_node and (not isinstance(ranks_per_node, int) or ranks_per_node < 1 or size % ranks_per_node):
            raise ValueError(f"SimulatedWorld: ranks_per_node must divide size {size}, got {ranks_per_node!r}")
        self.size = size
        self.ranks_per_node = int(ranks_per_node) if ranks_per_node else 0
        self.local = self.ranks_per_node or local_size
        self.process_sets = bool(process_sets)
        if groups not in ("subworld", "alltoall"):
            raise ValueError(f"SimulatedWorld: groups must be 'subworld' or 'alltoall', got {groups!r}")
        self.groups = groups
        self.timeout = timeout
        self._groups: Dict[Tuple[int, ...], "SimulatedWorld"] = {}
        self._cv = threading.Condition()
        self._posts: Dict[Tuple[str, int], Dict[int, Any]] = {}
        self._taken: Dict[Tuple[str, int], int] = {}
        self.calls: List[Tuple[str, str]] = []  # (kind, name) in the order rank 0 posted them

    def transport(self, rank: int) -> "SimulatedTransport":
        return SimulatedTransport(self, rank)

    def run(self, fn: Callable[[int, "SimulatedTransport"], Any]) -> List[Any]:
        """Run ``fn(rank, transport)`` on every rank in its own thread; return the results in rank order.
        The first exception raised by any rank is re-raised here."""
        results: List[Any] = [None] * self.size
        errors: List[Optional[BaseException]] = [None] * self.size

        def body(r):
            try:
                results[r] = fn(r, self.transport(r))
            except BaseException as e:  # noqa: BLE001 -- re-raised below
                errors[r] = e
                with self._cv:
                    self._cv.notify_all()

        threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(self.size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(self.timeout * 2)
        for r, e in enumerate(errors):
            if e is not None:
                raise e
        if any(t.is_alive() for t in threads):
            raise TimeoutError("SimulatedWorld.run: a rank did not finish (deadlock?)")
        return results

    def group(self, ranks) -> "SimulatedWorld":
        """The sub-world of ``ranks`` (one per distinct rank list, shared by its members)."""
        key = tuple(int(r) for r in ranks)
        with self._cv:
            g = self._groups.get(key)
            if g is None:
                g = self._groups[key] = SimulatedWorld(len(key), timeout=self.timeout)
            return g

    # ---- matching ------------------------------------------------------------------------
    def post(self, rank: int, kind: str, name: str, seq: int, value: Any) -> Tuple[str, int]:
        key = (f"{kind}:{name}", seq)
        with self._cv:
            slot = self._posts.setdefault(key, {})
            if rank in slot:
                raise RuntimeError(f"SimulatedWorld: rank {rank} posted {key} twice")
            slot[rank] = value
            if rank == 0:
                self.calls.append((kind, name))
            self._cv.notify_all()
        return key

    def gather(self, key: Tuple[str, int]) -> Dict[int, Any]:
        with self._cv:
            ok = self._cv.wait_for(lambda: len(self._posts.get(key, {})) == self.size, timeout=self.timeout)
            if not ok:
                have = sorted(self._posts.get(key, {}))
                raise TimeoutError(f"SimulatedWorld: collective {key[0]!r} #{key[1]} timed out; "
                                   f"ranks that joined: {have} of {self.size}")
            slot = self._posts[key]
            self._taken[key] = self._taken.get(key, 0) + 1
            if self._taken[key] == self.size:  # everyone has read it
                del self._posts[key]
                del self._taken[key]
            return slot


class SimulatedTransport(Transport):
    def __init__(self, world: SimulatedWorld, rank: int):
        self.world = world
        self._rank = rank
        self._seq: Dict[str, int] = {}

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self.world.size

    def local_size(self) -> int:
        return self.world.local

    def topology(self):
        L = self.world.ranks_per_node
        if not L:
            return None
        return Topology(local_rank=self._rank % L, local_size=L, cross_rank=self._rank // L,
                        cross_size=self.world.size // L, homogeneous=True)

    def node_groups(self):
        topo = self.topology()
        if topo is None:
            raise NodeGroupsUnavailable("the simulated world has no nodes (ranks_per_node not set)")
        if not self.world.process_sets and self.world.groups == "subworld":
            raise NodeGroupsUnavailable("process sets disabled in this simulated world")
        cached = getattr(self, "_node_groups", None)
        if cached is None:
            L, node, lr = topo.local_size, topo.cross_rank, topo.local_rank
            local = [node * L + j for j in range(L)]
            cross = [m * L + lr for m in range(topo.cross_size)]
            if self.world.groups == "alltoall":
                cached = (GroupTransport(self, local), GroupTransport(self, cross))
            else:
                cached = (self.world.group(local).transport(local.index(self._rank)),
                          self.world.group(cross).transport(cross.index(self._rank)))
            self._node_groups = cached
        return cached

    def _post(self, kind: str, name: str, value: Any):
        k = f"{kind}:{name}"
        seq = self._seq.get(k, 0)
        self._seq[k] = seq + 1
        return self.world.post(self._rank, kind, name, seq, value)

    def allreduce_async(self, tensor, name, op="sum", prescale=1.0, postscale=1.0):
        if op not in ("sum", "average"):
            raise NotImplementedError(f"SimulatedTransport: op {op!r}")
        return ("ar", tensor, op, postscale, self._post("ar", name, tensor.detach().clone() * prescale
                                                        if prescale != 1.0 else tensor.detach().clone()))

    def allgather_async(self, tensor, name):
        return ("ag", self._post("ag", name, tensor.detach().clone()))

    def alltoall_async(self, tensor, splits, name):
        splits = [int(s) for s in splits]
        if len(splits) != self.world.size or sum(splits) != tensor.shape[0]:
            raise ValueError(f"alltoall {name!r}: splits {splits} do not cover {tensor.shape[0]} rows "
                             f"over {self.world.size} ranks")
        return ("a2a", self._post("a2a", name, (tensor.detach().clone(), splits)))

    def broadcast_async(self, tensor, root, name):
        return ("bc", tensor, root, self._post("bc", name, tensor.detach().clone()))

    def wait(self, handle):
        kind = handle[0]
        if kind == "bc":
            _, tensor, root, key = handle
            tensor.copy_(self.world.gather(key)[root])
            return tensor
        if kind == "ar":
            _, tensor, op, postscale, key = handle
            posts = self.world.gather(key)
            acc = posts[0].clone()
            for r in range(1, self.world.size):
                acc.add_(posts[r])
            if op == "average":
                acc.div_(self.world.size)
            if postscale != 1.0:
                acc.mul_(postscale)
            tensor.copy_(acc)
            return tensor
        if kind == "ag":
            posts = self.world.gather(handle[1])
            return torch.cat([posts[r] for r in range(self.world.size)])
        if kind == "a2a":
            posts = self.world.gather(handle[1])
            me = self._rank
            pieces, rsplits = [], []
            for r in range(self.world.size):
                t, sp = posts[r]
                a = sum(sp[:me])
                pieces.append(t[a:a + sp[me]])
                rsplits.append(sp[me])
            return torch.cat(pieces), rsplits
        raise ValueError(f"unknown handle {kind!r}")

    def allgather_object(self, obj, name):
        posts = self.world.gather(self._post("obj", name, obj))
        return [posts[r] for r in range(self.world.size)]

    def broadcast_object(self, obj, root, name):
        posts = self.world.gather(self._post("bcast", name, obj))
        return posts[root]


def run_world(size: int, fn: Callable[[int, SimulatedTransport], Any], timeout: float = 60.0,
              ranks_per_node: int = 0) -> List[Any]:
    """Shorthand: ``SimulatedWorld(size, timeout, ranks_per_node=...).run(fn)``."""
    return SimulatedWorld(size, timeout, ranks_per_node=ranks_per_node).run(fn)


__all__ = ["SimulatedWorld", "SimulatedTransport", "run_world"]

