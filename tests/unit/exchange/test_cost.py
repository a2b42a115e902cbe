"""hvd_ext.exchange.cost: the alpha-beta cost model, flat and node-aware."""


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
