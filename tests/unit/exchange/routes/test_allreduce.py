"""The allreduce route: dense codecs give the mean (simulated ranks)."""
import pytest
import torch

from hvd_ext.testing.harness import run_pipeline

from helpers.simgrads import make_grads, mean_of, relerr


# ---- exact and approximate results against references ------------------------------------------
@pytest.mark.parametrize("size", [2, 3, 4])
def test_dense_allreduce_is_the_exact_mean(size):
    grads = make_grads(size, 1)
    runs = run_pipeline("none", grads, size)
    ref = mean_of(grads, 0, size)
    for run in runs:
        assert run.routes == ["allreduce"]
        for k in ref:
            assert torch.allclose(run.results[0][k], ref[k], atol=1e-6)


@pytest.mark.parametrize("spec,bound", [("fp16:feedback=residual", 1e-6), ("bf16:feedback=residual", 1e-4)])
def test_cast_codec_with_feedback_keeps_the_average(spec, bound):
    """Under error feedback (as compression=auto runs a chosen fp16/bf16) the codec decodes its own
    payload after the average: that must not land in the buffer holding the average."""
    shapes = {"w": (300, 300), "b": (7,)}
    grads = make_grads(2, 3, seed=1, shapes=shapes)
    runs = run_pipeline(spec, grads, 2)
    for step in range(3):
        assert relerr(runs[0].results[step], mean_of(grads, step, 2)) < bound, step
