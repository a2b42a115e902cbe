"""The two-phase route: segments, results within the codec's error, bytes per rank flat in N."""
import pytest
import torch

from hvd_ext.exchange.routes.base import segments
from hvd_ext.testing.harness import run_pipeline

from helpers.simgrads import make_grads, mean_of, relerr


def test_segments_cover_every_element_once():
    sizes = [5, 1, 17, 0, 9]
    for parts in (1, 2, 3, 4, 7):
        seen = [torch.zeros(s, dtype=torch.int32) for s in sizes]
        for shard in segments(sizes, parts):
            for i, a, b in shard:
                seen[i][a:b] += 1
        assert all(bool((s == 1).all()) for s in seen)


@pytest.mark.parametrize("size", [2, 3, 4])
@pytest.mark.parametrize("spec,bound", [("int8", 1e-3), ("qsgd:bits=8", 0.05), ("efsignsgd", 1.2),
                                        ("qdist:bits=3", 0.6), ("natural", 0.4), ("onebit", 1.2)])
def test_twophase_matches_the_mean_within_codec_error(size, spec, bound):
    grads = make_grads(size, 2, seed=size)
    runs = run_pipeline(spec + (",route=twophase" if ":" in spec else ":route=twophase"), grads, size)
    ref = mean_of(grads, 0, size)
    first = runs[0].results[0]
    for run in runs:
        assert run.routes == ["twophase"]
        for k in first:  # every rank decodes the same bytes: identical results
            assert torch.equal(run.results[0][k], first[k])
    assert relerr(first, ref) < bound


def test_twophase_int8_equals_allgather_up_to_rounding():
    grads = make_grads(3, 1, seed=5)
    tp = run_pipeline("int8:route=twophase", grads, 3)[0].results[0]
    ag = run_pipeline("int8:route=allgather", grads, 3)[0].results[0]
    for k in tp:
        assert torch.allclose(tp[k], ag[k], atol=0.05)


# ---- bytes per rank ----------------------------------------------------------------------------
def test_received_bytes_stay_flat_in_n():
    """Bytes received per rank per step: two-phase and sparse reduce-scatter grow like 2(N-1)/N,
    the allgather like N-1."""
    shapes = {"w": (256, 256)}
    got = {}
    for spec in ("qsgd:bits=8", "topk:ratio=0.01"):
        for ex in ("allgather", "twophase"):
            for size in (2, 4, 8):
                run = run_pipeline(f"{spec},route={ex}", make_grads(size, 1, shapes=shapes), size)[0]
                got[spec, ex, size] = run.received[0]
    n = 256 * 256
    for spec in ("qsgd:bits=8", "topk:ratio=0.01"):
        ag, tp = [got[spec, "allgather", s] for s in (2, 4, 8)], [got[spec, "twophase", s] for s in (2, 4, 8)]
        assert ag[2] > 6 * ag[0]                       # allgather: ~ (N-1)
        assert tp[2] <= 1.9 * tp[0]                    # two-phase: 2(N-1)/N, 1.75 from N=2 to N=8
        assert tp[2] < ag[2] / 3
    # 8-bit QSGD two-phase at N=8 moves >= 2x fewer bytes than a dense ring allreduce
    assert got["qsgd:bits=8", "twophase", 8] * 2 <= 2 * 7 / 8 * 4 * n
