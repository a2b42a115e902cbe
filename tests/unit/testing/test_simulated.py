"""hvd_ext.testing.simulated: the in-process N-rank world (collectives, timeouts, node groups)."""


import pytest
import torch

from hvd_ext.exchange import Exchange
from hvd_ext.testing.simulated import SimulatedWorld


# ---- the simulated world -------------------------------------------------------------------------
@pytest.mark.parametrize("size", [1, 3])
def test_simulated_world_collectives(size):
    def body(rank, t):
        ex = Exchange(op="average", transport=t)
        x = torch.full((3,), float(rank))
        ex.allreduce_average([x], "avg")
        objs = ex.allgather_object({"r": rank}, "obj")
        pend = ex.start_alltoall("a2a", [[torch.tensor([rank, j], dtype=torch.uint8)] for j in range(size)], False)
        got, nf = ex.finish_alltoall(pend)
        return x, objs, [g[0].tolist() for g in got], nf, ex.allreduce_scalar(rank + 1, "s")

    out = SimulatedWorld(size).run(body)
    for rank, (x, objs, got, nf, s) in enumerate(out):
        assert torch.allclose(x, torch.full((3,), (size - 1) / 2))
        assert objs == [{"r": r} for r in range(size)]
        assert got == [[r, rank] for r in range(size)]  # piece j of rank r arrives at rank j
        assert not bool(nf) and s == size * (size + 1) / 2


def test_simulated_world_mismatched_collective_times_out():
    def body(rank, t):
        ex = Exchange(op="sum", transport=t)
        if rank == 0:
            ex.allreduce_scalar(1.0, "only-rank-0")
        return rank

    with pytest.raises(TimeoutError, match="only-rank-0"):
        SimulatedWorld(2, timeout=1.0).run(body)


def test_simulated_world_node_groups():
    def body(rank, t):
        local, cross = t.node_groups()
        topo = t.topology()
        return (topo.local_rank, topo.cross_rank, local.rank(), local.size(), cross.rank(), cross.size())

    out = SimulatedWorld(6, ranks_per_node=3).run(body)
    assert out == [(r % 3, r // 3, r % 3, 3, r // 3, 2) for r in range(6)]
