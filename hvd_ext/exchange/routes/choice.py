"""Which route a bucket takes: from the codec's family, the spec's ``exchange=`` and ``hierarchy=``
keys and each route's price (:mod:`.pricing`).

It depends on nothing rank-local (Horovod's local/cross sizes are the same on every rank of a
homogeneous job), so every rank builds the same routes.
"""
from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Dict, List, Optional, Sequence, Union

import torch

from ...compression.base import HIERARCHY_CHOICES, ROUTE_CHOICES, Compressor
from .. import calibration, codec_speed, cost
from ..bucket_cost import Network
from ..core import Exchange
from ..probe import node_links_setting
from ..transport import NodeGroupsUnavailable, horovod_elastic
from .base import NODE_PREFIX
from .pricing import pass_seconds, payload_bytes, route_cost

_warned = set()


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


def choose_route(comp: Compressor, mode: str, shapes: Union[int, Sequence[int], Sequence[tuple]], size: int,
                 link: Optional[cost.LinkModel] = None, exchange: Optional[Exchange] = None,
                 model: Optional[cost.NodeModel] = None, codec: Optional[float] = None, device=None) -> str:
    """Route name for a bucket of tensors of ``shapes`` (or of element counts; an int: one tensor):
    the fastest of :func:`route_options` (same inputs -> same answer on every rank). With ``exchange``
    (the pipeline's), a multi-node job and ``hierarchy=auto`` (the default), that may be the
    node-aware route ``"node:<inner>"``. When Horovod cannot make the node process sets, one warning
    says what to pass to ``hvd.init`` and the flat route is used."""
    return fastest_option(route_options(comp, mode, shapes, size, link, exchange, model, codec, device))


def fastest_option(opts: Dict[str, Any]) -> str:
    """Of :func:`route_options`' answer, the node-aware route where it is faster, else the flat one."""
    return opts["node"] if opts["node"] is not None and opts["node_s"] < opts["flat_s"] else opts["flat"]


def route_options(comp: Compressor, mode: str, shapes: Union[int, Sequence[int], Sequence[tuple]], size: int,
                  link: Optional[cost.LinkModel] = None, exchange: Optional[Exchange] = None,
                  model: Optional[cost.NodeModel] = None, codec: Optional[float] = None,
                  device=None) -> Dict[str, Any]:
    """The fastest flat route and, where the node-aware exchange can run, the fastest node-aware one,
    with the seconds :func:`.pricing.route_cost` gives each: ``{"flat", "flat_s", "node", "node_s"}``
    (``node`` and ``node_s`` are None where only flat routes can run). Priced before any step has run,
    on :func:`route_network`, each route's payload as the planner prices it
    (:func:`.pricing.payload_bytes`) and each codec call by :func:`job_codec_timing`. Same on every
    rank."""
    shapes = tensor_shapes(shapes)
    flat = flat_routes(comp, mode, size)
    if comp.hierarchy not in HIERARCHY_CHOICES:
        raise ValueError(f"hierarchy must be one of {', '.join(HIERARCHY_CHOICES)}, got {comp.hierarchy!r}")
    links = None
    if exchange is not None and node_aware_reason(comp, exchange) is None:
        links = node_links(exchange, device, model, stacklevel=5)
    cal = calibration.usable_from_env()  # under elastic before the ranks compared their files
    # the nodes only where their links price the routes (a DDP hook's topology is a collective the first time)
    topo = exchange.topology() if exchange is not None and (links is not None or cal is not None) else None
    net = route_network(size, link, links, topo, cal)
    kind = torch.device(device).type if device is not None else "cpu"
    if net.nodes > 1 and kind == "cuda":
        net.allreduce_tree = True   # Horovod's allreduce of GPU tensors: NCCL's trees (as node_links sets)
    timing = job_codec_timing(comp, cal, codec, device, size, *calibration.node_layout(topo))
    times = {}
    for r in bucket_routes(comp, size, links is not None, mode):
        parts = net.nodes if r.startswith(NODE_PREFIX) else size
        passes = pass_seconds(comp, shapes, r, parts, net.local, timing)
        payload = payload_bytes(comp, shapes, r, parts, net.local)
        times[r] = route_cost(comp, r, shapes, payload, passes, passes, net, kind,
                              overhead=timing.overhead_seconds(r, shapes, net.local)).seconds
    best_flat = fastest_route({r: times[r] for r in flat})
    if links is None:
        return {"flat": best_flat, "flat_s": float(times[best_flat]), "node": None, "node_s": None}
    best_node = fastest_route({NODE_PREFIX + r: times[NODE_PREFIX + r] for r in flat})
    return {"flat": best_flat, "flat_s": float(times[best_flat]), "node": best_node,
            "node_s": float(times[best_node])}


def job_codec_timing(comp: Compressor, cal: Optional[Dict[str, Any]], codec: Optional[float],
                     device=None, ranks: Optional[int] = None, nodes: Optional[int] = None,
                     local: Optional[int] = None) -> calibration.CodecTiming:
    """How a job of ``ranks`` (``nodes`` x ``local``) prices ``comp``'s codec calls before it has run
    them: at ``codec`` elements/s where given, else as the calibration file timed the codec
    (:func:`hvd_ext.exchange.calibration.codec_timing` under its spec, its own spec, its family, as the
    planner looks it up; its routes' overhead where the file timed this world), else at its family's
    speed on ``device``
    (:func:`hvd_ext.exchange.codec_speed.pass_speed`, the planner's default too; the same on every
    rank). A link's own ``codec`` figure is not used."""
    if codec:
        return calibration.CodecTiming(codec)
    timed = calibration.codec_timing(cal, comp.spec(), comp.codec_spec(), comp.name, ranks=ranks, nodes=nodes,
                                       local=local) if cal else None
    if timed is not None:
        return timed
    return calibration.CodecTiming(codec_speed.pass_speed(comp.name, device))


def route_network(size: int, link: Optional[cost.LinkModel], links: Optional[cost.NodeModel], topo,
                  cal: Optional[Dict[str, Any]]) -> Network:
    """The network a fixed codec's routes are priced on before any step (no probe has run): across
    ``topo``'s nodes their links (``links``, where a node-aware route can run; else the calibration
    file's, where it timed this world); else one link: ``link``, else the file's flat link for this
    world, else the cost model's default. Each collective's fixed cost is the file's where it timed
    this world (:func:`hvd_ext.exchange.calibration.collective_latencies`), as ``compression="auto"``
    and the planner take it."""
    if topo is not None and topo.multi_node:
        M, L = topo.cross_size, topo.local_size
        if links is None and calibration.timed_here(cal, size, M, L):
            links = calibration.node_model(cal)
        if links is not None:
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


def tensor_shapes(shapes: Union[int, Sequence[int], Sequence[tuple]]) -> List[tuple]:
    """A bucket's tensor shapes: ``shapes`` itself (a ``torch.Size``: one tensor), one 1-D tensor per
    element count, or one tensor of an int's elements."""
    if isinstance(shapes, int):
        return [(shapes,)]
    if isinstance(shapes, torch.Size):
        return [tuple(shapes)]
    return [tuple(s) if isinstance(s, (tuple, list, torch.Size)) else (int(s),) for s in shapes]
