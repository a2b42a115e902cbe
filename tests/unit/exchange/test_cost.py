"""hvd_ext.exchange.cost and .bucket_cost: the alpha-beta cost model, flat and node-aware."""


import math

import pytest

from hvd_ext.exchange import cost
from hvd_ext.exchange.bucket_cost import Network, flat_cost, node_aware_cost


def test_cost_model_bytes_per_rank():
    n, C = 10 ** 6, 10 ** 6  # 8-bit codes
    for N in (2, 4, 8, 1024):
        assert cost.per_rank("twophase", n, C, N)["wire"] == pytest.approx(2 * (N - 1) / N * C)
        assert cost.per_rank("allgather", n, C, N)["wire"] == pytest.approx((N - 1) * C)
        assert cost.per_rank("allreduce", n, C, N)["wire"] == pytest.approx(2 * (N - 1) / N * 4 * n)
    rows = cost.project(n, C, [2, 1024])
    assert rows[1]["allgather_wire"] > 500 * rows[1]["twophase_wire"]


def test_cost_model_node_aware_pays_across_a_slow_link():
    """Across a slow link between nodes, the node-aware route (dense inside the node, the codec's route
    on a 1/L shard across nodes) beats every flat route of an 8-bit code: the NIC carries L x fewer bytes."""
    n, C = 10 ** 6, 10 ** 6  # 8-bit codes
    intra, inter = cost.LinkModel(alpha=5e-6, bandwidth=5e9), cost.LinkModel(alpha=50e-6, bandwidth=300e6 / 8)
    for M, L in ((2, 2), (2, 4), (8, 8)):
        net = Network(M, L, intra, inter)
        flat = min(flat_cost(k, n, C, 0.0, 0.0, net).seconds for k in ("allgather", "twophase"))
        node = min(node_aware_cost(k, n, C, 0.0, 0.0, net).seconds for k in ("allgather", "twophase"))
        assert node < 0.7 * flat, (M, L, node, flat)
    # inter-node bytes per node: L x fewer for two-phase (the 2-D scheme)
    net = Network(4, 4, intra, inter)
    assert node_aware_cost("twophase", n, C, 0.0, 0.0, net).nic < flat_cost("twophase", n, C, 0.0, 0.0, net).nic / 3


def test_an_allreduce_of_gpu_tensors_pays_the_tree_latency_across_nodes():
    """With ``Network.allreduce_tree`` (GPU tensors: Horovod's allreduce is NCCL's) an allreduce across
    nodes costs the smaller of the ring's 2(N-1) inter-node alphas and the tree's
    2((L-1) intra + ceil(log2 M) inter); its bytes are the payload as sent; the other collectives and
    one node keep their latency."""
    a_in, a_out = 5e-6, 30e-6
    intra, inter = cost.LinkModel(alpha=a_in, bandwidth=1e11), cost.LinkModel(alpha=a_out, bandwidth=1e10)
    ring, tree = Network(128, 8, intra, inter), Network(128, 8, intra, inter, allreduce_tree=True)
    n = 1000
    assert cost.tree_allreduce_latency(128, 8, a_in, a_out) == pytest.approx(2 * (7 * a_in + 7 * a_out))
    assert cost.tree_allreduce_latency(1, 8, a_in, a_out) == math.inf

    def gap(price, *args):
        return price(*args, ring).seconds - price(*args, tree).seconds
    assert gap(flat_cost, "allreduce", n, 4 * n, 0.0, 0.0) == pytest.approx(2 * 1023 * a_out - 2 * (7 * a_in + 7 * a_out),
                                                                            rel=1e-6)
    assert gap(node_aware_cost, "allreduce", n, 4 * n, 0.0, 0.0) == pytest.approx(2 * 127 * a_out - 2 * 7 * a_out,
                                                                                  rel=1e-6)
    for kind in ("allgather", "twophase"):
        assert gap(flat_cost, kind, n, n, 0.0, 0.0) == 0.0
    one = [Network(1, 8, intra, intra, allreduce_tree=t) for t in (False, True)]
    assert flat_cost("allreduce", n, 4 * n, 0.0, 0.0, one[0]).seconds == \
        flat_cost("allreduce", n, 4 * n, 0.0, 0.0, one[1]).seconds
    # float16 on the ring: half the bytes of float32
    full, half = (flat_cost("allreduce", n, b, 0.0, 0.0, Network(2, 2, intra, inter)).seconds for b in (4 * n, 2 * n))
    assert full - half == pytest.approx(cost.allreduce_wire(2 * n, 4) / 1e10, rel=1e-6)
