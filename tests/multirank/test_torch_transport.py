"""TorchDistTransport: the exchange's collectives over torch.distributed (gloo, CPU) in real
processes, at 2, 3 and 4 ranks: each collective against its definition (bf16 included), and the real
gradient pipeline over it equal to the simulated world's result on every route (bit for bit, except
a float32 allreduce, which gloo sums in its own order)."""
import pytest
import torch

from helpers.torchdist import spawn_gloo
from hvd_ext.testing.harness import run_on, run_pipeline

SPECS = ["fp16", "bf16", "powersgd:rank=2,warmup=0", "qsgd:bits=8,exchange=allgather",
         "qsgd:bits=4,exchange=twophase", "efsignsgd:exchange=twophase", "topk:ratio=0.05,exchange=allgather",
         "topk:ratio=0.05,exchange=twophase"]
SHAPES = {"a": (16, 12), "b": (16,), "c": (7, 9)}


def grads(size, steps=3):
    g = torch.Generator().manual_seed(1)
    return [[{n: torch.randn(s, generator=g) for n, s in SHAPES.items()} for _ in range(size)] for _ in range(steps)]


def _worker(rank, size):
    from hvd_ext.exchange.torch_transport import TorchDistTransport

    t = TorchDistTransport()
    res = {}
    x = torch.full((5,), float(rank + 1))
    res["sum"] = t.wait(t.allreduce_async(x.clone(), "s")).tolist()
    res["avg"] = t.wait(t.allreduce_async(x.clone(), "a", op="average", postscale=2.0)).tolist()
    mine = (torch.arange(rank + 2, dtype=torch.float32) + 10 * rank).to(torch.bfloat16)
    res["ag"] = t.wait(t.allgather_async(mine, "g")).float().tolist()
    # values exact in bf16 (8 significant bits)
    send = torch.cat([torch.full((j + 1,), 10.0 * rank + j) for j in range(size)]).to(torch.bfloat16)
    got, rsplits = t.wait(t.alltoall_async(send, [j + 1 for j in range(size)], "t"))
    res["a2a"], res["a2a_splits"], res["a2a_dtype"] = got.float().tolist(), rsplits, str(got.dtype)
    b = torch.full((3,), float(rank), dtype=torch.bfloat16)
    res["bc"] = t.wait(t.broadcast_async(b, 1, "b")).float().tolist()
    res["objs"] = t.allgather_object({"r": rank}, "o")
    res["bobj"] = t.broadcast_object("root" if rank == 0 else None, 0, "bo")
    res["runs"] = {}
    for spec in SPECS:
        run = run_on(t, spec, grads(size), rank)
        res["runs"][spec] = ([{n: g.tolist() for n, g in step.items()} for step in run.results], run.routes)
    return res


@pytest.mark.timeout(240)
@pytest.mark.parametrize("size", [2, 3, 4])
def test_torch_distributed_transport(size):
    got = spawn_gloo(_worker, size)
    total = sum(range(1, size + 1))
    ref = run_pipeline_all(size)
    for r in range(size):
        res = got[r]
        assert res["sum"] == [float(total)] * 5
        assert res["avg"] == pytest.approx([2.0 * total / size] * 5)
        want = [float(v) for q in range(size) for v in (torch.arange(q + 2) + 10 * q).tolist()]
        assert res["ag"] == want
        assert res["a2a_splits"] == [r + 1] * size and res["a2a_dtype"] == "torch.bfloat16"
        assert res["a2a"] == [10.0 * q + r for q in range(size) for _ in range(r + 1)]
        assert res["bc"] == [1.0] * 3
        assert res["objs"] == [{"r": q} for q in range(size)] and res["bobj"] == "root"
        for spec in SPECS:
            steps, routes = res["runs"][spec]
            assert routes == ref[spec][r].routes, spec
            for step, want_step in zip(steps, ref[spec][r].results):
                for n, v in step.items():
                    if spec.startswith("powersgd"):  # float32 allreduce: gloo's summation order
                        torch.testing.assert_close(torch.tensor(v), want_step[n], rtol=1e-5, atol=1e-6)
                    else:  # payloads moved, decoded and summed by the exchange itself: bit for bit
                        assert torch.equal(torch.tensor(v), want_step[n]), (spec, n)


def run_pipeline_all(size):
    return {spec: run_pipeline(spec, grads(size), size) for spec in SPECS}
