"""hvd_ext.exchange.cost: the alpha-beta cost model, flat and node-aware."""


import dataclasses
import math

import pytest

from hvd_ext.exchange import cost


def test_cost_model_bytes_per_rank():
    n, C = 10 ** 6, 10 ** 6  # 8-bit codes
    for N in (2, 4, 8, 1024):
        assert cost.per_rank("twophase", n, C, N)["wire"] == pytest.approx(2 * (N - 1) / N * C)
        assert cost.per_rank("allgather", n, C, N)["wire"] == pytest.approx((N - 1) * C)
        assert cost.per_rank("allreduce", n, C, N)["wire"] == pytest.approx(2 * (N - 1) / N * 4 * n)
    rows = cost.project(n, C, [2, 1024])
    assert rows[1]["allgather_wire"] > 500 * rows[1]["twophase_wire"]


def test_cost_model_node_aware_pays_across_a_slow_link():
    n, C = 10 ** 6, 10 ** 6  # 8-bit codes
    slow = cost.NodeModel(intra=cost.LinkModel(alpha=5e-6, bandwidth=5e9),
                          inter=cost.LinkModel(alpha=50e-6, bandwidth=300e6 / 8))
    for M, L in ((2, 2), (2, 4), (8, 8)):
        pick = cost.choose_hierarchy(("allgather", "twophase"), ("allgather", "twophase"), n, C, M, L, slow)
        assert pick["node_aware"] and pick["node_s"] < 0.7 * pick["flat_s"], (M, L, pick)
    # inter-node bytes per node: L x fewer for two-phase (the 2-D scheme)
    M, L = 4, 4
    flat_nic = L * cost.per_rank("twophase", n, C, M * L)["wire"] * (M * L - L) / (M * L - 1)
    node_nic = L * cost.per_rank("twophase", n // L, C / L, M)["wire"]
    assert node_nic < flat_nic / (L - 1)
    # one node: never node-aware
    assert not cost.choose_hierarchy(("twophase",), ("twophase",), n, C, 1, 4, slow)["node_aware"]


def test_an_allreduce_of_gpu_tensors_pays_the_tree_latency_across_nodes():
    """With ``NodeModel.tree`` (GPU tensors: Horovod's allreduce is NCCL's) an allreduce across nodes
    costs the smaller of the ring's 2(N-1) inter-node alphas and the tree's
    2((L-1) intra + ceil(log2 M) inter); its bytes are the payload as sent; the other collectives and
    one node keep their latency."""
    a_in, a_out = 5e-6, 30e-6
    ring = cost.NodeModel(intra=cost.LinkModel(alpha=a_in, bandwidth=1e11),
                          inter=cost.LinkModel(alpha=a_out, bandwidth=1e10))
    tree = dataclasses.replace(ring, tree=True)
    n = 1000
    assert cost.tree_allreduce_latency(128, 8, a_in, a_out) == pytest.approx(2 * (7 * a_in + 7 * a_out))
    assert cost.tree_allreduce_latency(1, 8, a_in, a_out) == math.inf
    gap = (cost.predict_flat("allreduce", n, 4 * n, 128, 8, ring)
           - cost.predict_flat("allreduce", n, 4 * n, 128, 8, tree))
    assert gap == pytest.approx(2 * 1023 * a_out - 2 * (7 * a_in + 7 * a_out), rel=1e-6)
    gap = (cost.predict_node_aware("allreduce", n, 4 * n, 128, 8, ring)
           - cost.predict_node_aware("allreduce", n, 4 * n, 128, 8, tree))
    assert gap == pytest.approx(2 * 127 * a_out - 2 * 7 * a_out, rel=1e-6)
    for args in (("allgather", n, n, 128, 8), ("twophase", n, n, 128, 8), ("allreduce", n, 4 * n, 1, 8)):
        assert cost.predict_flat(*args, tree) == cost.predict_flat(*args, ring)
    # float16 on the ring: half the bytes of float32
    full, half = (cost.predict_flat("allreduce", n, b, 2, 2, ring) for b in (4 * n, 2 * n))
    assert full - half == pytest.approx(cost.allreduce_wire(2 * n, 4) / 1e10, rel=1e-6)
