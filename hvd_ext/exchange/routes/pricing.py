"""What a bucket costs on a route, before it runs: its payload bytes, the collectives it makes, its
codec calls, and their price on a network (:func:`route_cost`, over :mod:`hvd_ext.exchange.bucket_cost`).

``compression="auto"``, a fixed codec's route choice (:mod:`.choice`) and the planner
(:mod:`hvd_ext.plan`) all price with these, so that fed the same numbers they choose alike.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Dict, List, Optional, Sequence

import torch

from ...compression._sparse import count_for
from ...compression.base import Compressor, TensorInfo
from .. import calibration
from ..bucket_cost import BucketCost, Network, flat_cost, node_aware_cost
from ..core import frame_size, half_sum_kinds, sums_half_itself
from .allreduce import bucket_rounds
from .base import NODE_PREFIX, segments, sends_flat
from .sparse_rs import expected_wire


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


def tensor_payload(comp: Compressor, shape: tuple) -> float:
    """One tensor's payload bytes: the codec's exact size where it has one (PowerSGD's from the
    matrix shape), else :func:`estimated_payload_bytes`."""
    n = math.prod(shape)
    if hasattr(comp, "wire_bytes_for"):
        return float(comp.wire_bytes_for(shape))
    if comp.collective == "allreduce":
        return float(comp.wire_bytes(n) or n * (comp.wire_dtype.itemsize if comp.wire_dtype is not None else 4))
    return float(estimated_payload_bytes(comp, n))


def payload_bytes(comp: Compressor, shapes: Sequence[tuple], route: str, parts: int, local: int = 1) -> float:
    """One rank's bytes for a bucket of tensors of ``shapes`` on ``route`` (over ``parts`` ranks):
    an allreduce carries the payloads bare; the allgather one frame (:func:`hvd_ext.exchange.core.frame_size`:
    flag, count and lengths ahead of the payloads); the two-phase route cuts the bucket into
    ``parts`` shards coded per segment (:func:`.base.segments`), one
    frame each, every frame with as many slots as the fullest shard; the sparse reduce-scatter as
    :func:`sparse_payload` (``local``: ranks per node, for its node-aware route)."""
    if comp.collective == "allreduce":
        return float(sum(tensor_payload(comp, s) for s in shapes))
    if route.endswith("sparse_rs"):
        return sparse_payload(comp, shapes, route, parts, local)
    numels = [math.prod(s) for s in shapes]
    if (route.endswith("twophase") and parts > 1
            and comp.expected_piece_bytes(numels, [[n] for n in numels]) is not None):
        return twophase_payload(comp, shapes, parts)
    sizes = gathered_sizes(comp, shapes) if route.endswith("allgather") else None
    if sizes is not None:
        return float(frame_size(sizes))
    if comp.expected_piece_bytes(numels, [[n] for n in numels]) is not None:
        return estimated_bucket_bytes(comp, numels)   # sizes the data decide, over the bucket
    return float(sum(tensor_payload(comp, s) for s in shapes))


def twophase_payload(comp: Compressor, shapes: Sequence[tuple], parts: int) -> float:
    """The two-phase route's bytes as a payload (its wire is 2(N-1)/N x this): each phase sends every
    shard as one frame, every frame with as many slots as the fullest shard (empty ones: 0 bytes); the
    first phase's segments at the codec's size (``Compressor.expected_piece_bytes``, each tensor cut
    into its segments), the owners' re-coded ones at ``payload_size(recoded=True)`` where every rank
    knows it (qdist under a budget re-codes at whole bits). Uneven shards load the alltoall unevenly:
    priced by the ranks' mean of what each link carries."""
    numels = [math.prod(s) for s in shapes]
    if parts < 2:   # one rank: nothing is exchanged in pieces
        return estimated_bucket_bytes(comp, numels)
    shards = segments(numels, parts)
    width = max(len(shard) for shard in shards)
    pieces: List[List[int]] = [[] for _ in numels]
    for shard in shards:
        for i, a, b in shard:
            pieces[i].append(b - a)
    expected = comp.expected_piece_bytes(numels, pieces)
    first, seen = {}, [0] * len(numels)
    for shard in shards:
        for i, a, b in shard:
            first[(i, a)] = expected[i][seen[i]]
            seen[i] += 1

    def frames(size_of) -> List[int]:
        return [frame_size([int(round(size_of(i, a, b))) for i, a, b in shard] + [0] * (width - len(shard)))
                for shard in shards]

    def owner(i: int, a: int, b: int) -> float:
        known = recoded_size(comp, i, a, b)
        return first[(i, a)] if known is None else known

    # the alltoall: rank j receives N-1 frames of shard j and sends one of every other shard, and a
    # link is busy for the larger of the two (cost.alltoall_wire); the allgather: all frames but its own
    f1, f2 = frames(lambda i, a, b: first[(i, a)]), frames(owner)
    alltoall = sum(max(sum(f1) - f, (parts - 1) * f) for f in f1) / parts
    return (alltoall * parts / (parts - 1) + sum(f2)) / 2.0


def sparse_payload(comp: Compressor, shapes: Sequence[tuple], route: str, parts: int, local: int) -> float:
    """The sparse reduce-scatter's bytes as a payload (:func:`route_payload`):
    flat, over the bucket's tensors; node-aware, over each of the ``local`` ranks' shard of the bucket."""
    return route_payload(comp, "sparse_rs", [math.prod(s) for s in shapes], parts,
                         local if route.startswith("node:") else 1)


def route_cost(comp: Compressor, kind: str, shapes: Sequence[tuple], payload: float, enc: float, dec: float,
               net: Network, device_type: str, step: int = STEADY_STEP, later: float = 0.0,
               fuse: Optional[str] = None, overhead: float = 0.0) -> BucketCost:
    """A bucket of ``shapes`` coded by ``comp`` (``payload`` bytes per rank, ``enc`` / ``dec`` seconds
    per pass) on ``kind`` (a flat route, or ``node:<inner>``) over ``net``, as
    :mod:`hvd_ext.exchange.bucket_cost` prices it: the sparse reduce-scatter's pairs where they travel
    instead of the codec's payload (:func:`priced_as_pairs`), a flat route's collectives as
    :func:`flat_terms` lists them; ``later`` and ``fuse`` as
    :func:`hvd_ext.exchange.bucket_cost.flat_cost` takes them (the planner's); ``overhead``: the route's
    host work beyond the codec's passes (:meth:`hvd_ext.exchange.calibration.CodecTiming.overhead_seconds`),
    added to the codec seconds. ``compression="auto"``, the fixed codecs' route choice
    (:func:`.choice.route_options`) and the planner price with it."""
    numels = [math.prod(s) for s in shapes]
    across = kind.startswith(NODE_PREFIX)
    inner = kind[len(NODE_PREFIX):] if across else kind
    if inner == "sparse_rs" and priced_as_pairs(comp):
        payload = route_payload(comp, inner, numels, *((net.nodes, net.local) if across else (net.size,)))
    if across:
        cost = node_aware_cost(inner, sum(numels), payload, enc, dec, net)
    else:
        cost = flat_cost(kind, sum(numels), payload, enc, dec, net, later=later, fuse=fuse,
                         **flat_terms(comp, shapes, kind, net.size, device_type, step))
    return dataclasses.replace(cost, code=cost.code + overhead) if overhead else cost


def route_calls(comp: Compressor, numels: Sequence[int], route: str, parts: int) -> List[int]:
    """The elements of each codec call one rank makes for records of ``numels`` on the flat ``route``
    over ``parts`` ranks: one flat record where the route sends one
    (:func:`hvd_ext.exchange.routes.base.sends_flat`), else one per record; the two-phase route codes
    each record's piece of each shard (:func:`hvd_ext.exchange.routes.base.segments`)."""
    numels = [int(n) for n in numels]
    if sends_flat(comp, route):
        numels = [sum(numels)]
    if route == "twophase" and parts > 1:
        return [b - a for shard in segments(numels, parts) for _, a, b in shard]
    return numels


def codec_calls(comp: Compressor, shapes: Sequence[tuple], route: str, parts: int, local: int = 1) -> List[int]:
    """The elements of each codec call of one pass over a bucket of ``shapes`` on ``route`` (over
    ``parts`` ranks, or nodes): one rank's (:func:`route_calls`); on the node-aware route the calls
    of all ``local`` ranks of a node, each coding the tensors' pieces of its shard of the bucket on
    the inner route across the nodes (:func:`hvd_ext.exchange.bucket_cost.node_aware_cost` takes a rank's
    1/L)."""
    numels = [math.prod(s) for s in shapes]
    if not route.startswith("node:"):
        return route_calls(comp, numels, route, parts)
    return [k for shard in segments(numels, local) for k in route_calls(comp, [b - a for _, a, b in shard],
                                                                         route[5:], parts)]


def pass_seconds(comp: Compressor, shapes: Sequence[tuple], route: str, parts: int, local: int,
                 timing: calibration.CodecTiming) -> float:
    """Seconds of one encode (or decode) pass over a bucket of ``shapes`` on ``route``: each of its
    codec calls (:func:`codec_calls`) at its own size, as ``timing`` prices a call."""
    return sum(timing.seconds(k) for k in codec_calls(comp, shapes, route, parts, local))
