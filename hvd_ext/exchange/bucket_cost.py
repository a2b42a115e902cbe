"""A bucket's cost on a network of nodes: the price ``compression="auto"`` and the planner
(:mod:`hvd_ext.plan`) both give each route, so that fed the same numbers they choose alike.

Per bucket: its collectives' fixed seconds (measured per kind where a calibration or the job's probe
timed them, :func:`hvd_ext.exchange.cost.collective_seconds`, else messages x alpha), the bytes on the
busiest link over its bandwidth, and the codec passes
(:func:`hvd_ext.exchange.cost.route_wire_and_code`). Across nodes a flat route's node NIC carries the
off-node part of its L ranks' traffic (a ring allreduce crosses it once per direction); the
node-aware route reduces densely inside the node and runs the codec's route on a 1/L shard across
nodes, the NIC carrying the L shards (the derivations: :mod:`hvd_ext.exchange.cost`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Optional

from .cost import (LinkModel, collective_seconds, per_rank, route_collectives, route_wire_and_code,
                   tree_allreduce_latency)


@dataclass
class Network:
    """``nodes`` x ``local`` ranks; ``intra`` / ``inter`` links (``inter`` unused on one node);
    ``collective_lat``: the fixed seconds of one allreduce, allgather and alltoall over the whole
    world as a bucket's first collective pays it (measured: they replace messages x alpha on the flat
    routes), ``idle_lat`` the same where the ranks start it together
    (:func:`hvd_ext.exchange.cost.collective_seconds`); ``intra_lat``: the same of a node's ranks,
    measured inside a step (the node-aware route's first collective pays it); ``allreduce_tree``: an
    allreduce's latency is the smaller of the ring's and NCCL's tree's
    (:func:`hvd_ext.exchange.cost.tree_allreduce_latency`)."""

    nodes: int
    local: int
    intra: LinkModel
    inter: LinkModel
    collective_lat: Dict[str, float] = field(default_factory=dict)
    idle_lat: Dict[str, float] = field(default_factory=dict)
    intra_lat: Dict[str, float] = field(default_factory=dict)
    allreduce_tree: bool = False  # NCCL's trees where they beat the ring (a GPU cluster)

    @property
    def size(self) -> int:
        return self.nodes * self.local

    def link(self) -> LinkModel:
        """The link a flat collective is bound by: the NIC across nodes, else the node's own link."""
        return self.inter if self.nodes > 1 else self.intra

    @classmethod
    def one_link(cls, size: int, lat: float, bandwidth: float, first: Optional[Dict[str, float]] = None,
                 then: Optional[Dict[str, float]] = None) -> "Network":
        """``size`` ranks on one link whose allreduce costs ``lat`` fixed seconds (alpha: ``lat`` over
        its 2(N-1) ring messages) and moves ``bandwidth`` bytes/s; ``first`` / ``then``: each
        collective's measured fixed seconds, as :attr:`collective_lat` / :attr:`idle_lat`."""
        link = LinkModel(alpha=lat / max(2 * (size - 1), 1), bandwidth=bandwidth)
        return cls(1, size, link, link, dict(first or {}), dict(then or {}))


@dataclass
class BucketCost:
    """One bucket's exchange on a route: bytes, seconds, and how Horovod may fuse its collective."""

    numel: int
    wire: float          # bytes this rank sends
    nic: float           # bytes the busiest link carries for it (a node's NIC across nodes)
    latency: float       # seconds of per-message cost
    code: float          # codec seconds
    link_s: float        # latency + nic / bandwidth (+ the intra part of a node-aware exchange)
    tail_s: float = 0.0  # the part of link_s that starts only once backward is over (later rounds)
    tail_lat: float = 0.0  # the part of latency in tail_s
    fuse: Optional[str] = None  # Horovod fuses its collective with the next ones of this key (None: never)
    fuse_bytes: float = 0.0     # the bytes it counts against HOROVOD_FUSION_BYTES

    @property
    def seconds(self) -> float:
        return self.link_s + self.code


def over(nbytes: float, link: LinkModel) -> float:
    """Seconds ``link`` takes for ``nbytes``: none for nothing (one rank, whose probe measured no bandwidth)."""
    return nbytes / link.bandwidth if nbytes > 0 else 0.0


def flat_cost(kind: str, numel: int, payload: float, enc: float, dec: float, net: Network,
              sizes_known: bool = True, rounds: int = 1, later: float = 0.0, fuse: Optional[str] = None,
              collectives: Optional[tuple] = None) -> BucketCost:
    """A bucket on a flat route; ``rounds``: the allreduce rounds its codec takes
    (``Compressor.rounds``), each after the first a collective at the ranks-together cost that starts
    once backward is over (:mod:`hvd_ext.exchange.routes.allreduce`), carrying ``later`` of the
    ``payload`` bytes (``Compressor.round_bytes``): both are the bucket's ``tail_s``. ``collectives``:
    one round's collectives where they are not the route's own (hvd_ext's half-precision sum:
    :func:`hvd_ext.exchange.routes.flat_terms`), each N-1 messages. ``fuse``: the dtype of the first
    collective, if Horovod may fuse it with the next ones (an allreduce or a gather of known sizes,
    :func:`hvd_ext.plan.model.fused_groups`)."""
    N, L = net.size, net.local
    wire, code = route_wire_and_code(kind, N, payload, enc, dec)
    base = "twophase" if kind == "sparse_rs" else kind
    messages = per_rank(base, numel, payload, N)["messages"]
    ring = kind == "allreduce" and not collectives  # a ring crosses the node's NIC once per direction
    nic = wire if (net.nodes == 1 or ring) else L * wire * (N - L) / (N - 1)
    link = net.link()
    kinds = (collectives or route_collectives(kind, sizes_known)) * rounds
    if collectives:
        messages = (N - 1) * len(collectives)
    one = messages * link.alpha
    if kind == "allreduce" and net.allreduce_tree and not collectives:
        one = min(one, tree_allreduce_latency(net.nodes, L, net.intra.alpha, net.inter.alpha))
    lat, tail = one * rounds, one * (rounds - 1)
    if net.collective_lat:
        lat = collective_seconds(kinds, net.collective_lat, net.idle_lat)
        tail = lat - collective_seconds(kinds[:len(kinds) // rounds], net.collective_lat, net.idle_lat)
    link_s = lat + over(nic, link)
    tail_lat = tail
    tail += over(nic * later / payload, link) if payload > 0 else 0.0
    # Horovod fuses an allreduce (its first round's bytes) or an allgather (its output), not an alltoall
    first = kinds[0]
    key = f"{first}/{fuse}" if fuse and first in ("allreduce", "allgather") else None
    return BucketCost(numel, wire, nic, lat, code, link_s, min(tail, link_s), min(tail_lat, link_s), key,
                      payload - later if first == "allreduce" else N * payload)


def node_aware_cost(inner: str, numel: int, payload: float, enc: float, dec: float, net: Network,
                    fuse: Optional[str] = None) -> BucketCost:
    """The node-aware route (:mod:`hvd_ext.exchange.routes.hierarchical`): a dense reduce-scatter (an
    alltoall) inside the node, ``inner`` across nodes on a 1/L shard, a dense allgather inside the
    node; messages x alpha each, but the first collective at ``intra_lat`` where measured. ``fuse``:
    Horovod's hierarchical allreduce, which it fuses as its flat one (hvd_ext's route starts with an
    alltoall, which it does not)."""
    L, M = net.local, net.nodes
    D = 4.0 * numel
    intra_wire = 2.0 * (L - 1) / L * D
    intra_lat = 2.0 * (L - 1) * net.intra.alpha
    base = "twophase" if inner == "sparse_rs" else inner
    lat = per_rank(base, max(numel // L, 1), payload / L, M)["messages"] * net.inter.alpha
    if inner == "allreduce" and net.allreduce_tree:
        lat = min(lat, tree_allreduce_latency(M, 1, 0.0, net.inter.alpha))
    if "alltoall" in net.intra_lat:  # the first, the reduce-scatter, waits for the slowest rank (collective_seconds)
        intra_lat = net.intra_lat["alltoall"] + (L - 1) * net.intra.alpha
    wire, code = route_wire_and_code(inner, M, payload / L, enc / L, dec / L)
    nic = L * wire
    link_s = intra_lat + over(intra_wire, net.intra) + lat + over(nic, net.inter)
    return BucketCost(numel, intra_wire + wire, nic, intra_lat + lat, code, link_s,
                      fuse=f"allreduce/{fuse}" if fuse else None, fuse_bytes=D)
