"""hvd_ext.exchange.transport: the only calls to Horovod's collectives, node layouts, group transports."""
import re

import pytest
import torch

from hvd_ext.exchange.transport import layout_sets
from hvd_ext.testing.harness import run_pipeline
from hvd_ext.testing.simulated import SimulatedWorld

from conftest import ROOT
from helpers.simgrads import SHAPES, make_grads


# ---- one seam ------------------------------------------------------------------------------------
def test_no_horovod_collective_outside_the_exchange_package():
    pat = re.compile(r"hvd\.(allreduce|allgather|alltoall|broadcast|reducescatter|grouped_allreduce|synchronize)"
                     r"[a-z_]*\(")
    offenders = [str(p.relative_to(ROOT)) for p in (ROOT / "hvd_ext").rglob("*.py")
                 if "exchange" not in p.relative_to(ROOT).parts and pat.search(p.read_text())]
    assert offenders == []


def test_layout_sets_any_placement():
    # node by node, and round robin (mpirun --map-by node)
    assert layout_sets([(0, 0), (0, 1), (1, 0), (1, 1)], 2, 2) == ([[0, 1], [2, 3]], [[0, 2], [1, 3]])
    assert layout_sets([(0, 0), (1, 0), (0, 1), (1, 1)], 2, 2) == ([[0, 2], [1, 3]], [[0, 1], [2, 3]])


def test_group_transport_collectives():
    from hvd_ext.exchange.transport import GroupTransport

    def body(rank, t):
        g = GroupTransport(t, [r for r in range(5) if r % 2 == rank % 2])
        x = torch.full((2,), float(rank))
        g.wait(g.allreduce_async(x, "ar", op="sum"))
        ag = g.wait(g.allgather_async(torch.arange(rank + 1, dtype=torch.float32), "ag"))
        got, sp = g.wait(g.alltoall_async(torch.tensor([rank * 10 + j for j in range(g.size())]),
                                          [1] * g.size(), "a2a"))
        return x.tolist(), ag.tolist(), got.tolist(), sp, g.allgather_object(rank, "obj")

    out = SimulatedWorld(5).run(body)
    even, odd = [0, 2, 4], [1, 3]
    for rank, (x, ag, got, sp, objs) in enumerate(out):
        grp = even if rank % 2 == 0 else odd
        assert x == [float(sum(grp))] * 2
        assert ag == [float(v) for r in grp for v in range(r + 1)]
        assert got == [r * 10 + grp.index(rank) for r in grp] and sp == [1] * len(grp)
        assert objs == grp


@pytest.mark.parametrize("spec", ["none", "qsgd:bits=8", "topk:ratio=0.05,route=twophase", "efsignsgd"])
def test_groups_over_alltoall_equal_sub_worlds(spec):
    """Node groups as masked alltoalls over the whole world (Horovod's default here) give the same bits
    as separate group worlds (process sets)."""
    grads = make_grads(6, 3, seed=4)
    a = run_pipeline(spec, grads, 6, ranks_per_node=3)
    b = run_pipeline(spec, grads, 6, ranks_per_node=3, groups="alltoall")
    assert a[0].routes == b[0].routes and a[0].routes[0].startswith("node:")
    for ra, rb in zip(a, b):
        assert all(torch.equal(ra.results[s][k], rb.results[s][k]) for s in range(3) for k in SHAPES)
        assert ra.received == rb.received
