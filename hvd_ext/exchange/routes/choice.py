"""Which route a bucket takes: from the codec's family, the spec's ``exchange=`` and ``hierarchy=``
keys and the cost model (:mod:`hvd_ext.exchange.cost`).

It depends on nothing rank-local (Horovod's local/cross sizes are the same on every rank of a
homogeneous job), so every rank builds the same routes.
"""
from __future__ import annotations

import dataclasses
import math
import warnings
from typing import Any, Dict, List, Optional, Sequence, Union

import torch

from ...compression._sparse import count_for
from ...compression.base import HIERARCHY_CHOICES, ROUTE_CHOICES, Compressor, TensorInfo
from .. import calibration, cost
from ..bucket_cost import BucketCost, Network, flat_cost, node_aware_cost
from ..core import Exchange, half_sum_kinds, sums_half_itself
from ..probe import node_links_setting
from ..transport import NodeGroupsUnavailable, horovod_elastic
from .allreduce import bucket_rounds
from .base import NODE_PREFIX, segments
from .sparse_rs import expected_wire

_warned = set()


def estimated_payload_bytes(comp: Compressor, numel: int) -> float:
    """Bytes of one rank's payload for a tensor of ``numel`` elements (:func:`estimated_bucket_bytes`)."""
    return estimated_bucket_bytes(comp, [numel])


def estimated_bucket_bytes(comp: Compressor, numels: Sequence[int]) -> float:
    """Bytes of one rank's payloads for a bucket of tensors of ``numels`` elements: exact or expected
    when the codec says (``Compressor.expected_piece_bytes``), else from its ratio."""
    sizes = comp.expected_piece_bytes(numels, [[n] for n in numels])
    if sizes is not None:
        return float(sum(s for ps in sizes for s in ps))
    numel = int(sum(numels))
    if comp.sparse:
        ratio = float(getattr(comp, "ratio", 0.01))
        vb = 2 if getattr(comp, "values", "fp32") == "fp16" else 4
        return math.ceil(ratio * numel) * (vb + 2)
    bits = float(getattr(comp, "budget", 0) or getattr(comp, "bits", 0) or 8)  # a budget replaces bits
    return numel * bits / 8.0


def sparse_rs_payload(comp: Compressor, numels: Sequence[int], size: int) -> float:
    """The payload whose two-phase bytes (:func:`hvd_ext.exchange.cost.route_wire_and_code`) are the
    sparse reduce-scatter's for a bucket of tensors of ``numels`` elements over ``size`` ranks
    (:func:`.sparse_rs.expected_wire`; k from the codec's ratio, per tensor or over the bucket as it
    selects), so the planner and ``auto`` account this route as it sends."""
    ratio = float(getattr(comp, "ratio", 0.01))
    total = int(sum(numels))
    over_bucket = getattr(comp, "scope", None) == "model" or getattr(comp, "_selects_over_bucket", lambda: False)()
    sizes = [total] if over_bucket else [int(n) for n in numels]
    wire = expected_wire(sizes, [count_for(ratio, n) for n in sizes], size, getattr(comp, "value_dtype", torch.float32))
    return wire * size / (2.0 * (size - 1)) if size > 1 else 0.0


def priced_as_pairs(comp: Compressor) -> bool:
    """Whether ``comp``'s scalable route is priced by the pairs the sparse reduce-scatter sends
    (a sparse codec with a ratio; without one its count is the data's, and its payload is measured)."""
    return bool(comp.sparse and hasattr(comp, "ratio"))


def sparse_rs_payload_on_nodes(comp: Compressor, numels: Sequence[int], nodes: int, local: int) -> float:
    """:func:`sparse_rs_payload` of the node-aware route: over each of the ``local`` ranks' shard of
    the bucket (its pieces of the tensors) across ``nodes``, the ranks' mean, as a whole bucket's
    payload (the node cost takes 1/``local`` of it)."""
    shards = segments([int(n) for n in numels], local)
    per_shard = [sparse_rs_payload(comp, [b - a for _, a, b in shard], nodes) for shard in shards]
    return local * sum(per_shard) / len(per_shard)


def route_payload(comp: Compressor, kind: str, numels: Sequence[int], size: int, local: int = 1) -> float:
    """The payload the cost model prices ``kind`` (a flat route, or the inner route across ``size``
    nodes of ``local`` ranks) with: the sparse reduce-scatter's pairs for :func:`priced_as_pairs`
    codecs on the scalable route, else the codec's own payload."""
    if kind in ("twophase", "sparse_rs") and priced_as_pairs(comp):
        if local > 1:
            return sparse_rs_payload_on_nodes(comp, numels, size, local)
        return sparse_rs_payload(comp, numels, size)
    return estimated_bucket_bytes(comp, numels)


STEADY_STEP = 10 ** 9  # a step past every codec's warm-up: the steady state, which the planner prices


def gathered_sizes(comp: Compressor, shapes: Sequence[tuple], step: int = STEADY_STEP) -> Optional[List[int]]:
    """The payload sizes an allgather of a bucket of ``shapes`` carries when every rank knows them
    from the shapes (``Compressor.payload_size``, as the route asks it: one flat record for a
    ``bucket_flat`` codec, :func:`hvd_ext.exchange.routes.flat_record`), else None (the sizes then
    travel first: an alltoall), at the codec's ``step``."""
    numels = [math.prod(s) for s in shapes]
    if comp.bucket_flat:
        infos = [TensorInfo(name="bucket", shape=torch.Size([sum(numels)]), step=step,
                            segments=[(f"t{i}", n, None) for i, n in enumerate(numels)])]
    else:
        infos = [TensorInfo(name=f"t{i}", shape=torch.Size(s), step=step) for i, s in enumerate(shapes)]
    sizes = [comp.payload_size(info) for info in infos]
    return None if any(z is None for z in sizes) else [int(z) for z in sizes]


def recoded_sizes_known(comp: Compressor, shapes: Sequence[tuple], parts: int, step: int = STEADY_STEP) -> bool:
    """Whether the two-phase route's second phase (owners' re-coded shards) is an allgather of sizes
    every rank knows: ``Compressor.payload_size(recoded=True)`` of every owner segment
    (:func:`hvd_ext.exchange.routes.base.segments`), as the route asks it; else an alltoall. A size
    follows from a segment's length and the step, so each length is asked once (N segments at N ranks)."""
    by_length = {}
    for shard in segments([math.prod(s) for s in shapes], parts):
        for i, a, b in shard:
            by_length.setdefault(b - a, (i, a, b))
    return all(recoded_size(comp, i, a, b, step) is not None for i, a, b in by_length.values())


def recoded_size(comp: Compressor, i: int, a: int, b: int, step: int = STEADY_STEP) -> Optional[int]:
    """``Compressor.payload_size(recoded=True)`` of the owner segment [a, b) of tensor ``i``."""
    return comp.payload_size(TensorInfo(name=f"t{i}@{a}:owner", shape=torch.Size([b - a]), step=step),
                             recoded=True)


def sizes_known(comp: Compressor, shapes: Sequence[tuple], route: str, parts: int,
                step: int = STEADY_STEP) -> bool:
    """Whether ``route``'s gather over ``parts`` ranks carries sizes every rank knows (then an
    allgather, else an alltoall: :func:`hvd_ext.exchange.cost.route_collectives`)."""
    if route == "allgather":
        return gathered_sizes(comp, shapes, step) is not None
    if route == "twophase":
        return recoded_sizes_known(comp, shapes, parts, step)
    return True  # an allreduce, or the sparse reduce-scatter (two alltoalls whatever the sizes)


def flat_terms(comp: Compressor, shapes: Sequence[tuple], route: str, size: int, device_type: str,
               step: int = STEADY_STEP) -> Dict[str, Any]:
    """What a bucket of ``shapes`` coded by ``comp`` runs on the flat ``route`` over ``size`` ranks at
    the codec's ``step``, as :func:`hvd_ext.exchange.bucket_cost.flat_cost` takes it: ``sizes_known``
    (its gathers carry sizes every rank knows, else they are alltoalls), ``rounds`` (the allreduce
    rounds, :func:`.allreduce.bucket_rounds`) and ``collectives`` (one round's where they are not the
    route's own: the alltoall and allgather of a half-precision sum the exchange does itself on
    ``device_type``, :func:`hvd_ext.exchange.core.sums_half_itself`; else None)."""
    if route != "allreduce":
        return {"sizes_known": sizes_known(comp, shapes, route, size, step), "rounds": 1, "collectives": None}
    half = sums_half_itself(comp.wire_dtype or torch.float32, device_type, size)
    return {"sizes_known": True, "rounds": bucket_rounds(comp, shapes, step),
            "collectives": half_sum_kinds(size, sum(math.prod(s) for s in shapes)) if half else None}


def flat_routes(comp: Compressor, mode: Optional[str] = None, size: int = 2) -> List[str]:
    """The flat routes ``comp`` may take over ``size`` ranks with route mode ``mode`` (default: its
    ``route=``): the allreduce for a codec that rides on it; else the allgather and the scalable route
    (the sparse reduce-scatter for a sparse codec), or the one ``mode`` names; at one rank the
    allgather alone (nothing is cut into shards)."""
    mode = comp.route if mode is None else mode
    if mode not in ROUTE_CHOICES:
        raise ValueError(f"exchange must be one of {', '.join(ROUTE_CHOICES)}, got {mode!r}")
    if comp.collective == "allreduce":
        if mode != "auto":
            raise ValueError(f"compressor '{comp.name}' rides on allreduce; exchange={mode!r} is not accepted "
                             "(accepted: auto)")
        return ["allreduce"]
    if size < 2 or mode == "allgather":
        return ["allgather"]
    scalable = "sparse_rs" if comp.sparse else "twophase"
    return [scalable] if mode == "twophase" else ["allgather", scalable]


def bucket_routes(comp: Compressor, size: int, node_aware: bool, mode: Optional[str] = None) -> List[str]:
    """Every route a bucket under ``comp`` may take: :func:`flat_routes`, then, where ``node_aware``
    (the node-aware exchange can run), each of them as the inner route across nodes."""
    flat = flat_routes(comp, mode, size)
    return flat + ([NODE_PREFIX + r for r in flat] if node_aware else [])


def route_cost(comp: Compressor, kind: str, shapes: Sequence[tuple], payload: float, enc: float, dec: float,
               net: Network, device_type: str, step: int = STEADY_STEP) -> BucketCost:
    """A bucket of ``shapes`` coded by ``comp`` (``payload`` bytes per rank, ``enc`` / ``dec`` seconds
    per pass) on ``kind`` (a flat route, or ``node:<inner>``) over ``net``, as
    :mod:`hvd_ext.exchange.bucket_cost` prices it: the sparse reduce-scatter's pairs where they travel
    instead of the codec's payload (:func:`priced_as_pairs`), a flat route's collectives as
    :func:`flat_terms` lists them. ``compression="auto"`` and the fixed codecs' route choice
    (:func:`route_options`) both price with it."""
    numels = [math.prod(s) for s in shapes]
    across = kind.startswith(NODE_PREFIX)
    inner = kind[len(NODE_PREFIX):] if across else kind
    if inner == "sparse_rs" and priced_as_pairs(comp):
        payload = route_payload(comp, inner, numels, *((net.nodes, net.local) if across else (net.size,)))
    if across:
        return node_aware_cost(inner, sum(numels), payload, enc, dec, net)
    return flat_cost(kind, sum(numels), payload, enc, dec, net,
                     **flat_terms(comp, shapes, kind, net.size, device_type, step))


def fastest_route(seconds: Dict[str, float]) -> str:
    """The route of least ``seconds`` (ties, within float noise: the first listed)."""
    best = None
    for kind, t in seconds.items():
        if best is None or t < seconds[best] - 1e-15:
            best = kind
    return best


def node_aware_reason(comp: Compressor, exchange: Optional[Exchange]) -> Optional[str]:
    """None when the node-aware exchange can carry this compressor over ``exchange``'s nodes;
    else why not (the same on every rank)."""
    if comp.hierarchy == "flat":
        return "hierarchy=flat"
    if horovod_elastic():
        return "elastic job: the node layout can change, and no collective may run at construction"
    topo = exchange.topology() if exchange is not None else None
    if topo is None or not topo.multi_node:
        return "one node, one rank per node, or nodes of different sizes"
    return codec_node_aware_reason(comp)


def codec_node_aware_reason(comp: Compressor) -> Optional[str]:
    """The codec's own part of :func:`node_aware_reason`: None when its payloads and feedback allow
    the node-aware exchange on some cluster (the planner asks this without a job)."""
    if comp.hierarchy == "flat":
        return "hierarchy=flat"
    if comp.collective == "allreduce" and not comp.shardable:
        return f"'{comp.name}' payloads cannot be cut into shards"
    fb = comp.feedback
    if fb is not None and not fb.node_level:
        return f"feedback '{fb.name}' needs every rank's own sent mask"
    return None


def choose_route(comp: Compressor, mode: str, numel: Union[int, Sequence[int]], size: int,
                 link: Optional[cost.LinkModel] = None, exchange: Optional[Exchange] = None,
                 model: Optional[cost.NodeModel] = None, codec: Optional[float] = None, device=None) -> str:
    """Route name for a bucket of ``numel`` elements, or of tensors of these sizes: the fastest of
    :func:`route_options` (same inputs -> same answer on every rank). With ``exchange`` (the
    pipeline's), a multi-node job and ``hierarchy=auto`` (the default), that may be the node-aware
    route ``"node:<inner>"``. When Horovod cannot make the node process sets, one warning says what
    to pass to ``hvd.init`` and the flat route is used."""
    opts = route_options(comp, mode, numel, size, link, exchange, model, codec, device)
    return opts["node"] if opts["node"] is not None and opts["node_s"] < opts["flat_s"] else opts["flat"]


def route_options(comp: Compressor, mode: str, numel: Union[int, Sequence[int]], size: int,
                  link: Optional[cost.LinkModel] = None, exchange: Optional[Exchange] = None,
                  model: Optional[cost.NodeModel] = None, codec: Optional[float] = None,
                  device=None) -> Dict[str, Any]:
    """The fastest flat route and, where the node-aware exchange can run, the fastest node-aware one,
    with the seconds :func:`route_cost` gives each: ``{"flat", "flat_s", "node", "node_s"}`` (``node``
    and ``node_s`` are None where only flat routes can run). Priced before any step has run, on
    :func:`route_network`, with the codec's payload estimated from the sizes
    (:func:`estimated_bucket_bytes`; a codec on the allreduce: its wire dtype) and its passes at
    ``codec`` elements/s, else the speed the calibration file timed for it, else the link's (none for a
    gradient sent as it is). Same on every rank."""
    sizes = tensor_sizes(numel)
    flat = flat_routes(comp, mode, size)
    if comp.hierarchy not in HIERARCHY_CHOICES:
        raise ValueError(f"hierarchy must be one of {', '.join(HIERARCHY_CHOICES)}, got {comp.hierarchy!r}")
    links = None
    if exchange is not None and node_aware_reason(comp, exchange) is None:
        links = node_links(exchange, device, model, stacklevel=5)
    cal = calibration.from_env()
    net = route_network(size, link, links, exchange.topology() if links is not None else None, cal)
    timed = calibration.codec_speed(cal, comp.spec(), comp.codec_spec(), comp.name) if cal else None
    speed = codec or timed or net.link().codec
    if comp.lossless and comp.wire_dtype == torch.float32:
        speed = math.inf  # the gradient goes as it is: nothing to code
    n = sum(sizes)
    if comp.collective == "allreduce":
        payload = n * float(comp.wire_dtype.itemsize if comp.wire_dtype is not None else 4)
    else:
        payload = estimated_bucket_bytes(comp, sizes)
    enc = dec = n / speed
    kind = torch.device(device).type if device is not None else "cpu"
    shapes = [(k,) for k in sizes]
    times = {r: route_cost(comp, r, shapes, payload, enc, dec, net, kind).seconds
             for r in bucket_routes(comp, size, links is not None, mode)}
    best_flat = fastest_route({r: times[r] for r in flat})
    if links is None:
        return {"flat": best_flat, "flat_s": float(times[best_flat]), "node": None, "node_s": None}
    best_node = fastest_route({NODE_PREFIX + r: times[NODE_PREFIX + r] for r in flat})
    return {"flat": best_flat, "flat_s": float(times[best_flat]), "node": best_node,
            "node_s": float(times[best_node])}


def route_network(size: int, link: Optional[cost.LinkModel], links: Optional[cost.NodeModel], topo,
                  cal: Optional[Dict[str, Any]]) -> Network:
    """The network a fixed codec's routes are priced on before any step (no probe has run): across
    nodes (``links``, over ``topo``'s nodes) the node links; else one link: ``link``, else the flat
    link the calibration file measured on this world, else the cost model's default. Each
    collective's fixed cost is the file's where it timed this world
    (:func:`hvd_ext.exchange.calibration.collective_latencies`), as ``compression="auto"`` and the
    planner take it."""
    if links is not None:
        M, L = topo.cross_size, topo.local_size
        first, then = calibration.collective_latencies(cal, size, M, L) or ({}, {})
        return Network(M, L, links.intra, links.inter, first, then,
                       calibration.node_latencies(cal, size, M, L), links.tree)
    first, then = calibration.collective_latencies(cal, size) or ({}, {})
    measured = calibration.flat_link(cal, size)
    if link is None and measured is not None:
        return Network.one_link(size, measured["lat"], measured["bandwidth"], first, then)
    link = link or cost.LinkModel()
    return Network(1, size, link, link, first, then)


def node_links(exchange: Exchange, device=None, model: Optional[cost.NodeModel] = None,
               stacklevel: int = 4) -> Optional[cost.NodeModel]:
    """The intra- and inter-node links a node-aware route runs over (``model``, else
    :meth:`Exchange.node_model`; on a GPU with NCCL's trees), or None where no node-aware route can
    run: one node, nodes of different sizes, an elastic job, or node process sets Horovod cannot make
    (one warning says what to pass to ``hvd.init``). Collective the first time (the node groups); the
    same on every rank."""
    topo = exchange.topology()
    if horovod_elastic() or topo is None or not topo.multi_node:
        return None
    node_links_setting()  # a bad HVD_EXT_NODE_LINKS fails here, before the node groups' first collective
    try:
        exchange.node_exchanges()
    except NodeGroupsUnavailable as e:
        key = str(e)
        if key not in _warned:
            _warned.add(key)
            warnings.warn(f"hvd_ext: node-aware compression is off, the exchange is flat: {e}", stacklevel=stacklevel)
        return None
    model = model or exchange.node_model(device)
    if device is not None and torch.device(device).type == "cuda":
        model = dataclasses.replace(model, tree=True)   # Horovod's allreduce of GPU tensors: NCCL's
    return model


def tensor_sizes(numel: Union[int, Sequence[int]]) -> List[int]:
    """A bucket's tensor sizes: ``numel`` itself, or one tensor of ``numel`` elements."""
    return [int(numel)] if isinstance(numel, int) else [int(n) for n in numel]
