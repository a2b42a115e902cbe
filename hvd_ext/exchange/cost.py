"""Wire bytes and an alpha-beta cost model for the exchanges.

Wire bytes per rank (what leaves this rank's NIC) for the standard algorithms:

* ring allreduce of B bytes: reduce-scatter + allgather, 2(N-1)/N x B;
* ring allgather: every block but one passes through every rank, ~ the bytes
  of the other ranks' blocks;
* alltoall: the bytes addressed to other ranks.

Step-time model (Hockney alpha-beta, plus codec time; Agarwal et al., "On the
utility of gradient compression", MLSys 2022, use the same accounting):

    t = messages x alpha + wire_bytes / bandwidth + coded_elements / codec_throughput

with, per bucket of n elements, dense size D = 4n and compressed size C:

=============  ========================  ===================  ======================
exchange       messages per rank         wire bytes per rank  elements coded/decoded
=============  ========================  ===================  ======================
allreduce      2(N-1) (ring)             2(N-1)/N x D         0
allgather      N-1 (ring)                (N-1) x C            n + N x n (decode all)
twophase       (N-1) + (N-1)             2(N-1)/N x C         2n + 2n (shards)
=============  ========================  ===================  ======================

``project`` tabulates the model up to N = 1024.

Nodes (M nodes of L ranks, N = M L): a node's L ranks share one inter-node
link (its NIC); inside a node the link is fast (NVLink, shared memory). A
flat exchange sends the fraction (N-L)/(N-1) of a rank's all-to-all traffic
off the node, so the NIC carries L x that; a ring allreduce crosses each NIC
once per step of the ring (the per-rank bytes). The node-aware (2-D)
exchange (:mod:`.hierarchical`; Horovod's hierarchical allreduce, BlueConnect,
Cho et al. 2019, and CGX's node-local aggregation do the same for dense
gradients):

* inside the node, dense: reduce-scatter + allgather of D, 2(L-1)/L x D per
  rank over the intra link, 2(L-1) messages;
* across nodes, compressed: every local rank runs the inner exchange on its
  1/L shard (n/L elements, ~C/L bytes) with its M peers; the NIC carries the
  L shards, L x the inner per-rank bytes (so 2(M-1)/M x C for two-phase:
  a factor L below flat).

:mod:`.bucket_cost` prices a bucket on both, over a :class:`NodeModel`'s
links (an intra and an inter :class:`LinkModel`), for ``compression="auto"``,
the fixed codecs' route choice and the planner alike. On GPUs
(``NodeModel.tree``) an allreduce across nodes pays the latency of NCCL's
trees where it is below the ring's (:func:`tree_allreduce_latency`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Sequence


def allreduce_wire(nbytes: float, n: int) -> float:
    return 2.0 * (n - 1) / n * nbytes if n > 1 else 0.0


def allgather_wire(own: float, total: float, n: int) -> float:
    return float(total - own) if n > 1 else 0.0


def alltoall_wire(sent: float, received: float) -> float:
    return float(max(sent, received))


@dataclass
class LinkModel:
    """alpha: seconds per message; bandwidth: bytes/s; codec: elements/s encoded or decoded."""

    alpha: float = 50e-6
    bandwidth: float = 1.25e9        # 10 Gbit/s
    codec: float = 250e6             # elements per second, one CPU core (order of magnitude; benchmarks/throughput.py)

    def time(self, messages: float, wire: float, coded: float) -> float:
        return messages * self.alpha + wire / self.bandwidth + coded / self.codec


EXCHANGES = ("allreduce", "allgather", "twophase")


def route_wire_and_code(kind: str, size: int, payload: float, enc: float, dec: float) -> tuple:
    """(wire bytes per rank, codec seconds) of one bucket's exchange on route ``kind`` over ``size``
    ranks, from its payload bytes and its encode / decode seconds: ``allreduce`` carries the payload
    on a ring and codes it once; ``allgather`` decodes every rank's payload; the scalable routes
    (``twophase``, ``sparse_rs``) code shards twice (worker and owner). ``compression="auto"`` and
    the planner (:mod:`hvd_ext.plan`) both predict with it."""
    N = size
    if kind == "allreduce":
        return allreduce_wire(payload, N), enc + dec
    if kind == "allgather":
        return (N - 1) * payload, enc + N * dec
    return 2.0 * (N - 1) / N * payload, 2.0 * (enc + dec)


# the collectives each route runs per bucket: a gather of payloads whose sizes the receivers cannot know
# travels by an alltoall (:meth:`hvd_ext.exchange.core.Exchange.start_allgather`), as the sparse
# reduce-scatter's second phase always does
ROUTE_COLLECTIVES = {"allreduce": ("allreduce",), "allgather": ("allgather",),
                     "twophase": ("alltoall", "allgather"), "sparse_rs": ("alltoall", "alltoall")}


def route_collectives(kind: str, sizes_known: bool = True) -> tuple:
    """The collectives of ``kind`` per bucket; an allgather of unknown sizes is an alltoall."""
    kinds = ROUTE_COLLECTIVES[kind]
    return kinds if sizes_known else tuple("alltoall" if k == "allgather" else k for k in kinds)


def collective_seconds(kinds: Sequence[str], first: Dict[str, float], then: Dict[str, float]) -> float:
    """The fixed seconds of one bucket's collectives ``kinds``, run one after another: the first at
    its cost inside a step (``first``: it waits for the slowest rank's backward), each later one at
    its cost with the ranks together (``then``: every rank has just waited for the one before;
    ``first`` where not measured). ``compression="auto"`` and the planner both price with it."""
    return sum((first if i == 0 else then).get(k, first[k]) for i, k in enumerate(kinds))


def per_rank(exchange: str, n_elems: int, compressed_bytes: float, size: int) -> Dict[str, float]:
    """Messages, wire bytes and coded elements per rank for one bucket (see the module table)."""
    N = size
    D = 4.0 * n_elems
    if N <= 1:
        return {"messages": 0.0, "wire": 0.0, "coded": 0.0 if exchange == "allreduce" else 2.0 * n_elems}
    if exchange == "allreduce":
        return {"messages": 2.0 * (N - 1), "wire": allreduce_wire(D, N), "coded": 0.0}
    if exchange == "allgather":
        return {"messages": float(N - 1), "wire": (N - 1) * compressed_bytes, "coded": float(n_elems) * (1 + N)}
    if exchange == "twophase":
        return {"messages": 2.0 * (N - 1), "wire": 2.0 * (N - 1) / N * compressed_bytes,
                "coded": 4.0 * n_elems}
    raise ValueError(f"exchange must be one of {EXCHANGES}, got {exchange!r}")


def predict(exchange: str, n_elems: int, compressed_bytes: float, size: int, link: LinkModel) -> float:
    c = per_rank(exchange, n_elems, compressed_bytes, size)
    return link.time(c["messages"], c["wire"], c["coded"])


def project(n_elems: int, compressed_bytes: float, sizes: List[int], link: LinkModel = None) -> List[Dict[str, float]]:
    """Predicted seconds and wire bytes per rank for every exchange at each N in ``sizes``."""
    link = link or LinkModel()
    rows = []
    for N in sizes:
        row = {"N": N}
        for ex in EXCHANGES:
            row[f"{ex}_s"] = predict(ex, n_elems, compressed_bytes, N, link)
            row[f"{ex}_wire"] = per_rank(ex, n_elems, compressed_bytes, N)["wire"]
        rows.append(row)
    return rows


def tree_allreduce_latency(nodes: int, local: int, intra_alpha: float, inter_alpha: float) -> float:
    """Seconds of the messages in a row of NCCL's allreduce over ``nodes`` x ``local`` GPUs as a tree
    (Jeaugey, "Massively scale your deep learning training with NCCL 2.4", NVIDIA 2019): a double
    binary tree spans the nodes and a chain the GPUs of each, up and down, at the ring's bandwidth, so
    2((local - 1) x intra_alpha + ceil(log2 nodes) x inter_alpha). One node has no tree (inf)."""
    if nodes < 2:
        return math.inf
    return 2.0 * ((local - 1) * intra_alpha + math.ceil(math.log2(nodes)) * inter_alpha)


@dataclass
class NodeModel:
    """Link models inside a node and between nodes (defaults: shared memory / NVLink-class inside,
    10 Gbit/s Ethernet between); ``tree``: the allreduce runs NCCL's trees where they beat the ring
    (the tensors are on GPUs, :func:`tree_allreduce_latency`)."""

    intra: LinkModel = None
    inter: LinkModel = None
    tree: bool = False

    def __post_init__(self):
        if self.intra is None:
            self.intra = LinkModel(alpha=5e-6, bandwidth=10e9)
        if self.inter is None:
            self.inter = LinkModel()
