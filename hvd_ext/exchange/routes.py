"""Routes: how one bucket of compressed tensors travels between the ranks.

A route is created per bucket and reused every step. The pipeline calls
``start(records, nonfinite)`` when the bucket is ready (during backward),
``progress()`` on every bucket once backward is over (multi-phase routes
start their second collective there), then ``finish()`` which returns the
averaged dense tensors. ``sent(record, result)`` is what this rank
contributed, for error feedback.

=============  ==============================================  ==========================
route          collectives                                     bytes per rank as N grows
=============  ==============================================  ==========================
allreduce      allreduce (linear codecs; PowerSGD: 2 rounds)   2(N-1)/N x payload (ring)
allgather      one allgather, decode all N                     (N-1) x payload
twophase       alltoall of shards + allgather of re-coded      2(N-1)/N x payload
               shards (:mod:`.twophase`)
sparse_rs      alltoall of (index, value) pairs by owner        ~2k pairs, flat in N
               range + allgather of re-selected (:mod:`.sparse_rs`)
node:<inner>   dense reduce-scatter in the node, <inner> on     inter-node: 1/L of the
               1/L of the bucket across nodes, dense            above per rank
               allgather in the node (:mod:`.hierarchical`)
=============  ==============================================  ==========================

``choose_route`` picks one from the compressor family, the spec's
``exchange=`` and ``hierarchy=`` keys and the cost model (:mod:`.cost`); it
depends on nothing rank-local (Horovod's local/cross sizes are the same on
every rank of a homogeneous job), so every rank builds the same routes.
"""
from __future__ import annotations

import dataclasses
import math
import os
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import torch

from ..compression.base import Compressor, Continue, TensorInfo
from . import cost
from .core import Exchange

from ..compression.base import HIERARCHY_CHOICES, ROUTE_CHOICES  # noqa: E402

# Linear codecs whose payload can be cut into shards elementwise (PowerSGD's factors cannot).
SHARDABLE_LINEAR = ("none", "fp16", "bf16")
# Feedbacks whose memory the node-aware exchange reproduces at node level (residual error feedback);
# momentum masking (dgc_momentum) and prediction sharing (ewma) need each rank's own sent mask.
NODE_FEEDBACKS = ("none", "residual")
_warned = set()


@dataclass(eq=False)
class TensorRecord:
    """One tensor of a bucket during a step (the typed record the routes and feedback share)."""

    name: str
    param: torch.Tensor
    info: TensorInfo
    u: torch.Tensor          # compensated gradient: what the feedback wants to send
    payload: Any = None      # this rank's payload (allreduce / allgather / sparse_rs routes)
    ctx: Any = None


def flat_record(comp: Compressor, route: str, records: List[TensorRecord], name: str) -> Optional[TensorRecord]:
    """One record standing for ``records`` when ``comp`` is ``bucket_flat`` (topk scope=model, sig) and
    the route (its name) sends whole tensors (allgather, sparse_rs): one payload per bucket (or node shard)
    instead of one per tensor, of a size every rank knows. Its ``TensorInfo.segments`` name the tensors;
    the feedback keeps working per tensor on :func:`split_flat` of the results. None when the records
    go as they are."""
    if not records or not getattr(comp, "bucket_flat", False) or route not in ("allgather", "sparse_rs"):
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
    Staged like the worker feedback: committed only on finite steps."""

    def __init__(self):
        self.memory: Dict[str, torch.Tensor] = {}
        self._staged: Dict[str, torch.Tensor] = {}

    def get(self, key: str, like: torch.Tensor) -> torch.Tensor:
        m = self.memory.get(key)
        if m is None or m.shape != like.shape:
            return torch.zeros_like(like)
        return m.to(like.device)

    def stage(self, key: str, value: torch.Tensor) -> None:
        self._staged[key] = value.detach()

    def commit(self) -> None:
        self.memory.update(self._staged)
        self._staged = {}

    def discard(self) -> None:
        self._staged = {}

    def state_dict(self) -> Dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in self.memory.items()}

    def load_state_dict(self, sd: Dict[str, torch.Tensor]) -> None:
        self.memory = {k: v.clone() for k, v in (sd or {}).items()}
        self._staged = {}


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
        prepare = getattr(self.comp, "prepare_bucket", None)
        if prepare is not None and records:
            prepare([(r.u, r.info) for r in records])

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


class AllreduceRoute(Route):
    """Linear codecs: one fused allreduce per dtype; ``Continue`` asks for further rounds (PowerSGD).
    The non-finite test reads the reduced buffer: a NaN/Inf on any rank makes the sum non-finite."""

    name = "allreduce"

    def start(self, records, nonfinite):
        self.compress_records(records)
        self.records = records
        self._pending = self.exchange.start_allreduce(f"hvd_ext.ar.{self.tag}", [r.payload for r in records],
                                                      nonfinite, reuse=self.comp.transient_results)

    def finish(self):
        ex, comp = self.exchange, self.comp
        reduced, nf = ex.finish_allreduce(self._pending)
        # finish_allreduce also tested the reduced buffers for NaN/Inf (one pass per fused buffer)
        results: List[Optional[torch.Tensor]] = [None] * len(reduced)
        todo = list(range(len(reduced)))
        ctxs = [r.ctx for r in self.records]
        rnd = 1
        while todo:
            again, payloads = [], []
            for j, i in enumerate(todo):
                out = comp.decompress(reduced[j], ctxs[i], self.records[i].info)
                if isinstance(out, Continue):
                    ctxs[i] = out.ctx
                    again.append(i)
                    payloads.append(out.payload)
                else:
                    results[i] = out
            if not again:
                break
            rnd += 1
            pend = ex.start_allreduce(f"hvd_ext.ar.{self.tag}.r{rnd}", payloads, False)
            reduced, _ = ex.finish_allreduce(pend)
            todo = again
        for rec, ctx in zip(self.records, ctxs):  # the final ctx, for local_contribution
            rec.ctx = ctx
        return results, [None] * len(results), nf


class AllgatherRoute(Route):
    """Non-linear codecs: one allgather of every rank's payloads, each rank decodes all N."""

    name = "allgather"

    def start(self, records, nonfinite):
        self.compress_records(records)
        self.records = records
        # every rank's payloads have these sizes when the codec can say so: nothing to read on receipt
        lens = known_sizes(self.comp, [r.info for r in records], [r.payload for r in records])
        lens = [lens] * self.exchange.size if lens is not None else None
        self._pending = self.exchange.start_allgather(f"hvd_ext.ag.{self.tag}", [r.payload for r in records],
                                                      nonfinite, lens)

    def finish(self):
        per_tensor, nf = self.exchange.finish_allgather(self._pending)
        t0 = time.perf_counter()
        scale = self.exchange.scale()
        comp = self.comp
        want_support = getattr(comp.feedback, "needs_support", False)
        results, supports = [], []
        for rec, datas in zip(self.records, per_tensor):
            results.append(comp.aggregate(datas, rec.ctx, rec.info).mul_(scale))
            supports.append(comp.support(datas, rec.ctx, rec.info) if want_support else None)
        self.code_s += time.perf_counter() - t0
        return results, supports, nf


def estimated_payload_bytes(comp: Compressor, numel: int) -> float:
    """Bytes of one rank's payload for ``numel`` elements: exact when the codec says, else from its ratio."""
    wb = comp.wire_bytes(numel)
    if wb is not None:
        return float(wb)
    if comp.sparse:
        ratio = float(getattr(comp, "ratio", 0.01))
        vb = 2 if getattr(comp, "values", "fp32") == "fp16" else 4
        return math.ceil(ratio * numel) * (vb + 2)
    bits = float(getattr(comp, "bits", 0) or getattr(comp, "budget", 0) or 8)
    return numel * bits / 8.0


def node_aware_reason(comp: Compressor, exchange: Optional[Exchange]) -> Optional[str]:
    """None when the node-aware exchange can carry this compressor over ``exchange``'s nodes;
    else why not (the same on every rank)."""
    if getattr(comp, "hierarchy", "auto") == "flat":
        return "hierarchy=flat"
    if os.environ.get("HOROVOD_ELASTIC", "0").strip() not in ("", "0"):
        return "elastic job: the node layout can change, and no collective may run at construction"
    topo = exchange.topology() if exchange is not None else None
    if topo is None or not topo.multi_node:
        return "one node, one rank per node, or nodes of different sizes"
    if comp.exchange == "allreduce" and comp.name not in SHARDABLE_LINEAR:
        return f"'{comp.name}' payloads cannot be cut into shards"
    fb = getattr(getattr(comp, "feedback", None), "name", "none")
    if fb not in NODE_FEEDBACKS:
        return f"feedback '{fb}' needs every rank's own sent mask"
    return None


def choose_route(comp: Compressor, mode: str, numel: int, size: int,
                 link: Optional[cost.LinkModel] = None, exchange: Optional[Exchange] = None,
                 model: Optional[cost.NodeModel] = None, codec: Optional[float] = None, device=None) -> str:
    """Route name for a bucket of ``numel`` elements (same inputs -> same answer on every rank).

    With ``exchange`` (the pipeline's), a multi-node job and ``hierarchy=auto`` (the default), the
    node-aware route ``"node:<inner>"`` is returned when the cost model (:func:`cost.choose_hierarchy`)
    predicts it is faster, with ``model`` or else the links the exchange measured
    (:meth:`Exchange.node_model`; ``codec``: this codec's measured elements per second). When
    Horovod cannot make the node process sets, one warning says what to pass to ``hvd.init`` and
    the flat route is used."""
    opts = route_options(comp, mode, numel, size, link, exchange, model, codec, device)
    return opts["node"] if opts["node"] is not None and opts["node_s"] < opts["flat_s"] else opts["flat"]


def route_options(comp: Compressor, mode: str, numel: int, size: int,
                  link: Optional[cost.LinkModel] = None, exchange: Optional[Exchange] = None,
                  model: Optional[cost.NodeModel] = None, codec: Optional[float] = None,
                  device=None) -> Dict[str, Any]:
    """The flat route and, where the node-aware exchange can run, the node-aware one, with the
    seconds the cost model predicts for each: ``{"flat", "flat_s", "node", "node_s"}`` (``node`` is
    None, and the times are None, when only the flat route is possible). Same on every rank."""
    flat = _choose_flat(comp, mode, numel, size, link)
    only_flat = {"flat": flat, "flat_s": None, "node": None, "node_s": None}
    hier = getattr(comp, "hierarchy", "auto")
    if hier not in HIERARCHY_CHOICES:
        raise ValueError(f"hierarchy must be one of {', '.join(HIERARCHY_CHOICES)}, got {hier!r}")
    if exchange is None or node_aware_reason(comp, exchange) is not None:
        return only_flat
    from .probe import node_links_setting
    from .transport import NodeGroupsUnavailable

    node_links_setting()  # a bad HVD_EXT_NODE_LINKS fails here, before the node groups' first collective
    try:
        exchange.node_exchanges()
    except NodeGroupsUnavailable as e:
        key = str(e)
        if key not in _warned:
            _warned.add(key)
            import warnings

            warnings.warn(f"hvd_ext: node-aware compression is off, the exchange is flat: {e}", stacklevel=4)
        return only_flat
    if model is None:
        model = exchange.node_model(device)
    if codec is not None:
        model = cost.NodeModel(intra=model.intra, inter=dataclasses.replace(model.inter, codec=codec))
    topo = exchange.topology()
    M, L = topo.cross_size, topo.local_size
    if comp.exchange == "allreduce":
        cands = ("allreduce",)
    elif mode == "allgather":
        cands = ("allgather",)
    elif mode == "twophase":
        cands = ("twophase",)
    else:
        cands = ("allgather", "twophase")
    payload = estimated_payload_bytes(comp, numel) if comp.exchange != "allreduce" else \
        numel * (2.0 if comp.name in ("fp16", "bf16") else 4.0)
    pick = cost.choose_hierarchy(cands, cands, numel, payload, M, L, model)
    inner = pick["inner"]
    if inner == "twophase":
        inner = "sparse_rs" if comp.sparse else "twophase"
    return {"flat": flat, "flat_s": float(pick["flat_s"]), "node": "node:" + inner, "node_s": float(pick["node_s"])}


def _choose_flat(comp: Compressor, mode: str, numel: int, size: int, link: Optional[cost.LinkModel]) -> str:
    if mode not in ROUTE_CHOICES:
        raise ValueError(f"exchange must be one of {', '.join(ROUTE_CHOICES)}, got {mode!r}")
    if comp.exchange == "allreduce":
        if mode != "auto":
            raise ValueError(f"compressor '{comp.name}' rides on allreduce; exchange={mode!r} is not accepted "
                             "(accepted: auto)")
        return "allreduce"
    scalable = "sparse_rs" if comp.sparse else "twophase"
    if mode == "allgather" or size < 2:
        return "allgather"
    if mode == "twophase":
        return scalable
    best = cost.choose_exchange(("allgather", "twophase"), numel, estimated_payload_bytes(comp, numel), size, link)
    return scalable if best == "twophase" else "allgather"


def make_route(kind: str, comp: Compressor, exchange: Exchange, tag: str, memory: OwnerMemory) -> Route:
    from .sparse_rs import SparseReduceScatterRoute
    from .twophase import TwoPhaseRoute

    classes = {"allreduce": AllreduceRoute, "allgather": AllgatherRoute, "twophase": TwoPhaseRoute,
               "sparse_rs": SparseReduceScatterRoute}
    if kind.startswith("node:"):
        from .hierarchical import NodeAwareRoute

        inner = kind[len("node:"):]
        if inner not in classes:
            raise ValueError(f"unknown route {kind!r}")
        return NodeAwareRoute(comp, exchange, tag, memory, inner=inner)
    return classes[kind](comp, exchange, tag, memory)
