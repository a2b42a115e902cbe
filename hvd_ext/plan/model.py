"""The planner's step-time model: every method's predicted exchange and step time on one cluster.

Per bucket (:func:`hvd_ext.pipeline.plan_buckets`, the layout the optimizer uses; Horovod's own
rows: per tensor) and method, the exchange costs

    messages x alpha + bytes on the busiest link / bandwidth + codec seconds

as :mod:`hvd_ext.exchange.bucket_cost` prices a route, the price ``compression="auto"`` takes too
(a calibration's measured latencies replace messages x alpha; on GPUs an allreduce's messages are
NCCL's tree's where less). Across nodes the flat routes' node NIC carries the off-node part of its
L ranks' traffic; the node-aware route (Horovod's hierarchical allreduce for dense rows) reduces
densely inside the node and runs the codec's route on a 1/L shard across nodes. This module adds
what the job does around it: the buckets' payloads and codec calls, Horovod's own rows, fusion and
the overlap with backward.

Horovod's background thread fuses the allreduces (and gathers) that are ready together, hvd_ext's
buckets as its own tensors (:func:`fused_groups`): a fused group pays the collective's fixed cost
once. Step time overlaps the exchange with backward as the optimizer's hooks do: forward is a third
of ``compute_s``, backward releases buckets in order in proportion to their size, the link takes one
group at a time, and the step ends when both compute and the last exchange have; a codec's later
allreduce rounds (PowerSGD's second) start only once backward is over. On a GPU the
codec runs beside compute (its own stream); on a CPU it runs on the core that computes, so it
delays the buckets behind it (``codec_on_compute``).
"""
from __future__ import annotations

import dataclasses
import functools
import math
import warnings
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

import torch

from ..compression.base import Compressor, TensorInfo
from ..exchange.bucket_cost import BucketCost, Network, flat_cost, node_aware_cost
from ..exchange.calibration import CodecTiming
from ..exchange.routes import (STEADY_STEP, bucket_routes, codec_node_aware_reason, pass_seconds, payload_bytes,
                               route_cost)
from ..pipeline import FIRST_BUCKET_BYTES, plan_buckets
from ..spec import compression_from_spec

# Horovod's defaults since 0.21 (its changelog; `horovodrun --help` of 0.28.1 says the same)
HOROVOD_FUSION_BYTES = 128 * 1024 * 1024  # HOROVOD_FUSION_THRESHOLD
HOROVOD_CYCLE_S = 1e-3                     # HOROVOD_CYCLE_TIME


@dataclass
class Cluster(Network):
    """A :class:`hvd_ext.exchange.bucket_cost.Network` (``nodes`` x ``local`` ranks, the links, each
    collective's measured fixed seconds) with the device's codecs and Horovod's own allreduce:
    ``codec``: elements per second of one encode or decode pass, per spec or codec family, on the
    device, and ``codec_fixed`` its fixed seconds per pass; ``codec_on_compute``: the codec shares the
    compute engine (a CPU); ``horovod_lat`` / ``horovod_slowdown``: where Horovod's own allreduce
    waits otherwise than hvd_ext's (ranks share cores, :mod:`hvd_ext.exchange.waiting`), its measured
    fixed seconds and how many times slower it moves bytes than the flat link (:func:`horovod_view`);
    ``horovod_fp16_slowdown``: how many times slower per byte Horovod's float16 allreduce is than its
    float32 one (measured); ``codec_compiled``: on a CPU, the elements per second of a codec call of
    ``compile_min`` elements or more, which runs compiled (``codec``: the smaller, eager ones);
    ``route_overhead``: per codec, its routes' host work beyond the passes (measured in this world,
    :mod:`hvd_ext.plan.route_overhead`)."""

    codec: Dict[str, float] = field(default_factory=dict)
    codec_on_compute: bool = False
    codec_fixed: Dict[str, float] = field(default_factory=dict)  # seconds per pass whatever the size
    horovod_lat: Optional[float] = None
    horovod_slowdown: float = 1.0
    horovod_fp16_slowdown: float = 1.0
    codec_compiled: Dict[str, float] = field(default_factory=dict)  # elements/s of a call of compile_min or more
    compile_min: Optional[int] = None
    route_overhead: Dict[str, Dict[str, List[float]]] = field(default_factory=dict)  # per codec: CodecTiming's


def buckets_of(shapes: Sequence[tuple], bucket_bytes: int, first_bytes: Optional[int]) -> List[List[tuple]]:
    """The tensor shapes of each bucket the optimizer forms over tensors of ``shapes`` (registration
    order), in the order backward releases them."""
    named = [(str(i), torch.empty(tuple(s), device="meta")) for i, s in enumerate(shapes)]
    return [[tuple(shapes[i]) for i in b] for b in plan_buckets(named, bucket_bytes, first_bytes)]


def numel_of(shapes: Sequence[tuple]) -> int:
    return sum(math.prod(s) for s in shapes)


def family(spec: str) -> str:
    return spec.split(":", 1)[0]


@functools.lru_cache(maxsize=None)
def codec_keys(spec: str) -> tuple:
    """The keys ``spec``'s codec speed is looked up by, in turn: the spec as written, its codec's own
    (:meth:`hvd_ext.compression.base.Compressor.codec_spec`, the key ``--measure`` writes and a job
    looks up), its family."""
    return tuple(dict.fromkeys((spec, compression_from_spec(spec).codec_spec(), family(spec))))


def lookup(table: Dict[str, float], spec: str, default=None):
    return next((table[k] for k in codec_keys(spec) if k in table), default)


def codec_timing(spec: str, cluster: Cluster) -> CodecTiming:
    """``spec``'s pass on the cluster's device (:class:`hvd_ext.exchange.calibration.CodecTiming`)."""
    speed = lookup(cluster.codec, spec)
    if speed is None or speed <= 0:
        raise ValueError(f"plan: no codec speed for {spec!r}; give one (--measure, or the table in "
                         "hvd_ext.plan.presets)")
    return CodecTiming(speed, lookup(cluster.codec_fixed, spec, 0.0), lookup(cluster.codec_compiled, spec),
                       cluster.compile_min, lookup(cluster.route_overhead, spec))


def codec_seconds(spec: str, numel: int, cluster: Cluster) -> float:
    """Seconds of one encode (or decode) call on ``numel`` elements (at the compiled speed where
    the calibration measured one and the call is large enough to run compiled)."""
    return codec_timing(spec, cluster).seconds(numel)


@dataclass
class Row:
    """One method's prediction: ``label``, ``spec`` (None for Horovod's rows), ``route``, per step
    ``wire`` bytes per rank, ``nic`` bytes on the busiest link, ``exchange_s`` (link + codec time of
    all collectives) and ``step_s``; ``buckets``: the cost of each of the method's buckets (Horovod's:
    of each tensor), ``groups``: of each collective as Horovod runs them, fused (:func:`fused_groups`);
    ``picks``: ``auto``'s row only, each bucket's codec and route, ``"spec (route)"``."""

    label: str
    spec: Optional[str]
    route: str
    wire: float
    nic: float
    exchange_s: float
    step_s: float
    buckets: List[BucketCost] = field(repr=False, default_factory=list)
    groups: List[BucketCost] = field(repr=False, default_factory=list)
    note: str = ""
    picks: List[str] = field(default_factory=list)


def step_seconds(bucket_costs: Sequence[BucketCost], compute_s: float, codec_on_compute: bool) -> float:
    """The overlapped step (module doc): buckets leave backward in order, the link takes one at a time;
    a bucket's ``tail_s`` (its later rounds) waits for backward's end, queued behind every first round."""
    forward, backward = compute_s / 3.0, 2.0 * compute_s / 3.0
    total = sum(b.numel for b in bucket_costs) or 1
    t, free = forward, 0.0
    for b in bucket_costs:
        t += backward * b.numel / total
        if codec_on_compute:
            t += b.code
            busy = b.link_s
        else:
            busy = b.link_s + b.code
        free = max(t, free) + busy - b.tail_s
    # later rounds start once backward is over, queued behind every bucket's first
    return max(t, free) + sum(b.tail_s for b in bucket_costs)


def make_row(label: str, spec: Optional[str], route: str, costs: List[BucketCost], compute_s: float,
             c: Cluster, note: str = "") -> Row:
    """The row of a method whose buckets (Horovod: tensors) cost ``costs``, fused as Horovod fuses them."""
    groups = fused_groups(costs, compute_s, c.codec_on_compute)
    return Row(label, spec, route, sum(b.wire for b in costs), sum(b.nic for b in costs),
               sum(g.seconds for g in groups), step_seconds(groups, compute_s, c.codec_on_compute), costs, groups,
               note)


def horovod_view(c: Cluster, fp16: bool = False) -> Cluster:
    """The cluster as Horovod's own (``fp16``: float16) allreduce sees it: with its measured latency, and
    every link slowed as its measured flat allreduce was (``c`` itself where nothing was measured)."""
    slow = max(c.horovod_slowdown * (c.horovod_fp16_slowdown if fp16 else 1.0), 1e-9)
    if c.horovod_lat is None and slow == 1.0:
        return c
    lat = c.collective_lat
    if c.horovod_lat is not None and lat:
        lat = {**lat, "allreduce": c.horovod_lat}
    return dataclasses.replace(
        c, intra=dataclasses.replace(c.intra, bandwidth=c.intra.bandwidth / slow),
        inter=dataclasses.replace(c.inter, bandwidth=c.inter.bandwidth / slow), collective_lat=lat)


def fused(costs: Sequence[BucketCost]) -> BucketCost:
    """Collectives Horovod runs as one: their bytes and codec time add up, each round's fixed cost is
    paid once."""
    if len(costs) == 1:
        return costs[0]
    later = max(b.tail_lat for b in costs)
    lat = max(b.latency - b.tail_lat for b in costs) + later
    return BucketCost(sum(b.numel for b in costs), sum(b.wire for b in costs), sum(b.nic for b in costs), lat,
                      sum(b.code for b in costs), sum(b.link_s - b.latency for b in costs) + lat,
                      sum(b.tail_s - b.tail_lat for b in costs) + later, later, costs[0].fuse,
                      sum(b.fuse_bytes for b in costs))


def fused_groups(costs: Sequence[BucketCost], compute_s: float, codec_on_compute: bool) -> List[BucketCost]:
    """Horovod's tensor fusion (its docs/tensor-fusion.rst; ``FuseResponses`` in its controller.cc),
    which takes hvd_ext's bucket collectives as it takes its own tensors. Backward releases ``costs``
    in order, in proportion to their size (on a CPU each one's codec seconds on the compute core after
    it); every cycle Horovod's background thread takes the collectives released so far, up to the
    fusion threshold, into one: consecutive ones with the same ``fuse`` key (an allreduce of one dtype;
    an allgather, counted at its output's bytes; never an alltoall). Horovod also looks past one it
    cannot fuse for more that it can; the model stops there (fewer fused: it favours Horovod's rows
    over mixed ones). It takes the next group once that one is done; idle, a collective half a cycle
    after its release on average, with what backward releases meanwhile. Each group starts as
    :func:`step_seconds` starts it (the cycle's wait is inside a measured latency)."""
    forward, backward = compute_s / 3.0, 2.0 * compute_s / 3.0
    total = sum(b.numel for b in costs) or 1
    release, t = [], forward
    for b in costs:
        t += backward * b.numel / total + (b.code if codec_on_compute else 0.0)
        release.append(t)
    groups: List[BucketCost] = []
    i, free = 0, 0.0
    while i < len(costs):
        taken = max(free, release[i] + HOROVOD_CYCLE_S / 2)  # when the thread takes this group
        j, size, key = i + 1, costs[i].fuse_bytes, costs[i].fuse
        while (key is not None and j < len(costs) and costs[j].fuse == key and release[j] <= taken
               and size + costs[j].fuse_bytes <= HOROVOD_FUSION_BYTES):
            size += costs[j].fuse_bytes
            j += 1
        g = fused(costs[i:j])
        free = max(free, release[j - 1]) + g.link_s - g.tail_s + (0.0 if codec_on_compute else g.code)
        groups.append(g)
        i = j
    return groups


def horovod_rows(shapes: Sequence[tuple], compute_s: float, c: Cluster) -> List[Row]:
    """Horovod's fp32 and fp16 allreduce, and its hierarchical allreduce across nodes: one allreduce
    per tensor, fused as Horovod fuses them (:func:`make_row`)."""
    numels = [math.prod(s) for s in reversed(shapes)]
    rows = []
    for label, width, spec in (("horovod", 4.0, None), ("horovod fp16", 2.0, "fp16")):
        hc = horovod_view(c, fp16=spec is not None)
        costs = [flat_cost("allreduce", n, width * n, *[codec_seconds(spec, n, hc) if spec else 0.0] * 2, hc,
                           fuse=("float16" if spec else "float32")) for n in numels]
        rows.append(make_row(label, None, "allreduce", costs, compute_s, hc))
    c = dataclasses.replace(horovod_view(c), intra_lat={})  # its own groups, not hvd_ext's (not measured)
    if c.nodes > 1 and c.local > 1:
        costs = [node_aware_cost("allreduce", n, 4.0 * n, 0.0, 0.0, c, fuse="float32") for n in numels]
        rows.append(make_row("horovod hierarchical", None, "node:allreduce", costs, compute_s, c,
                             "HOROVOD_HIERARCHICAL_ALLREDUCE=1"))
    return rows


def codec_routes(comp: Compressor, c: Cluster) -> List[str]:
    """The routes ``comp`` can take on this cluster (:func:`hvd_ext.exchange.routes.bucket_routes`):
    the node-aware ones where the exchange could carry it
    (:func:`hvd_ext.exchange.routes.codec_node_aware_reason`)."""
    return bucket_routes(comp, c.size, c.nodes > 1 and c.local > 1 and codec_node_aware_reason(comp) is None)


def later_round_bytes(comp: Compressor, shapes: Sequence[tuple]) -> float:
    """The payload bytes a bucket of ``shapes`` sends in its rounds after the first (``Compressor.round_bytes``)."""
    later = 0.0
    for i, s in enumerate(shapes):
        per_round = comp.round_bytes(TensorInfo(name=f"t{i}", shape=torch.Size(s), step=STEADY_STEP))
        later += sum(per_round[1:]) if per_round else 0.0
    return later


def codec_costs(spec: str, comp: Compressor, route: str, buckets: Sequence[Sequence[tuple]],
                c: Cluster) -> List[BucketCost]:
    """Each bucket's cost on ``route``; buckets of the same shapes (a model's repeated layers) cost the same."""
    costs: List[BucketCost] = []
    parts = c.nodes if route.startswith("node:") else c.size
    seen: Dict[tuple, BucketCost] = {}
    for shapes in buckets:
        key = tuple(tuple(s) for s in shapes)
        if key in seen:
            costs.append(seen[key])
            continue
        payload = payload_bytes(comp, shapes, route, parts, c.local)
        # one pass over the bucket: its calls each at its own size (codec_calls)
        timing = codec_timing(spec, c)
        enc = dec = pass_seconds(comp, shapes, route, parts, c.local, timing)
        later = later_round_bytes(comp, shapes) if route == "allreduce" else 0.0
        # the device decides who sums a half-precision bucket (a CPU: where the codec runs on the compute core)
        costs.append(route_cost(comp, route, shapes, payload, enc, dec, c, "cpu" if c.codec_on_compute else "cuda",
                                later=later, fuse=str(comp.wire_dtype or torch.float32),
                                overhead=timing.overhead_seconds(route, shapes, c.local)))
        seen[key] = costs[-1]
    return costs


OPTIMIZERS = ("sgd", "adam", "none")


def check_optimizer(optimizer: str) -> None:
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"plan: bad optimizer {optimizer!r}; accepted: {', '.join(OPTIMIZERS)}")


def bind_like(comp: Compressor, optimizer: str) -> None:
    """Bind ``comp`` to a stand-in of the job's optimizer, as ``DistributedOptimizer`` binds it, so the
    routes offered are the ones the job can take (``sig``/``ewma`` under SGD momentum keep a masked
    per-rank velocity and stay off the node-aware route). ``optimizer``: ``sgd`` (momentum 0.9),
    ``adam`` or ``none`` (unbound)."""
    check_optimizer(optimizer)
    if optimizer == "none":
        return
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=0.1, momentum=0.9) if optimizer == "sgd" else torch.optim.Adam([p])
    with warnings.catch_warnings():  # the takeover warnings speak to a training job, not to a plan
        warnings.simplefilter("ignore")
        comp.bind_optimizer(opt)


def codec_rows(spec: str, shapes: Sequence[tuple], compute_s: float, c: Cluster, bucket_bytes: int,
               optimizer: str = "none") -> List[Row]:
    """One row per route ``spec`` can take under ``optimizer`` (:func:`bind_like`), on the optimizer's buckets."""
    comp = compression_from_spec(spec)
    if comp.sparse and not hasattr(comp, "ratio") and comp.wire_bytes(1) is None:
        raise ValueError(f"plan: {spec!r} sends as many entries as its gradients decide, so its bytes cannot be "
                         "predicted from the model's shapes; accepted: codecs of a fixed size or a ratio "
                         "(e.g. topk:ratio=0.01, dgc, sig, randomk)")
    bind_like(comp, optimizer)
    buckets = buckets_of(shapes, bucket_bytes, min(bucket_bytes, FIRST_BUCKET_BYTES))
    return [make_row(spec, spec, r, codec_costs(spec, comp, r, buckets, c), compute_s, c)
            for r in codec_routes(comp, c)]
