"""What every route shares: the per-tensor record, the route protocol, owner memory, the registry.

A route is created per bucket and reused every step. The pipeline calls
``start(records, nonfinite)`` when the bucket is ready (during backward),
``progress()`` on every bucket once backward is over (multi-phase routes
start their second collective there), then ``finish()`` which returns the
averaged dense tensors. ``sent(record, result)`` is what this rank
contributed, for error feedback. A route module registers its class with
:func:`register`; :func:`make_route` builds one by name.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import torch

from ...compression.base import Compressor, TensorInfo
from ...feedback.base import shared_entries, with_shared
from ..core import Exchange
from ..transport import offsets, split_sizes


def segments(sizes: List[int], parts: int) -> List[List[Tuple[int, int, int]]]:
    """For each shard j: [(tensor index, start, end)] -- the pieces of the tensors (flat ranges)
    that fall in shard j when the tensors of ``sizes`` are concatenated and cut into ``parts``. One
    sweep over shards and tensors together (both in order): linear in ``parts`` + tensors."""
    total = sum(sizes)
    starts = [a for a, _ in offsets(sizes)]
    out: List[List[Tuple[int, int, int]]] = []
    first = 0  # the first tensor that does not end before the current shard
    for lo, hi in offsets(split_sizes(total, parts)):
        while first < len(sizes) and starts[first] + sizes[first] <= lo:
            first += 1
        segs, i = [], first
        while i < len(sizes) and starts[i] < hi:
            a, b = max(lo, starts[i]), min(hi, starts[i] + sizes[i])
            if a < b:
                segs.append((i, a - starts[i], b - starts[i]))
            i += 1
        out.append(segs)
    return out


@dataclass(eq=False)
class TensorRecord:
    """One tensor of a bucket during a step (the typed record the routes and feedback share)."""

    name: str
    param: torch.Tensor
    info: TensorInfo
    u: torch.Tensor          # compensated gradient: what the feedback wants to send
    payload: Any = None      # this rank's payload (allreduce / allgather / sparse_rs routes)
    ctx: Any = None


def sends_flat(comp: Compressor, route: str) -> bool:
    """Whether ``route`` (its name) sends ``comp``'s records of a bucket as one flat record
    (:func:`flat_record`): a ``bucket_flat`` codec on a route that sends whole tensors."""
    return bool(comp.bucket_flat) and route in ("allgather", "sparse_rs")


def flat_record(comp: Compressor, route: str, records: List[TensorRecord], name: str) -> Optional[TensorRecord]:
    """One record standing for ``records`` when ``comp`` is ``bucket_flat`` (topk scope=model, sig) and
    the route (its name) sends whole tensors (allgather, sparse_rs): one payload per bucket (or node shard)
    instead of one per tensor, of a size every rank knows. Its ``TensorInfo.segments`` name the tensors;
    the feedback keeps working per tensor on :func:`split_flat` of the results. None when the records
    go as they are."""
    if not records or not sends_flat(comp, route):
        return None
    u = torch.cat([r.u.reshape(-1).float() for r in records])
    i0 = records[0].info
    info = TensorInfo(name=name, shape=u.shape, step=i0.step, rank=i0.rank, size=i0.size, param=None,
                      scale=i0.scale, segments=[(r.name, r.u.numel(), r.info.param) for r in records])
    return TensorRecord(name, None, info, u)


def split_flat(t: torch.Tensor, records: List[TensorRecord]) -> List[torch.Tensor]:
    """A flat record's tensor (result, support, what was sent) cut back into ``records``' pieces."""
    return list(t.reshape(-1).split([r.u.numel() for r in records]))


class OwnerMemory:
    """Error-feedback memory kept by a shard's owner (two-phase / sparse reduce-scatter):
    what its re-compression did not send is added to the next step's shard.
    Staged like the worker feedback: committed only on finite steps.

    Entries whose key ends in ``SHARED_SUFFIX`` (sparse reduce-scatter's owner ranges) are identical on
    every rank and decide what each rank sends: a rank resuming behind the others takes them from the
    most advanced one (``load_shared_state_dict``). The residuals stay the owner's own.

    Entries whose key ends in ``NOTE_SUFFIX`` note what a route last did with the memory (the
    sparse reduce-scatter: what its residual was scanned for). They are never saved, and every load
    drops them: after a load the memory may hold what no note describes."""

    SHARED_SUFFIX = ":bounds"
    NOTE_SUFFIX = ":scanned"

    def __init__(self):
        self.memory: Dict[str, torch.Tensor] = {}
        self._staged: Dict[str, torch.Tensor] = {}

    def get(self, key: str, like: torch.Tensor) -> torch.Tensor:
        m = self.memory.get(key)
        if m is None or m.shape != like.shape:
            return torch.zeros_like(like)
        return m.to(like.device)

    def stage(self, key: str, value: Optional[torch.Tensor]) -> None:
        """``value`` replaces the entry at the next commit (``None``: removes it)."""
        self._staged[key] = None if value is None else value.detach()

    def commit(self) -> None:
        for key, value in self._staged.items():
            if value is None:
                self.memory.pop(key, None)
            else:
                self.memory[key] = value
        self._staged = {}

    def discard(self) -> None:
        self._staged = {}

    def state_dict(self) -> Dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in self.memory.items() if not k.endswith(self.NOTE_SUFFIX)}

    def load_state_dict(self, sd: Dict[str, torch.Tensor]) -> None:
        self.memory = {k: v.clone() for k, v in (sd or {}).items() if not k.endswith(self.NOTE_SUFFIX)}
        self._staged = {}

    def is_shared(self, key: str) -> bool:
        return key.endswith(self.SHARED_SUFFIX)

    def shared_state_dict(self) -> Dict[str, torch.Tensor]:
        return shared_entries(self.memory, self.is_shared)

    def load_shared_state_dict(self, sd: Dict[str, torch.Tensor]) -> None:
        """Take ``sd``'s shared entries (replacing this rank's); its residuals stay."""
        self.load_state_dict(with_shared(self.memory, sd, self.is_shared))


def known_sizes(comp: Compressor, infos: List[TensorInfo], payloads: List[torch.Tensor],
                recoded: bool = False) -> Optional[List[int]]:
    """The sizes every rank's payloads for ``infos`` have (``Compressor.payload_size``), or None when
    one depends on the data; checked against this rank's own ``payloads`` (a codec that says a wrong
    size would make every receiver misread the frames)."""
    sizes = [comp.payload_size(info, recoded) for info in infos]
    if any(s is None for s in sizes):
        return None
    for info, size, p in zip(infos, sizes, payloads):
        if p is not None and int(p.numel()) != size:
            raise RuntimeError(f"hvd_ext: compressor '{comp.name}' says its payload for {info.name!r} has {size} "
                               f"bytes but made {p.numel()}")
    return sizes


class Route:
    name = "?"
    # start() reads device values (the alltoall's split sizes depend on the data): on a GPU the
    # pipeline then starts the bucket after backward (or on the overlap worker), not in a hook
    reads_on_start = False

    def __init__(self, comp: Compressor, exchange: Exchange, tag: str, memory: Optional[OwnerMemory] = None):
        self.comp = comp
        self.exchange = exchange
        self.tag = tag
        self.memory = memory
        self.records: List[TensorRecord] = []
        self.code_s = 0.0  # seconds spent coding inside the route (decode, re-compress)

    def prepare(self, records: List[TensorRecord]) -> None:
        """The codec's plan for the records it is about to compress together (``prepare_bucket``: budgets
        spanning tensors -- topk scope=model, sig, qdist's budget -- and one device read for them all)."""
        if records:
            self.comp.prepare_bucket([(r.u, r.info) for r in records])

    def compress_records(self, records: List[TensorRecord]) -> None:
        self.prepare(records)
        for rec in records:
            rec.payload, rec.ctx = self.comp.compress(rec.u, rec.info)

    def start(self, records: List[TensorRecord], nonfinite: bool) -> None:
        raise NotImplementedError

    def progress(self) -> None:
        """Complete a first phase and start the next (no-op for one-phase routes)."""

    def finish(self) -> Tuple[List[torch.Tensor], List[Optional[torch.Tensor]], torch.Tensor]:
        """(averaged dense results, supports, a 0-d bool tensor: some rank had a non-finite gradient)."""
        raise NotImplementedError

    def sent(self, i: int, result: torch.Tensor) -> torch.Tensor:
        """Dense value of what this rank contributed to ``records[i]`` (error feedback subtracts it)."""
        rec = self.records[i]
        return self.comp.local_contribution(rec.payload, rec.ctx, rec.info, result)


_ROUTES: Dict[str, type] = {}
NODE_PREFIX = "node:"  # "node:<inner>": the node-aware route around the flat route <inner>


def register(cls: type) -> type:
    """Class decorator: make a route buildable by :func:`make_route` under ``cls.name``."""
    _ROUTES[cls.name] = cls
    return cls


def make_route(kind: str, comp: Compressor, exchange: Exchange, tag: str, memory: OwnerMemory) -> Route:
    """The route ``kind`` (a registered name, or ``"node:<inner>"``) for one bucket."""
    if kind.startswith(NODE_PREFIX):
        inner = kind[len(NODE_PREFIX):]
        if inner not in _ROUTES or inner == "node":
            raise ValueError(f"unknown route {kind!r}")
        return _ROUTES["node"](comp, exchange, tag, memory, inner=inner)
    if kind not in _ROUTES or kind == "node":
        raise ValueError(f"unknown route {kind!r}; accepted: {', '.join(sorted(k for k in _ROUTES if k != 'node'))}")
    return _ROUTES[kind](comp, exchange, tag, memory)
