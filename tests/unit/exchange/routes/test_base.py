"""hvd_ext.exchange.routes.base: flat bucket records, and the owner-side memory of the two-phase and
sparse reduce-scatter routes (conservation, non-finite steps, checkpoints), on simulated ranks."""
import math
import re

import pytest
import torch

from hvd_ext.testing.harness import run_pipeline

from helpers.simgrads import SHAPES, make_grads


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


@pytest.mark.parametrize("size", [3, 4])
@pytest.mark.parametrize("spec", ["topk:ratio=0.02,route=twophase", "efsignsgd:route=twophase",
                                  "sig:ratio=0.02,route=twophase", "randomk:ratio=0.05,route=twophase"])
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


def _owner_residual(runs, name):
    """Every rank's sparse reduce-scatter owner residual of tensor ``name`` (summed over ranks)."""
    order = list(reversed(list(SHAPES)))
    off = sum(math.prod(SHAPES[x]) for x in order[:order.index(name)])
    n = math.prod(SHAPES[name])
    return sum(v[off:off + n] for run in runs for key, v in run.pipeline.owner_memory.memory.items()
               if re.fullmatch(r"b\d+:owner", key))


def _skewed_grads(size, steps):
    """Gradients whose largest entries fill one owner's range until the ranges move: the small tensors
    come first in the bucket, "w1" last, and its first rows are large."""
    grads = make_grads(size, steps, seed=5)
    for per_rank in grads:
        for g in per_rank:
            g["w1"][:20] *= 30.0
    return grads


def _even_bounds(size):
    from hvd_ext.exchange.transport import offsets, split_sizes

    total = sum(math.prod(s) for s in SHAPES.values())
    return torch.tensor([0] + [hi for _, hi in offsets(split_sizes(total, size))])


def _assert_conserved(grads, runs, size, skipped):
    """Every rank's gradients over the live steps = applied results x N + worker and owner residuals."""
    assert all(r.skipped[s] == (s == skipped) for r in runs for s in range(len(grads)))
    live = [s for s in range(len(grads)) if s != skipped]
    for k in SHAPES:
        total_g = sum(grads[s][r][k] for s in live for r in range(size)).reshape(-1)
        applied = sum(runs[0].results[s][k] for s in live).reshape(-1) * size
        worker = sum(run.pipeline.feedback.memory.get(k, torch.zeros(1)).reshape(-1) for run in runs)
        assert torch.allclose(applied + worker + _owner_residual(runs, k), total_g, atol=2e-3), k


@pytest.mark.parametrize("skip_after", [False, True])
def test_owner_residual_moves_with_rebalanced_ranges(skip_after):
    """Entries concentrated in one owner's range move the ranges at the first rebalance; the owner
    residual left outside a rank's new range travels to its new owner (nothing lost), also when the
    step after the rebalance is skipped for a non-finite value and the next one carries instead."""
    from hvd_ext.exchange.routes.sparse_rs import REBALANCE_EVERY

    size, steps = 3, REBALANCE_EVERY + 4
    grads = _skewed_grads(size, steps)
    skipped = REBALANCE_EVERY if skip_after else None
    if skip_after:
        grads[skipped][1]["b2"][0] = float("nan")
    bounds, outside = {}, []

    def watch(rank, step, pipe):
        mem = pipe.owner_memory.memory
        bounds[step] = {k: v.clone() for k, v in mem.items() if k.endswith(":bounds")}
        if step == REBALANCE_EVERY:   # residual kept for the old range that the new one leaves out
            for key, b in bounds[step].items():
                owner = mem[key.split("@")[0] + ":owner"]
                lo, hi = int(b[rank]), int(b[rank + 1])
                outside.append(bool(owner[:lo].any() or owner[hi:].any()))

    runs = run_pipeline("topk:ratio=0.02,route=twophase", grads, size, before_step=watch)
    assert runs[0].routes[-1] == "sparse_rs"
    assert not bounds[REBALANCE_EVERY - 1]   # the ranges start even (nothing kept)
    even = _even_bounds(size)
    assert any(not torch.equal(v, even) for v in bounds[REBALANCE_EVERY].values()), "the ranges should have moved"
    assert any(outside), "some owner residual should lie outside its rank's new range (the case that carries)"
    _assert_conserved(grads, runs, size, skipped)


def test_owner_residual_moves_after_a_load_that_moves_the_ranges_and_a_skipped_step():
    """A resume that brings other ranges than the residual was kept for (a lagging rank takes the most
    advanced rank's ranges): the residual outside the new range still reaches its owner when the first
    step after the load is skipped for a non-finite value."""
    from hvd_ext.exchange.routes.sparse_rs import REBALANCE_EVERY

    size, steps, load_at = 3, REBALANCE_EVERY + 6, REBALANCE_EVERY + 2
    grads = _skewed_grads(size, steps)
    grads[load_at][1]["b2"][0] = float("nan")
    even = _even_bounds(size)
    moved = []

    def load_even_ranges(rank, step, pipe):
        if step == load_at:
            sd = pipe.owner_memory.state_dict()
            moved.extend(not torch.equal(v, even) for k, v in sd.items() if k.endswith(":bounds"))
            pipe.owner_memory.load_state_dict({k: (even.clone() if k.endswith(":bounds") else v)
                                               for k, v in sd.items()})

    runs = run_pipeline("topk:ratio=0.02,route=twophase", grads, size, before_step=load_even_ranges)
    assert any(moved), "the load should move the ranges back"
    _assert_conserved(grads, runs, size, load_at)


def test_owner_residual_is_scanned_only_where_a_range_may_have_moved(monkeypatch):
    """The pass over the whole bucket that finds residual outside a rank's range runs on a route's
    first step with a residual and on the step after a rebalance, not on the others."""
    from hvd_ext.exchange.routes import sparse_rs

    scans = []
    orig = sparse_rs.SparseReduceScatterRoute._ranges_may_have_moved

    def spy(self):
        moved = orig(self)
        if moved and self.exchange.rank == 0:
            scans.append(self.records[0].info.step)
        return moved

    monkeypatch.setattr(sparse_rs.SparseReduceScatterRoute, "_ranges_may_have_moved", spy)
    steps = 2 * sparse_rs.REBALANCE_EVERY + 2
    run_pipeline("topk:ratio=0.02,route=twophase", make_grads(3, steps, seed=2), 3)
    assert scans == [1, sparse_rs.REBALANCE_EVERY, 2 * sparse_rs.REBALANCE_EVERY]

    def reload(rank, step, pipe):   # a checkpoint loaded at step 5: its residual may lie anywhere
        if step == 5:
            saved = pipe.state_dict()
            assert not any(k.endswith(":scanned") for k in saved["owner"]), "a note is never saved"
            pipe.load_state_dict(saved)

    scans.clear()
    run_pipeline("topk:ratio=0.02,route=twophase", make_grads(3, 8, seed=2), 3, before_step=reload)
    assert scans == [1, 5]


# ---- non-finite and checkpoints ------------------------------------------------------------------
@pytest.mark.parametrize("spec", ["efsignsgd:route=twophase", "topk:ratio=0.05,route=twophase"])
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
    size, spec = 3, "efsignsgd:route=twophase"
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
