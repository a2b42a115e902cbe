"""Node-aware (hierarchical) route: dense inside a node, compressed across nodes. The real
GradientPipeline on simulated worlds laid out on nodes (2 x 2, 2 x 3, 3 x 2): results against the
flat exchange and the exact mean, bytes across nodes, memory conservation (worker + node + owner
memories), non-finite skipping, checkpoints. The same code on real ranks over two network
namespaces: tests/multirank/test_hierarchy.py."""
import math
import re

import pytest
import torch

import hvd_ext
from hvd_ext.testing.harness import run_pipeline

from helpers.simgrads import SHAPES, make_grads, mean_of, relerr

ORDER = list(reversed(list(SHAPES)))  # one bucket, filled in reverse parameter order


LAYOUTS = [(4, 2), (6, 3), (6, 2)]   # (N, ranks per node): 2 nodes x 2, 2 nodes x 3, 3 nodes x 2


def with_key(spec, kv):
    return spec + ("," if ":" in spec else ":") + kv


# ---- the spec key ------------------------------------------------------------------------------------
def test_hierarchy_spec_key():
    c = hvd_ext.compression_from_spec
    assert c("qsgd:bits=8").hierarchy == "auto"
    assert c("topk:ratio=0.05,hierarchy=flat").spec() == "topk:ratio=0.05,hierarchy=flat"
    assert c("none:hierarchy=flat").hierarchy == "flat"
    with pytest.raises(ValueError, match="hierarchy"):
        c("qsgd:hierarchy=ring")


# ---- results: node-aware equals flat within the codec's error ---------------------------------------
@pytest.mark.parametrize("size,L", LAYOUTS)
def test_none_is_the_exact_mean(size, L):
    grads = make_grads(size, 2, seed=size)
    runs = run_pipeline("none", grads, size, ranks_per_node=L)
    for run in runs:
        assert run.routes == ["node:allreduce"]
        for s in range(2):
            ref = mean_of(grads, s, size)
            for k in ref:
                assert torch.allclose(run.results[s][k], ref[k], atol=1e-6, rtol=0)


@pytest.mark.parametrize("size,L", LAYOUTS)
@pytest.mark.parametrize("spec,route,bound", [
    ("fp16", "node:allreduce", 1e-5),
    ("bf16", "node:allreduce", 1e-2),
    ("qsgd:bits=8", "node:allgather", 0.02),
    ("qsgd:bits=8,route=twophase", "node:twophase", 0.02),
    ("int8:route=twophase", "node:twophase", 1e-3),
    ("topk:ratio=0.05", "node:allgather", 0.9),
    ("topk:ratio=0.05,route=twophase", "node:sparse_rs", 0.9),
    ("efsignsgd", "node:allgather", 1.2),
])
def test_node_aware_matches_flat_within_codec_error(size, L, spec, route, bound):
    grads = make_grads(size, 2, seed=10 + size)
    runs = run_pipeline(spec, grads, size, ranks_per_node=L)
    flat = run_pipeline(with_key(spec, "hierarchy=flat"), grads, size, ranks_per_node=L)
    assert not flat[0].routes[0].startswith("node:")
    ref = mean_of(grads, 0, size)
    first = runs[0].results
    for run in runs:
        assert run.routes == [route]
        for s in range(2):  # every rank ends with the same bytes
            assert all(torch.equal(run.results[s][k], first[s][k]) for k in SHAPES)
    e_node, e_flat = relerr(first[0], ref), relerr(flat[0].results[0], ref)
    assert e_node < bound and e_flat < bound
    assert e_node < 1.5 * e_flat + 1e-6, (e_node, e_flat)  # same codec, same error level


@pytest.mark.parametrize("size,L", LAYOUTS)
def test_inter_node_bytes_drop(size, L):
    """Per rank across nodes: the node-aware two-phase exchange moves ~1/L of the compressed bucket's
    share the flat one moves off-node, the dense bytes stay inside the node."""
    shapes = {"w": (128, 128)}
    grads = make_grads(size, 1, shapes=shapes)
    node = run_pipeline("qsgd:bits=8,route=twophase", grads, size, ranks_per_node=L)[0]
    flat = run_pipeline("qsgd:bits=8,route=twophase,hierarchy=flat", grads, size, ranks_per_node=L)[0]
    links = node.exchange.stats.wire_by_link
    flat_off_node = flat.wire[0] * (size - L) / (size - 1)
    assert links["inter"] < 1.3 * flat_off_node / L, (links, flat.wire)
    assert links["intra"] >= 2 * (L - 1) / L * 4 * 128 * 128 * 0.99


# ---- memory conservation --------------------------------------------------------------------------
@pytest.mark.parametrize("size,L", LAYOUTS)
@pytest.mark.parametrize("spec", ["topk:ratio=0.02", "topk:ratio=0.02,route=twophase",
                                  "efsignsgd:route=twophase", "efsignsgd"])
def test_conservation_node_and_owner_memory(size, L, spec):
    """Sum over steps of every rank's gradient = N x applied results + worker residuals
    + node memories (shard holders) + owner memories of the inner exchange (nothing lost)."""
    steps = 4
    grads = make_grads(size, steps, seed=3)
    params = {k: torch.rand(*s) + 0.1 for k, s in SHAPES.items()}
    runs = run_pipeline(spec, grads, size, params=params, ranks_per_node=L)
    assert runs[0].routes[0].startswith("node:")
    sizes = [math.prod(SHAPES[k]) for k in ORDER]
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    total = sum(sizes)
    bucket = torch.zeros(total)
    for run in runs:
        route = run.pipeline.buckets[0].route
        me = run.rank % L
        for key, v in run.pipeline.owner_memory.memory.items():
            m = re.fullmatch(r"(\w+)@(\d+):node(?:@(\d+):owner)?", key)
            if m:  # node memory of a shard segment, or the two-phase owner memory of a piece of it
                a = starts[ORDER.index(m.group(1))] + int(m.group(2)) + int(m.group(3) or 0)
                bucket[a:a + v.numel()] += v.reshape(-1)
            elif re.fullmatch(r"b0\.x:owner", key):  # sparse reduce-scatter owner: inner bucket vector
                off = 0
                for (i, a, b) in route.segs[me]:
                    g = starts[i] + a
                    bucket[g:g + (b - a)] += v[off:off + (b - a)]
                    off += b - a
            elif key.endswith(":bounds") or key.endswith(":scanned"):   # owner ranges, what was scanned for
                continue
            else:
                raise AssertionError(f"unexpected owner-memory key {key}")
    for k, st, n in zip(ORDER, starts, sizes):
        total_g = sum(grads[s][r][k] for s in range(steps) for r in range(size)).reshape(-1)
        applied = sum(runs[0].results[s][k] for s in range(steps)).reshape(-1) * size
        worker = sum(run.pipeline.feedback.memory.get(k, torch.zeros(1)).reshape(-1) for run in runs)
        assert torch.allclose(applied + worker + bucket[st:st + n], total_g, atol=2e-3), k


# ---- non-finite, checkpoints ---------------------------------------------------------------------------
@pytest.mark.parametrize("spec", ["topk:ratio=0.05,route=twophase", "none", "qsgd:bits=8"])
def test_nonfinite_on_one_rank_skips_everywhere(spec):
    size, L = 4, 2
    grads = make_grads(size, 3, seed=7)
    grads[1][3]["w1"][0, 0] = float("nan")
    snap = {}

    def before(rank, step, pipe):
        if step == 1:
            snap[rank] = {k: v.clone() for k, v in pipe.owner_memory.memory.items()}
        if step == 2:
            ow = snap[rank]
            assert ow.keys() == pipe.owner_memory.memory.keys()
            assert all(torch.equal(ow[k], pipe.owner_memory.memory[k]) for k in ow)

    runs = run_pipeline(spec, grads, size, before_step=before, ranks_per_node=L)
    assert runs[0].routes[0].startswith("node:")
    assert [r.skipped for r in runs] == [[False, True, False]] * size


def test_node_memory_survives_a_checkpoint():
    size, L, spec = 4, 2, "topk:ratio=0.05"
    grads = make_grads(size, 4, seed=11)
    full = run_pipeline(spec, grads, size, ranks_per_node=L)
    saved = {}

    def save(rank, step, pipe):
        if step == 2:
            saved[rank] = pipe.state_dict()

    run_pipeline(spec, grads[:3], size, before_step=save, ranks_per_node=L)

    def load(rank, step, pipe):
        if step == 0:
            pipe.load_state_dict(saved[rank])

    resumed = run_pipeline(spec, grads[2:], size, before_step=load, ranks_per_node=L)
    for r in range(size):
        for k in SHAPES:
            assert torch.equal(resumed[r].results[1][k], full[r].results[3][k])
    assert any(k.endswith(":node") for k in saved[0]["owner"])


@pytest.mark.parametrize("size,L", LAYOUTS)
@pytest.mark.parametrize("spec", ["topk:ratio=0.05", "topk:ratio=0.05,values=fp16", "sig:ratio=0.05"])
def test_node_aware_flat_shard_equals_per_segment_payloads(size, L, spec, monkeypatch):
    """Across nodes a shard goes as one flat payload (bucket_flat codecs), its node memories kept per
    segment: results and memories equal those of one payload per segment, at 2 and 3 nodes."""
    from hvd_ext.compression.sig import SignificanceCompressor
    from hvd_ext.compression.topk import TopKCompressor

    grads = make_grads(size, 3, seed=5)
    params = {k: torch.rand(*s) + 0.1 for k, s in SHAPES.items()}
    flat = run_pipeline(spec, grads, size, params=params, ranks_per_node=L)
    assert flat[0].routes[0].startswith("node:")
    for cls in (TopKCompressor, SignificanceCompressor):
        monkeypatch.setattr(cls, "bucket_flat", property(lambda self: False))
    seg = run_pipeline(spec, grads, size, params=params, ranks_per_node=L)
    for a, b in zip(flat, seg):
        for step in range(3):
            for k in SHAPES:
                assert torch.allclose(a.results[step][k], b.results[step][k], atol=1e-6), (step, k)
        ma, mb = a.pipeline.owner_memory.memory, b.pipeline.owner_memory.memory
        assert set(ma) == set(mb)
        for k in ma:
            assert torch.allclose(ma[k].float(), mb[k].float(), atol=1e-6), k
