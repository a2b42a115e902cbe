"""The communication seam and the scalable exchanges, on the in-process N-rank world.

The real GradientPipeline runs on N simulated ranks (hvd_ext.exchange.harness):
routes, byte counts, two-phase / sparse reduce-scatter results against
references computed from all ranks' inputs, owner-side memory conservation,
non-finite skipping and checkpoints -- for N = 2, 3, 4 (odd N included)."""
import math
import re
import subprocess
from pathlib import Path

import pytest
import torch

import hvd_ext
from hvd_ext.exchange import Exchange, cost
from hvd_ext.testing.simulated import SimulatedWorld
from hvd_ext.testing.harness import run_pipeline
from hvd_ext.exchange.routes import choose_route
from hvd_ext.exchange.routes.sparse_rs import decode_pairs, encode_pairs
from hvd_ext.exchange.routes.twophase import segments

from simgrads import SHAPES, make_grads, mean_of, relerr

ROOT = Path(__file__).resolve().parents[1]


# ---- one seam ------------------------------------------------------------------------------------
def test_no_horovod_collective_outside_the_exchange_package():
    pat = re.compile(r"hvd\.(allreduce|allgather|alltoall|broadcast|reducescatter|grouped_allreduce|synchronize)"
                     r"[a-z_]*\(")
    offenders = [str(p.relative_to(ROOT)) for p in (ROOT / "hvd_ext").rglob("*.py")
                 if "exchange" not in p.relative_to(ROOT).parts and pat.search(p.read_text())]
    assert offenders == []


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


# ---- routes chosen identically, from the spec and the cost model --------------------------------
def test_route_choice():
    c = hvd_ext.compression_from_spec
    assert choose_route(c("none"), "auto", 10 ** 6, 8) == "allreduce"
    assert choose_route(c("qsgd:bits=8"), "auto", 10 ** 6, 2) == "allgather"   # same bytes, one collective
    assert choose_route(c("qsgd:bits=8"), "auto", 10 ** 6, 8) == "twophase"
    assert choose_route(c("topk:ratio=0.01"), "auto", 10 ** 6, 8) == "sparse_rs"
    assert choose_route(c("qsgd:bits=8"), "allgather", 10 ** 6, 8) == "allgather"
    assert choose_route(c("qsgd:bits=8"), "twophase", 100, 2) == "twophase"
    assert choose_route(c("qsgd:bits=8"), "auto", 10, 64) == "allgather"      # latency-bound tiny bucket
    with pytest.raises(ValueError, match="accepted: auto"):
        choose_route(c("fp16"), "twophase", 10, 4)
    with pytest.raises(ValueError, match="exchange"):
        c("qsgd:exchange=ring")
    assert c("qsgd:bits=8,exchange=twophase").spec() == "qsgd:bits=8,exchange=twophase"


def test_cost_model_bytes_per_rank():
    n, C = 10 ** 6, 10 ** 6  # 8-bit codes
    for N in (2, 4, 8, 1024):
        assert cost.per_rank("twophase", n, C, N)["wire"] == pytest.approx(2 * (N - 1) / N * C)
        assert cost.per_rank("allgather", n, C, N)["wire"] == pytest.approx((N - 1) * C)
        assert cost.per_rank("allreduce", n, C, N)["wire"] == pytest.approx(2 * (N - 1) / N * 4 * n)
    rows = cost.project(n, C, [2, 1024])
    assert rows[1]["allgather_wire"] > 500 * rows[1]["twophase_wire"]


def test_segments_cover_every_element_once():
    sizes = [5, 1, 17, 0, 9]
    for parts in (1, 2, 3, 4, 7):
        seen = [torch.zeros(s, dtype=torch.int32) for s in sizes]
        for shard in segments(sizes, parts):
            for i, a, b in shard:
                seen[i][a:b] += 1
        assert all(bool((s == 1).all()) for s in seen)


@pytest.mark.parametrize("span", [10, 70000])
def test_pair_codec_round_trip(span):
    idx = torch.tensor([0, 3, span - 1])
    vals = torch.tensor([1.5, -2.0, 3.25])
    got_i, got_v = decode_pairs(encode_pairs(idx, vals, span, torch.float32), span, torch.float32)
    assert got_i.tolist() == idx.tolist() and torch.equal(got_v, vals)
    assert encode_pairs(idx, vals, span, torch.float32).numel() == 3 * (4 + (2 if span <= 65536 else 4))


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


@pytest.mark.parametrize("spec,bound", [("fp16:feedback=residual", 1e-6), ("bf16:feedback=residual", 1e-4)])
def test_cast_codec_with_feedback_keeps_the_average(spec, bound):
    """Under error feedback (as compression=auto runs a chosen fp16/bf16) the codec decodes its own
    payload after the average: that must not land in the buffer holding the average."""
    shapes = {"w": (300, 300), "b": (7,)}
    grads = make_grads(2, 3, seed=1, shapes=shapes)
    runs = run_pipeline(spec, grads, 2)
    for step in range(3):
        assert relerr(runs[0].results[step], mean_of(grads, step, 2)) < bound, step


@pytest.mark.parametrize("size", [2, 3, 4])
@pytest.mark.parametrize("spec", ["topk:ratio=0.05", "topk:ratio=0.05,feedback=ewma", "topk:ratio=0.05,values=fp16",
                                  "sig:ratio=0.05", "sig:ratio=0.05,split=layer,mode=sampled",
                                  "sig:ratio=0.05,split=global,feedback=ewma"])
def test_flat_bucket_equals_per_tensor_payloads(size, spec, monkeypatch):
    """topk scope=model and sig go as one flat payload per bucket (allgather at N=2, sparse
    reduce-scatter beyond): the same selection (sig still scores and budgets every tensor with its
    own parameter), so results and error-feedback memories equal those of one payload per tensor."""
    from hvd_ext.compression.sig import SignificanceCompressor
    from hvd_ext.compression.topk import TopKCompressor

    grads = make_grads(size, 3, seed=7)
    params = {k: torch.rand(*s) + 0.1 for k, s in SHAPES.items()}
    flat = run_pipeline(spec, grads, size, params=params)
    assert flat[0].pipeline.compressor.bucket_flat
    for cls in (TopKCompressor, SignificanceCompressor):
        monkeypatch.setattr(cls, "bucket_flat", property(lambda self: False))
    per_tensor = run_pipeline(spec, grads, size, params=params)
    assert flat[0].routes == per_tensor[0].routes
    for a, b in zip(flat, per_tensor):
        for step in range(3):
            for k in SHAPES:
                assert torch.allclose(a.results[step][k], b.results[step][k], atol=1e-6), (step, k)
        ma, mb = a.pipeline.feedback.state_dict()["memory"], b.pipeline.feedback.state_dict()["memory"]
        assert set(ma) == set(mb) and set(SHAPES) <= set(ma)
        for k in ma:
            assert torch.allclose(ma[k], mb[k], atol=1e-6), k
        # one payload per bucket: fewer header bytes than one per tensor
        assert a.exchange.stats.bytes_sent < b.exchange.stats.bytes_sent


@pytest.mark.parametrize("size", [2, 3, 4])
@pytest.mark.parametrize("spec,bound", [("int8", 1e-3), ("qsgd:bits=8", 0.05), ("efsignsgd", 1.2),
                                        ("qdist:bits=3", 0.6), ("natural", 0.4), ("onebit", 1.2)])
def test_twophase_matches_the_mean_within_codec_error(size, spec, bound):
    grads = make_grads(size, 2, seed=size)
    runs = run_pipeline(spec + (",exchange=twophase" if ":" in spec else ":exchange=twophase"), grads, size)
    ref = mean_of(grads, 0, size)
    first = runs[0].results[0]
    for run in runs:
        assert run.routes == ["twophase"]
        for k in first:  # every rank decodes the same bytes: identical results
            assert torch.equal(run.results[0][k], first[k])
    assert relerr(first, ref) < bound


def test_twophase_int8_equals_allgather_up_to_rounding():
    grads = make_grads(3, 1, seed=5)
    tp = run_pipeline("int8:exchange=twophase", grads, 3)[0].results[0]
    ag = run_pipeline("int8:exchange=allgather", grads, 3)[0].results[0]
    for k in tp:
        assert torch.allclose(tp[k], ag[k], atol=0.05)


@pytest.mark.parametrize("size", [2, 3, 4])
def test_sparse_reduce_scatter_equals_global_topk_reference(size):
    """One step, no prior memory: the result equals, per owner range, the ceil(received/N)
    largest entries of the sum of every rank's top-k selection (gTop-k)."""
    grads = make_grads(size, 1, seed=10 + size)
    spec = "topk:ratio=0.05,scope=layer,exchange=twophase,feedback=none"  # k per tensor, as below
    runs = run_pipeline(spec, grads, size)
    names = list(SHAPES)
    # reference, from all ranks' inputs: buckets are filled in reverse parameter order
    order = list(reversed(names))
    flat = [torch.cat([grads[0][r][k].reshape(-1) for k in order]) for r in range(size)]
    total = flat[0].numel()
    sel_sum = torch.zeros(total)
    received = torch.zeros(size, dtype=torch.long)
    bounds = [0]
    for s in [total // size + (1 if j < total % size else 0) for j in range(size)]:
        bounds.append(bounds[-1] + s)
    start = 0
    for k in order:
        n = grads[0][0][k].numel()
        kk = math.ceil(0.05 * n)
        for r in range(size):
            idx = torch.topk(grads[0][r][k].reshape(-1).abs(), kk).indices + start
            sel_sum[idx] += flat[r][idx]
            for j in range(size):
                received[j] += int(((idx >= bounds[j]) & (idx < bounds[j + 1])).sum())
        start += n
    ref = torch.zeros(total)
    for j in range(size):
        lo, hi = bounds[j], bounds[j + 1]
        budget = math.ceil(int(received[j]) / size)
        part = sel_sum[lo:hi]
        top = torch.topk(part.abs(), budget).indices
        ref[lo + top] = part[top] / size
    got = torch.cat([runs[0].results[0][k].reshape(-1) for k in order])
    assert runs[0].routes == ["sparse_rs"]
    assert torch.allclose(got, ref, atol=1e-6)
    for run in runs[1:]:
        assert torch.equal(torch.cat([run.results[0][k].reshape(-1) for k in order]), got)


@pytest.mark.parametrize("size", [3, 4])
@pytest.mark.parametrize("spec", ["topk:ratio=0.02,exchange=twophase", "efsignsgd:exchange=twophase",
                                  "sig:ratio=0.02,exchange=twophase", "randomk:ratio=0.05,exchange=twophase"])
def test_conservation_with_owner_memory(size, spec):
    """Sum over steps of N x mean gradient = sum of applied results x N
    + every worker's residual + every owner's residual (nothing lost, nothing counted twice)."""
    steps = 5
    grads = make_grads(size, steps, seed=3)
    params = {k: torch.rand(*s) + 0.1 for k, s in SHAPES.items()}
    runs = run_pipeline(spec, grads, size, params=params)
    for k in SHAPES:
        total_g = sum(grads[s][r][k] for s in range(steps) for r in range(size)).reshape(-1)
        applied = sum(runs[0].results[s][k] for s in range(steps)).reshape(-1) * size
        worker = sum(run.pipeline.feedback.memory.get(k, torch.zeros(1)).reshape(-1) for run in runs)
        owner = torch.zeros_like(total_g)
        for run in runs:
            mem = run.pipeline.owner_memory.memory
            for key, v in mem.items():
                if re.fullmatch(r"b\d+:owner", key):                    # sparse: full bucket vector
                    order = list(reversed(list(SHAPES)))
                    off = sum(math.prod(SHAPES[x]) for x in order[:order.index(k)])
                    owner += v[off:off + total_g.numel()]                # sums over ranks
                elif key.startswith(f"{k}@"):                            # two-phase: one segment
                    a = int(key.split("@")[1].split(":")[0])
                    owner[a:a + v.numel()] += v * size                  # averages
        assert torch.allclose(applied + worker + owner, total_g, atol=2e-3), k


# ---- bytes per rank ----------------------------------------------------------------------------
def test_received_bytes_stay_flat_in_n():
    """Bytes received per rank per step: two-phase and sparse reduce-scatter grow like 2(N-1)/N,
    the allgather like N-1."""
    shapes = {"w": (256, 256)}
    got = {}
    for spec in ("qsgd:bits=8", "topk:ratio=0.01"):
        for ex in ("allgather", "twophase"):
            for size in (2, 4, 8):
                run = run_pipeline(f"{spec},exchange={ex}", make_grads(size, 1, shapes=shapes), size)[0]
                got[spec, ex, size] = run.received[0]
    n = 256 * 256
    for spec in ("qsgd:bits=8", "topk:ratio=0.01"):
        ag, tp = [got[spec, "allgather", s] for s in (2, 4, 8)], [got[spec, "twophase", s] for s in (2, 4, 8)]
        assert ag[2] > 6 * ag[0]                       # allgather: ~ (N-1)
        assert tp[2] <= 1.9 * tp[0]                    # two-phase: 2(N-1)/N, 1.75 from N=2 to N=8
        assert tp[2] < ag[2] / 3
    # 8-bit QSGD two-phase at N=8 moves >= 2x fewer bytes than a dense ring allreduce
    assert got["qsgd:bits=8", "twophase", 8] * 2 <= 2 * 7 / 8 * 4 * n


# ---- non-finite and checkpoints ------------------------------------------------------------------
@pytest.mark.parametrize("spec", ["efsignsgd:exchange=twophase", "topk:ratio=0.05,exchange=twophase"])
def test_nonfinite_on_one_rank_skips_everywhere_and_keeps_memories(spec):
    size = 3
    grads = make_grads(size, 3, seed=7)
    grads[1][2]["w1"][0, 0] = float("nan")
    snap = {}

    def before(rank, step, pipe):
        if step == 1:
            snap[rank] = ({k: v.clone() for k, v in pipe.feedback.memory.items()},
                          {k: v.clone() for k, v in pipe.owner_memory.memory.items()})
        if step == 2:
            fb, ow = snap[rank]
            assert fb.keys() == pipe.feedback.memory.keys() and ow.keys() == pipe.owner_memory.memory.keys()
            assert all(torch.equal(fb[k], pipe.feedback.memory[k]) for k in fb)
            assert all(torch.equal(ow[k], pipe.owner_memory.memory[k]) for k in ow)

    runs = run_pipeline(spec, grads, size, before_step=before)
    assert [r.skipped for r in runs] == [[False, True, False]] * size


def test_owner_memory_survives_a_checkpoint():
    size, spec = 3, "efsignsgd:exchange=twophase"
    grads = make_grads(size, 4, seed=11)
    full = run_pipeline(spec, grads, size)
    saved = {}

    def save(rank, step, pipe):
        if step == 2:
            saved[rank] = pipe.state_dict()

    run_pipeline(spec, grads[:3], size, before_step=save)

    def load(rank, step, pipe):
        if step == 0:
            pipe.load_state_dict(saved[rank])

    resumed = run_pipeline(spec, grads[2:], size, before_step=load)
    for r in range(size):
        for k in SHAPES:
            assert torch.equal(resumed[r].results[1][k], full[r].results[3][k])
    assert any(k.endswith(":owner") for k in saved[0]["owner"])


# ---- the same routes on real Horovod ranks (Gloo), odd and even N ----------------------------------
@pytest.mark.parametrize("np_", [3, 4])
def test_real_horovod_routes_equal_the_simulated_world(np_):
    from conftest import launch

    results = launch("exchange_scale.py", np=np_, launcher="gloo", timeout=300)
    for r in results:
        assert r["size"] == np_
        for spec in ("qsgd:bits=8,exchange=twophase", "efsignsgd:exchange=twophase",
                     "topk:ratio=0.02,exchange=twophase", "sig:ratio=0.02,exchange=twophase",
                     "topk:ratio=0.02", "qdist:bits=3", "fp16", "bf16"):
            x = r[spec]
            assert x["bitwise"], (spec, x["max_diff"])
            assert x["recv"] == x["sim_recv"], spec
            assert x["spread"] == 0.0, spec
        assert r["bf16"]["routes"] == r["fp16"]["routes"] == ["allreduce"]
        assert r["qsgd:bits=8,exchange=twophase"]["routes"] == ["twophase"]
        assert r["topk:ratio=0.02,exchange=twophase"]["routes"] == ["sparse_rs"]
