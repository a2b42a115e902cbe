"""hvd_ext.exchange.core (Exchange): half-precision sums in float32, fused and cast buffers reused
from step to step (simulated ranks)."""
import pytest
import torch

from hvd_ext.exchange import cost
from hvd_ext.testing.harness import run_pipeline

from helpers.simgrads import make_grads, mean_of, relerr


@pytest.mark.parametrize("size", [1, 2, 3, 4])
@pytest.mark.parametrize("spec,dtype,bound", [("fp16", torch.float16, 1e-3), ("bf16", torch.bfloat16, 8e-3)])
def test_half_precision_allreduce_is_the_rounded_mean(size, spec, dtype, bound):
    """fp16 and bf16 are summed in float32 by the Exchange (an allgather at N <= 2, alltoall
    reduce-scatter then allgather beyond) and rounded back: every rank gets the same values, the mean
    of the ranks' rounded gradients rounded once more, and 2 bytes per element on the wire."""
    grads = make_grads(size, 1)
    runs = run_pipeline(spec, grads, size)
    first = runs[0].results[0]
    for run in runs:
        assert run.routes == ["allreduce"]
        for k, g in first.items():
            assert torch.equal(run.results[0][k], g)
            rows = [grads[0][r][k].to(dtype).float() for r in range(size)]
            want = (sum(rows[1:], rows[0].clone()) / size).to(dtype).float()
            assert torch.equal(g, want), k
        assert relerr(run.results[0], mean_of(grads, 0, size)) < bound
    n = sum(g.numel() for g in grads[0][0].values())
    assert runs[0].wire[0] == pytest.approx(cost.allreduce_wire(2 * (n + 1), size))


@pytest.mark.parametrize("size", [2, 3])
@pytest.mark.parametrize("spec", ["none", "fp16", "bf16"])
def test_reused_buffers_give_each_step_its_own_mean(size, spec):
    """The dense codecs reuse their fused buffers and cast buffers from step to step (large CPU
    tensors), and a 2-rank half-precision sum of >= 2**20 elements goes reduce-scatter + allgather:
    every step's result is that step's mean (a result aliasing an earlier step's buffer would not be)."""
    shapes = {"w": (300, 300), "big": ((1 << 20) + 3,), "v": (200, 400), "b": (7,)}
    grads = make_grads(size, 3, seed=size, shapes=shapes)
    for bucket_bytes in (25 * 1024 * 1024, 1 << 20):  # one bucket; one per tensor
        runs = run_pipeline(spec, grads, size, bucket_bytes=bucket_bytes)
        for step in range(3):
            first = runs[0].results[step]
            for run in runs:
                for k in shapes:
                    got = run.results[step][k]
                    assert torch.equal(got, first[k]), (step, k)
                    if spec == "none":
                        assert torch.allclose(got, mean_of(grads, step, size)[k], atol=1e-6), (step, k)
                    else:
                        dt = torch.float16 if spec == "fp16" else torch.bfloat16
                        rows = [grads[step][r][k].to(dt).float() for r in range(size)]
                        want = (sum(rows[1:], rows[0].clone()) / size).to(dt).float()
                        assert torch.equal(got, want), (step, k)
