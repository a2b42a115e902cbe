"""hvd_ext.plan.model: the planner's bytes against the real pipeline on simulated worlds, and its
step-time rules."""
import statistics

import pytest
import torch

from hvd_ext.exchange.cost import LinkModel
from hvd_ext.plan import plan
from hvd_ext.plan.model import (HOROVOD_FUSION_BYTES, BucketCost, Cluster, codec_costs, codec_rows, fused_groups,
                                horovod_rows, step_seconds)
from hvd_ext.spec import compression_from_spec
from hvd_ext.testing.harness import run_pipeline

SHAPES = [(64, 40), (64,), (128, 64, 3), (128,), (10, 512), (10,)]


def grads(size, steps=2):
    g = torch.Generator().manual_seed(0)
    return [[{f"p{i}": torch.randn(s, generator=g) for i, s in enumerate(SHAPES)} for _ in range(size)]
            for _ in range(steps)]


def predicted_wire(spec, route, size, shapes=SHAPES):
    p = plan(shapes, compute_s=0.0, cluster=None, nodes=1, gpus_per_node=size, device="cpu", methods=[spec],
             intra=LinkModel(), breakeven_search=False)
    return p.row(spec, route).wire


# (spec, planner route, relative tolerance): payload sizes that follow from the shapes are exact
# (a few bytes of the non-finite flag's allreduce aside), on the two-phase route too, whose alltoall is
# priced by what each rank's link carries (the larger of what it sends and receives);
# the sparse reduce-scatter's pairs depend on where the selected entries fall (random gradients
# spread them evenly, as its model assumes).
CASES = [
    ("fp16", "allreduce", 0.0),
    ("powersgd:rank=2,warmup=0", "allreduce", 0.0),
    ("qsgd:bits=8,exchange=allgather", "allgather", 0.0),
    ("topk:ratio=0.01,exchange=allgather", "allgather", 0.0),   # one flat record per bucket, its size known
    ("sig:ratio=0.01,exchange=allgather", "allgather", 0.0),
    ("efsignsgd:exchange=allgather", "allgather", 0.0),
    ("qsgd:bits=4,exchange=twophase", "twophase", 0.005),
    ("efsignsgd:exchange=twophase", "twophase", 0.005),
    # bits per layer allocated from the gradients: priced by the same allocation for layers alike in all
    # but size, and the owners re-code at the budget's whole bits
    ("qdist:budget=2.5,exchange=twophase", "twophase", 0.02),
    ("qdist:budget=3.7,exchange=twophase", "twophase", 0.02),
    ("qdist:budget=4,exchange=twophase", "twophase", 0.005),
    ("topk:ratio=0.01,exchange=twophase", "sparse_rs", 0.05),
    ("topk:ratio=0.01,scope=layer,exchange=twophase", "sparse_rs", 0.05),
    ("topk:ratio=0.01,feedback=dgc_momentum,exchange=twophase", "sparse_rs", 0.05),
]


WORLDS = [(case, size) for case in CASES for size in (2, 3, 16)] + [(CASES[0], 64), (CASES[2], 64)]


@pytest.mark.parametrize("case,size", WORLDS, ids=[f"{c[0]}-N{n}" for c, n in WORLDS])
def test_wire_bytes_match_the_pipeline_on_a_simulated_world(case, size):
    spec, route, tol = case
    runs = run_pipeline(spec, grads(size), size)
    assert {r.routes[-1] for r in runs} == {route}
    measured = statistics.mean(r.wire[-1] for r in runs)  # the model is the ranks' average
    assert predicted_wire(spec, route, size) == pytest.approx(measured, rel=tol, abs=16)


@pytest.mark.parametrize("route", ["allgather", "twophase"])
def test_a_budget_over_one_layer_is_priced_at_the_bits_it_can_spend(route):
    """A bucket of one layer gets the budget's whole bits (a bit more for the whole layer does not fit):
    the planner allocates as the codec does, not at the budget's fraction."""
    shapes, spec = [(256, 512)], f"qdist:budget=2.5,exchange={route}"
    g = torch.Generator().manual_seed(3)
    runs = run_pipeline(spec, [[{"p0": torch.randn(shapes[0], generator=g)} for _ in range(2)]], 2)
    measured = statistics.mean(r.wire[-1] for r in runs)
    assert predicted_wire(spec, route, 2, shapes) == pytest.approx(measured, rel=0.01)


@pytest.mark.parametrize("scale", [[1, 1, 100, 1, 1, 1], [100, 1, 1, 1, 0.01, 1], [1, 10, 0.1, 10, 1, 100]])
@pytest.mark.parametrize("spec,route", [("qdist:budget=2.5,exchange=twophase", "twophase"),
                                        ("qdist:budget=3.7,exchange=twophase", "twophase"),
                                        ("qdist:budget=2.5,exchange=allgather", "allgather")])
def test_a_budget_over_layers_of_unlike_gradients_stays_an_estimate(spec, route, scale):
    """The allocation follows each layer's gradient, which the planner does not have: layers whose
    gradients differ by 100x move the bytes by a few percent from the planner's allocation."""
    g = torch.Generator().manual_seed(0)
    steps = [[{f"p{i}": f * torch.randn(s, generator=g) for i, (s, f) in enumerate(zip(SHAPES, scale))}
              for _ in range(4)] for _ in range(2)]
    runs = run_pipeline(spec, steps, 4)
    measured = statistics.mean(r.wire[-1] for r in runs)
    assert predicted_wire(spec, route, 4) == pytest.approx(measured, rel=0.08)


@pytest.mark.parametrize("spec", ["topk:ratio=0.01,exchange=twophase", "topk:ratio=0.01,values=fp16,exchange=twophase"])
def test_sparse_reduce_scatter_bytes_follow_its_index_width(spec):
    # owner ranges wider than 65536 entries carry 32-bit indices (phase 2: float32 values too)
    shapes = [(320, 512), (320,)]
    g = torch.Generator().manual_seed(1)
    grads = [[{f"p{i}": torch.randn(s, generator=g) for i, s in enumerate(shapes)} for _ in range(2)]]
    runs = run_pipeline(spec, grads, 2)
    measured = statistics.mean(r.wire[-1] for r in runs)
    assert predicted_wire(spec, "sparse_rs", 2, shapes) == pytest.approx(measured, rel=0.05)


@pytest.mark.parametrize("spec", ["topk:ratio=0.01,exchange=twophase", "topk:ratio=0.01,scope=layer,exchange=twophase",
                                  "topk:ratio=0.01,feedback=dgc_momentum,exchange=twophase"])
def test_sparse_reduce_scatter_selects_as_the_codec_scopes(spec):
    # many small tensors: k per tensor (at least one each) is far above k over the bucket
    shapes = [(10,)] * 60 + [(20000,)]
    g = torch.Generator().manual_seed(2)
    grads = [[{f"p{i}": torch.randn(s, generator=g) for i, s in enumerate(shapes)} for _ in range(2)]]
    runs = run_pipeline(spec, grads, 2)
    measured = statistics.mean(r.wire[-1] for r in runs)
    assert predicted_wire(spec, "sparse_rs", 2, shapes) == pytest.approx(measured, rel=0.05)


def test_sparse_reduce_scatter_bytes_are_its_steady_state_after_the_first_rebalance():
    """Entries concentrated in a few tensors load their owners unevenly (more than 25% above the
    model) until the first rebalance moves the owner ranges to where the entries fall; from the
    step after the move (which carries the owner residual once) the model holds within 5%."""
    from hvd_ext.exchange.routes.sparse_rs import REBALANCE_EVERY

    size, scale = 4, [1.0, 1.0, 0.2, 1.0, 3.0, 3.0]
    g = torch.Generator().manual_seed(0)
    steps = [[{f"p{i}": f * torch.randn(s, generator=g) for i, (s, f) in enumerate(zip(SHAPES, scale))}
              for _ in range(size)] for _ in range(REBALANCE_EVERY + 3)]
    spec = "topk:ratio=0.01,exchange=twophase"
    runs = run_pipeline(spec, steps, size)
    predicted = predicted_wire(spec, "sparse_rs", size)
    measured = [statistics.mean(r.wire[s] for r in runs) for s in range(len(steps))]
    assert measured[0] > 1.25 * predicted                  # even ranges, uneven entries
    for s in (REBALANCE_EVERY + 1, REBALANCE_EVERY + 2):   # the ranges moved, the residual carried
        assert measured[s] == pytest.approx(predicted, rel=0.05)


@pytest.mark.parametrize("spec,collective", [("topk:ratio=0.01", "allgather"), ("sig:ratio=0.01", "allgather"),
                                             ("qsgd:bits=8", "allgather"), ("dgc:ratio=0.01", "alltoall"),
                                             ("dgc:ratio=0.01,mode=exact,scope=layer", "allgather")])
def test_allgather_priced_by_whether_the_ranks_know_the_sizes(spec, collective):
    """A bucket-wide top-k sends one flat record whose size every rank knows: a sized allgather.
    dgc's sampled count is read first: the route then gathers by an alltoall."""
    lat = {"allreduce": 1e-3, "allgather": 2e-3, "alltoall": 7e-3}
    c = Cluster(1, 4, LinkModel(), LinkModel(), codec={spec.split(":")[0]: float("inf")}, collective_lat=lat)
    costs = codec_costs(spec, compression_from_spec(spec), "allgather", [SHAPES], c)
    assert costs[0].latency == lat[collective]


@pytest.mark.parametrize("spec", ["qsgd:bits=8", "qdist:budget=4"])
def test_two_phase_gathers_the_owners_recoded_shards_by_a_sized_allgather(spec):
    """The owners re-code at sizes every rank knows -- under qdist's budget too, whose first phase
    sizes only the sender knows: an alltoall, then an allgather."""
    lat = {"allreduce": 1e-3, "allgather": 2e-3, "alltoall": 7e-3}
    c = Cluster(1, 4, LinkModel(), LinkModel(), codec={spec.split(":")[0]: float("inf")}, collective_lat=lat)
    costs = codec_costs(spec, compression_from_spec(spec), "twophase", [SHAPES], c)
    assert costs[0].latency == lat["alltoall"] + lat["allgather"]


@pytest.mark.parametrize("spec,route,calls", [
    ("qsgd:bits=8", "allgather", [2560, 64, 24576, 128, 5120, 10]),       # one call per tensor
    ("topk:ratio=0.01", "allgather", [32458]),                             # one flat record per bucket
    ("qsgd:bits=8", "twophase", [2560, 64, 13605, 10971, 128, 5120, 10]),  # each tensor's piece of each shard
    # every local rank's shard (the tensors' pieces), each cut again over the 2 nodes; all 4 ranks' calls
    ("qsgd:bits=8", "node:twophase", [2560, 64, 1434, 4057, 4058, 4057, 4057, 4057, 2856, 128, 1073, 4047, 10]),
    ("topk:ratio=0.01", "node:sparse_rs", [8115, 8115, 8114, 8114]),        # one flat record per node shard
])
def test_codec_priced_per_call_at_each_calls_speed(spec, route, calls):
    """A pass over a bucket costs what the route's codec calls cost, each at its size's speed: the fixed
    cost once per call, and on a CPU the compiled speed only for calls of compile_min elements or more."""
    from hvd_ext.exchange.routes import codec_calls
    comp = compression_from_spec(spec)
    parts, local = (2, 4) if route.startswith("node:") else (2, 1)
    assert codec_calls(comp, SHAPES, route, parts, local) == calls
    fam, fixed, eager, fast, big = spec.split(":")[0], 1e-4, 1e8, 1e9, 5000
    c = Cluster(parts if route.startswith("node:") else 1, local if route.startswith("node:") else 2,
                LinkModel(), LinkModel(), codec={fam: eager}, codec_fixed={fam: fixed},
                codec_compiled={fam: fast}, compile_min=big)
    cost = codec_costs(spec, comp, route, [SHAPES], c)[0]
    per_pass = sum(fixed + k / (fast if k >= big else eager) for k in calls)
    whole = {"allgather": per_pass * (1 + 2), "twophase": 2 * 2 * per_pass, "node:twophase": 2 * 2 * per_pass / local,
             "node:sparse_rs": 2 * 2 * per_pass / local}
    assert cost.code == pytest.approx(whole[route], rel=1e-9)


def test_a_codec_whose_count_the_data_decides_is_refused():
    with pytest.raises(ValueError, match="'threshold'.*cannot be predicted.*accepted: codecs of a fixed size"):
        plan(SHAPES, compute_s=0.0, cluster=None, nodes=1, gpus_per_node=2, device="cpu", methods=["threshold"],
             intra=LinkModel(), breakeven_search=False)


def test_step_overlaps_exchange_with_backward():
    # one bucket released at the end of backward: nothing to overlap
    b = BucketCost(numel=100, wire=0, nic=0, latency=0, code=0, link_s=0.5)
    assert step_seconds([b], 0.3, False) == pytest.approx(0.8)
    # two buckets: the first one's exchange hides under the rest of backward
    b1 = BucketCost(numel=50, wire=0, nic=0, latency=0, code=0, link_s=0.05)
    b2 = BucketCost(numel=50, wire=0, nic=0, latency=0, code=0, link_s=0.05)
    assert step_seconds([b1, b2], 0.3, False) == pytest.approx(0.35)
    # on a CPU the codec runs on the compute core: it delays backward, not only the link
    c1 = BucketCost(numel=50, wire=0, nic=0, latency=0, code=0.1, link_s=0.0)
    assert step_seconds([c1, c1], 0.3, True) == pytest.approx(0.5)
    assert step_seconds([c1, c1], 0.3, False) == pytest.approx(0.4)


def test_a_second_round_is_a_collective_after_backward():
    """PowerSGD's buckets of matrices take two allreduce rounds: the first at its in-step cost, the second
    at the ranks-together cost, queued once backward is over; a bucket of vectors (sent dense) one."""
    busy, idle = {"allreduce": 10e-3}, {"allreduce": 2e-3}
    fast = LinkModel(bandwidth=float("inf"))  # only the collectives' fixed costs
    c = Cluster(1, 2, fast, fast, codec={"powersgd": float("inf")}, collective_lat=busy, idle_lat=idle)
    spec = "powersgd:warmup=0"
    matrices, vectors = codec_costs(spec, compression_from_spec(spec), "allreduce", [[(64, 40)], [(64,)]], c)
    assert (matrices.latency, matrices.tail_s) == (pytest.approx(12e-3), pytest.approx(2e-3))
    assert (vectors.latency, vectors.tail_s) == (pytest.approx(10e-3), 0.0)
    # the first bucket's second round waits for backward's end, after the second bucket's first round
    first = BucketCost(numel=50, wire=0, nic=0, latency=0, code=0, link_s=0.05, tail_s=0.02)
    last = BucketCost(numel=50, wire=0, nic=0, latency=0, code=0, link_s=0.05)
    assert step_seconds([first, last], 0.3, False) == pytest.approx(0.3 + 0.05 + 0.02)


def test_a_second_round_without_a_calibration_pays_its_messages_and_its_bytes_after_backward():
    """From a link model alone: two rounds' messages, the second's and Q's share of the bytes in the tail."""
    link = LinkModel(alpha=1e-3, bandwidth=1e6)
    c = Cluster(1, 2, link, link, codec={"powersgd": float("inf")})
    spec = "powersgd:warmup=0,rank=2"
    comp = compression_from_spec(spec)
    one = codec_costs(spec, comp, "allreduce", [[(64, 40)]], c)[0]
    n, m, r = 64, 40, 2  # P is n x r, Q m x r (float32); an allreduce of 2 ranks sends its payload once
    assert one.nic == pytest.approx(4 * (n + m) * r)
    assert one.latency == pytest.approx(2 * 2 * 1e-3)  # 2 messages per allreduce (2 ranks), two rounds
    assert one.tail_s == pytest.approx(2 * 1e-3 + 4 * m * r / 1e6)


def horovod_groups(shapes, compute_s, bandwidth, label="horovod"):
    """The element counts of the fused allreduces of Horovod's row ``label`` on 2 ranks, and its step."""
    link = LinkModel(alpha=0.0, bandwidth=bandwidth)
    c = Cluster(1, 2, link, link, codec={"fp16": float("inf")})
    row = next(r for r in horovod_rows(shapes, compute_s, c) if r.label == label)
    return [g.numel for g in row.groups], row.step_s


def test_horovod_fuses_what_backward_released_while_its_link_was_busy():
    """Horovod's thread takes every tensor released so far each time its link frees: a slow first
    allreduce lets the tensors behind it pile up into one; on a fast link each tensor goes alone."""
    shapes = [(1000, 1000)] * 10  # backward (0.2 s) releases one every 20 ms, the first at 0.12 s
    groups, step = horovod_groups(shapes, 0.3, 4e9)  # 4 MB of ring traffic each: 1 ms, idle in between
    assert groups == [10 ** 6] * 10
    assert step == pytest.approx(0.3 + 1e-3)
    groups, step = horovod_groups(shapes, 0.3, 4e7 / 1.05)  # 105 ms per tensor
    # the first ends at 0.225 s, when five more are out (0.14 ... 0.22 s); those end at 0.75 s, with the rest out
    assert groups == [10 ** 6, 5 * 10 ** 6, 4 * 10 ** 6]
    assert step == pytest.approx(0.12 + 0.105 * 10)


def test_horovod_fuses_what_one_cycle_releases_up_to_its_fusion_threshold():
    """Tensors released within a cycle of each other go in one allreduce, as long as it holds at most
    HOROVOD_FUSION_BYTES; float16 tensors take half the bytes, so twice as many fit."""
    assert len(horovod_groups([(1000, 1000)] * 10, 3e-4, 4e9)[0]) == 1  # backward: 0.2 ms
    big = [(20 * 2 ** 20,)] * 3  # 80 MiB each in float32, all released at once
    assert HOROVOD_FUSION_BYTES == 128 * 2 ** 20
    assert horovod_groups(big, 0.0, 1e9)[0] == [20 * 2 ** 20] * 3
    assert horovod_groups(big, 0.0, 1e9, "horovod fp16")[0] == [60 * 2 ** 20]


def test_an_allreduce_on_gpus_pays_nccls_tree_latency_across_nodes():
    """On a GPU cluster an allreduce's latency is the smaller of the ring's 2(N-1) alphas and NCCL's
    tree over the nodes with a chain in each (:func:`hvd_ext.exchange.cost.tree_allreduce_latency`);
    a CPU cluster (Gloo's ring) keeps the ring."""
    kw = dict(compute_s=0.0, cluster="dgx-a100", nodes=128, methods=[], breakeven_search=False)
    alpha = 5e-6  # the preset's latency, inside and across nodes
    gpu, cpu = plan(1_000_000, **kw), plan(1_000_000, device="cpu", **kw)
    assert gpu.row("horovod").buckets[0].latency == pytest.approx(2 * (7 + 7) * alpha)
    assert cpu.row("horovod").buckets[0].latency == pytest.approx(2 * 1023 * alpha)
    # the node-aware route's allreduce across the 128 nodes: a tree of depth 7 there too
    hier = gpu.row("horovod hierarchical").buckets[0]
    assert hier.latency == pytest.approx(2 * 7 * gpu.cluster.intra.alpha + 14 * alpha)
    p3 = plan(1_000_000, **{**kw, "cluster": "p3-v100-25gbe"})  # 5 us inside a node, 30 us across
    assert p3.row("horovod").buckets[0].latency == pytest.approx(2 * (7 * 5e-6 + 7 * 30e-6))


def fused_rows(spec, on_gpu, size=4, compute_s=0.0):
    """``spec``'s rows on ``size`` ranks whose link costs only its latency, over ten equal tensors in ten
    buckets, all released at once unless ``compute_s`` spreads them."""
    link = LinkModel(alpha=1e-3, bandwidth=float("inf"))
    c = Cluster(1, size, link, link, codec={spec.split(":")[0]: float("inf")}, codec_on_compute=not on_gpu,
                allreduce_tree=on_gpu)
    return {r.route: r for r in codec_rows(spec, [(1000, 1000)] * 10, compute_s, c, bucket_bytes=4 * 10 ** 6)}


def test_horovod_fuses_hvd_exts_bucket_allreduces_as_its_own_tensors():
    """hvd_ext starts a collective per bucket through Horovod, whose background thread fuses the
    allreduces that are ready together (one dtype, up to its threshold): the latency is paid once per
    group, the bytes are every bucket's."""
    row = fused_rows("fp16", on_gpu=True)["allreduce"]
    assert len(row.buckets) == 10 and len(row.groups) == 1
    assert row.groups[0].wire == pytest.approx(sum(b.wire for b in row.buckets))
    assert row.exchange_s == pytest.approx(2 * 3 * 1e-3)  # one ring's 2(N-1) messages, not ten
    assert row.step_s == pytest.approx(row.exchange_s)
    # released one by one over a slow backward, each goes alone when the link is idle
    slow = fused_rows("fp16", on_gpu=True, compute_s=3.0)["allreduce"]
    assert len(slow.groups) == 10


def test_what_horovod_does_not_fuse_pays_every_buckets_latency():
    """An alltoall is never fused (the two-phase route's first collective), nor hvd_ext's own
    float16 sum on a CPU (an alltoall, then an allgather); a gather of known sizes is, at its output's
    bytes, and so is that sum on two ranks, one allgather of a small bucket."""
    rows = fused_rows("qsgd:bits=8", on_gpu=True)
    assert len(rows["twophase"].groups) == 10
    assert len(rows["allgather"].groups) == 1
    gathered = rows["allgather"]  # each rank sends its payload to 3 others; Horovod counts all 4 it receives
    assert gathered.groups[0].fuse_bytes == pytest.approx(4 * sum(b.nic for b in gathered.buckets) / 3)
    cpu = fused_rows("fp16", on_gpu=False)["allreduce"]
    assert len(cpu.groups) == 10
    assert cpu.buckets[0].latency == pytest.approx(2 * 3 * 1e-3)  # an alltoall and an allgather, N-1 each
    two = fused_rows("fp16", on_gpu=False, size=2)["allreduce"]
    assert two.buckets[0].latency == pytest.approx(1e-3) and len(two.groups) == 1


def test_a_fused_group_pays_each_rounds_latency_once_and_stops_at_the_threshold():
    """PowerSGD's two rounds: a group pays the first round's latency and the second's once; items whose
    bytes pass HOROVOD_FUSION_BYTES together start a new group, and so does another key (the model does
    not look past it, as Horovod can)."""
    rows = fused_rows("powersgd:warmup=0,rank=2", on_gpu=True)["allreduce"]
    one = rows.buckets[0]
    assert one.tail_lat == pytest.approx(6e-3) and one.latency == pytest.approx(12e-3)
    (g,) = rows.groups
    assert (g.latency, g.tail_lat, g.tail_s) == (pytest.approx(12e-3), pytest.approx(6e-3), pytest.approx(6e-3))
    big = BucketCost(numel=1, wire=0, nic=0, latency=1.0, code=0, link_s=1.0, fuse="k",
                     fuse_bytes=HOROVOD_FUSION_BYTES / 2)
    assert [x.numel for x in fused_groups([big] * 5, 0.0, False)] == [2, 2, 1]
    other = BucketCost(**{**big.__dict__, "fuse": "other"})
    assert [x.numel for x in fused_groups([big, other, other], 0.0, False)] == [1, 2]


def test_a_larger_bucket_pays_the_latency_of_the_unfused_alltoalls_fewer_times():
    """``bucket_bytes`` is the optimizer's: the planner lays out buckets of that size. Where the latency
    per collective decides (a thousand GPUs), fewer buckets speed up a route that starts with an
    alltoall, which Horovod does not fuse; an allreduce route's buckets Horovod fuses either way."""
    kw = dict(cluster="p3-v100-25gbe", nodes=128, methods=["fp16", "topk:ratio=0.01"], breakeven_search=False)
    small, large = plan("bert-large", **kw), plan("bert-large", bucket_bytes=128 * 2 ** 20, **kw)
    a, b = small.row("topk:ratio=0.01", "node:sparse_rs"), large.row("topk:ratio=0.01", "node:sparse_rs")
    assert len(b.buckets) < len(a.buckets) and len(a.groups) == len(a.buckets)  # none fused
    assert b.wire == pytest.approx(a.wire, rel=1e-3)  # about the same bytes ...
    assert sum(g.latency for g in b.groups) < sum(g.latency for g in a.groups) / 5  # ... in fewer collectives
    assert b.step_s < a.step_s
    f_small, f_large = small.row("fp16", "allreduce"), large.row("fp16", "allreduce")
    assert len(f_small.groups) < len(f_small.buckets) / 5  # fused
    assert sum(g.latency for g in f_small.groups) < 2 * sum(g.latency for g in f_large.groups)


@pytest.mark.parametrize("cluster", ["p3-v100-25gbe", "pcie-consumer-10gbe", "dgx-a100"])
def test_the_planner_prices_a_gpu_allreduce_bucket_as_the_jobs_route_choice_does(cluster):
    """For a dense float16 bucket on a GPU cluster, the job's route choice for a fixed codec
    (:func:`hvd_ext.exchange.routes.route_options`, on GPU tensors, over the same links) gives the
    planner's flat and node-aware seconds (NCCL's tree included), the cast at the planner's speed:
    its default with no speed known on the V100 cluster (a job prices any GPU as a V100), else given."""
    from hvd_ext.plan.model import codec_timing

    from hvd_ext.exchange import cost
    from hvd_ext.exchange.routes import route_options
    from hvd_ext.exchange.transport import Topology
    from hvd_ext.spec import compression_from_spec

    from helpers.nodes import _Ex

    kw = dict(compute_s=0.0, cluster=cluster, nodes=128, methods=["fp16"], breakeven_search=False)
    p = plan([(2048, 2048)], **kw)
    links = cost.NodeModel(intra=p.cluster.intra, inter=p.cluster.inter)
    ex = _Ex(Topology(0, p.cluster.local, 0, 128), model=links)
    speed = None if cluster == "p3-v100-25gbe" else codec_timing("fp16", p.cluster).speed
    opts = route_options(compression_from_spec("fp16"), "auto", 2048 * 2048, 128 * p.cluster.local, exchange=ex,
                         device="cuda", codec=speed)
    flat, node = p.row("fp16", "allreduce").buckets[0], p.row("fp16", "node:allreduce").buckets[0]
    assert opts["flat_s"] == pytest.approx(flat.seconds, rel=1e-9)
    assert opts["node_s"] == pytest.approx(node.seconds, rel=1e-9)
    assert 0 < flat.code < 0.1 * flat.link_s   # the cast: its link time dwarfs it


def test_on_a_cpu_horovods_float16_casts_delay_backward_not_the_link():
    """Horovod's float16 compression casts each gradient in its hook: on a CPU (``codec_on_compute``)
    that time delays the tensors released after it; elsewhere it is on the exchange's side."""
    shapes = [(1000, 1000)] * 10   # backward (0.2 s) releases one every 20 ms
    link = LinkModel(alpha=0.0, bandwidth=4e9)   # 2 MB of float16 ring traffic each: 0.5 ms
    groups, steps = {}, {}
    for on_cpu in (True, False):
        c = Cluster(1, 2, link, link, codec={"fp16": 2e8}, codec_on_compute=on_cpu)  # 5 ms a pass, 10 ms a tensor
        row = next(r for r in horovod_rows(shapes, 0.3, c) if r.label == "horovod fp16")
        groups[on_cpu], steps[on_cpu] = [g.numel for g in row.groups], row.step_s
    assert groups[True] == groups[False] == [10 ** 6] * 10   # 30 and 20 ms apart: each goes alone
    assert steps[True] == pytest.approx(0.3 + 10 * 0.01 + 0.5e-3)   # backward took the casts too
    assert steps[False] == pytest.approx(0.3 + 0.01 + 0.5e-3)       # only the last tensor's after it
