"""hvd_ext.plan: the planner's answers, its inputs and its errors; the calibration file it shares
with ``auto``; the command line."""
import json
import math
import subprocess
import sys

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hvd_ext.exchange import calibration
from hvd_ext.exchange.cost import LinkModel
from hvd_ext.pipeline import FIRST_BUCKET_BYTES
from hvd_ext.plan import PAYS, auto_row, plan, tensor_shapes
from hvd_ext.plan.model import buckets_of
from hvd_ext.plan.presets import CLUSTERS, GBIT, MODELS


def test_compression_pays_on_a_slow_link_and_not_on_a_fast_one():
    slow = plan(25_600_000, compute_s=0.1, cluster=None, nodes=1, gpus_per_node=8, device="a100",
                intra=LinkModel(alpha=30e-6, bandwidth=1 * GBIT), breakeven_search=False)
    fast = plan(25_600_000, compute_s=0.1, cluster=None, nodes=1, gpus_per_node=8, device="a100",
                intra=LinkModel(alpha=5e-6, bandwidth=1000 * GBIT), breakeven_search=False)
    q_slow = slow.speedup(slow.row("qsgd:bits=8", "twophase"))
    q_fast = fast.speedup(fast.row("qsgd:bits=8", "twophase"))
    assert q_slow > 2.0 > q_fast
    assert fast.speedup(fast.row("qsgd:bits=8", "twophase"), "horovod fp16") < PAYS
    # bytes follow the codec: 8-bit codes on two phases, about a quarter of the dense ring's
    hv, q = slow.row("horovod"), slow.row("qsgd:bits=8", "twophase")
    assert 0.24 < q.wire / hv.wire < 0.27
    # auto picks a compressed codec on the slow link and the dense one on the fast link
    assert not any(k.startswith("none") for k in slow.auto_pick), slow.auto_pick
    assert all(k.startswith(("none", "fp16")) for k in fast.auto_pick), fast.auto_pick


@pytest.mark.parametrize("codec,refused_under", [("signum", "sgd"), ("efsignsgd", "adam")])
def test_auto_row_leaves_out_what_auto_refuses_under_the_optimizer(codec, refused_under):
    """auto allows no codec that compresses the momentum under momentum SGD (signum), nor one with a
    memory under Adam's live second moment (efsignsgd): on a slow link, where the planner's auto row
    picks them unbound, it keeps to ``none`` under the optimizer that refuses them."""
    p = plan(25_600_000, compute_s=0.1, cluster=None, nodes=1, gpus_per_node=8, device="a100",
             intra=LinkModel(alpha=30e-6, bandwidth=1 * GBIT), breakeven_search=False)
    picks = {o: auto_row(p.shapes, p.compute_s, p.cluster, p.bucket_bytes, candidates=("none", codec),
                         optimizer=o)[1] for o in ("none", refused_under)}
    assert all(k.startswith(codec) for k in picks["none"]), picks
    assert picks[refused_under] and all(k.startswith("none") for k in picks[refused_under]), picks


def test_breakeven_bandwidth_separates_paying_from_not():
    p = plan("resnet50", cluster="p3-v100-25gbe", nodes=4)
    be = p.inputs["breakeven"]["topk:ratio=0.01|node:sparse_rs"]
    assert 0 < be < math.inf
    from hvd_ext.plan import speedup_at, with_bandwidth
    r = p.row("topk:ratio=0.01", "node:sparse_rs")
    assert speedup_at(with_bandwidth(p.cluster, be / 2), p.shapes, p.compute_s, r, p.bucket_bytes) >= PAYS
    assert speedup_at(with_bandwidth(p.cluster, be * 2), p.shapes, p.compute_s, r, p.bucket_bytes) < PAYS


def test_node_aware_rows_only_across_nodes():
    one = plan("bert-large", cluster="dgx-a100", nodes=1, breakeven_search=False)
    many = plan("bert-large", cluster="dgx-a100", nodes=16, breakeven_search=False)
    assert not any(r.route.startswith("node:") for r in one.rows)
    assert {"horovod hierarchical", "qsgd:bits=8"} <= {r.label for r in many.rows if r.route.startswith("node:")}
    # the node-aware route puts a local_size-th of the flat two-phase bytes on each node's NIC
    flat, node = many.row("qsgd:bits=8", "twophase"), many.row("qsgd:bits=8", "node:twophase")
    assert node.nic < flat.nic / 4


def test_routes_follow_the_jobs_optimizer():
    """Under SGD momentum, sig keeps a masked per-rank velocity (momentum correction): no node-aware
    route, as DistributedOptimizer decides; under Adam or unbound it may take one."""
    kw = dict(compute_s=0.05, cluster="p3-v100-25gbe", nodes=2, methods=["sig:ratio=0.01", "qsgd:bits=8"],
              breakeven_search=False)
    routes = {o: {r.route for r in plan(2_000_000, optimizer=o, **kw).rows if r.label == "sig:ratio=0.01"}
              for o in ("sgd", "adam", "none")}
    assert routes["sgd"] == {"allgather", "sparse_rs"}
    assert routes["adam"] == routes["none"] == {"allgather", "sparse_rs", "node:allgather", "node:sparse_rs"}
    q = plan(2_000_000, optimizer="sgd", **kw)
    assert q.inputs["optimizer"] == "sgd" and "node:twophase" in {r.route for r in q.rows if r.label == "qsgd:bits=8"}


def test_model_inputs_agree():
    m = torch.nn.Sequential(torch.nn.Linear(40, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    shapes = tensor_shapes(m)
    assert shapes == [(64, 40), (64,), (10, 64), (10,)]
    assert tensor_shapes(m.named_parameters()) == shapes
    assert tensor_shapes([2560, 64]) == [(2560,), (64,)]
    assert sum(math.prod(s) for s in tensor_shapes(10_000_001)) == 10_000_001
    p = plan(m, compute_s=0.01, cluster="pcie-consumer-10gbe", breakeven_search=False)
    assert p.inputs["params"] == sum(q.numel() for q in m.parameters())
    assert p.row("horovod").wire == pytest.approx(2 * 7 / 8 * 4 * p.inputs["params"])


def test_published_models_give_their_compute_time():
    p = plan("resnet50", cluster="dgx-a100", breakeven_search=False)
    rn = MODELS["resnet50"]
    # 256 images per A100 step at its published ~2,600 images/s
    assert 0.08 < p.compute_s < 0.12 and p.inputs["params"] == rn.params


@pytest.mark.parametrize("kwargs,needle", [
    (dict(model=0, compute_s=0.1), "parameter count >= 1"),
    (dict(model="alexnet"), "resnet50"),
    (dict(model=1000, compute_s=0.1, cluster="tpu-pod"), "dgx-a100"),
    (dict(model=1000, compute_s=-1.0), "seconds >= 0"),
    (dict(model=1000), "compute_s"),
    (dict(model=1000, compute_s=0.1, nodes=0), ">= 1"),
    (dict(model=1000, compute_s=0.1, methods=["zip"]), "unknown compressor"),
    (dict(model=1000, compute_s=0.1, optimizer="lamb"), "sgd, adam, none"),
    (dict(model=1000, compute_s=0.1, bucket_bytes=0), "bucket_bytes 0; accepted: an int >= 1"),
    (dict(model=1000, compute_s=0.1, bucket_bytes=1.5e6), "accepted: an int >= 1"),
])
def test_bad_input_names_what_is_accepted(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        plan(**kwargs, breakeven_search=False)


def write(tmp_path, obj, name="cal.json"):
    path = tmp_path / name
    if isinstance(obj, bytes):
        path.write_bytes(obj)
    else:
        path.write_text(json.dumps(obj) if not isinstance(obj, str) else obj)
    return str(path)


def test_calibration_file_feeds_plan_and_auto(tmp_path, monkeypatch):
    cal = {"version": 1, "ranks": 4, "nodes": 1, "local": 4, "device": "cpu",
           "links": {"flat": {"lat": 2e-4, "bandwidth": 3e7}, "intra": {"alpha": 3e-5, "bandwidth": 3e7}},
           "codec": {"qsgd:bits=8": 5e8}, "compute_s": 0.02}
    path = write(tmp_path, cal)
    loaded = calibration.load(path)
    p = plan(1_000_000, cluster=None, nodes=1, methods=["qsgd:bits=8"], calibration=loaded, breakeven_search=False)
    assert p.compute_s == 0.02 and p.cluster.local == 4 and p.cluster.intra.bandwidth == 3e7
    assert p.cluster.codec["qsgd:bits=8"] == 5e8
    monkeypatch.setenv(calibration.ENV, path)
    assert calibration.flat_link(calibration.from_env(), 4) == {"lat": 2e-4, "bandwidth": 3e7}
    assert calibration.flat_link(calibration.from_env(), 8) is None  # another world size: probe instead
    assert calibration.node_model(loaded) is None  # one node: no inter link


ROUTE_HOST_CAL = {"version": 1, "ranks": 4, "nodes": 1, "local": 4, "device": "cpu", "compute_s": 0.02,
                  "links": {"flat": {"lat": 1e-4, "bandwidth": 1e8}, "intra": {"alpha": 3e-5, "bandwidth": 1e8}},
                  "codec": {"topk": 2e8}, "codec_fixed_s": {"topk": 1e-4}}


def test_a_routes_measured_overhead_is_added_to_each_bucket_in_the_calibrated_world_only():
    """``route_overhead_s`` (a bucket's host work beyond its codec's passes, outside the waits: per
    bucket, tensor and element) adds to each bucket's codec seconds on that route, so to the step on a CPU, where the
    file timed this world; in another world, or on a route it did not time, nothing."""
    shapes = [(640,), (128,), (128, 384), (128,), (128, 384), (128,), (256, 640), (256,)]  # two buckets
    spec = "topk:ratio=0.01,exchange=twophase"
    host = [2e-3, 1e-4, 5e-9]
    timed = {**ROUTE_HOST_CAL, "route_overhead_s": {"topk": {"sparse_rs": host, "allgather": [1.0, 0.0, 0.0]}}}
    kw = dict(compute_s=0.02, cluster=None, methods=[spec], breakeven_search=False)
    rows = {}
    for name, cal, nodes, local in (("without", ROUTE_HOST_CAL, 1, 4), ("with", timed, 1, 4),
                                    ("other world", timed, 2, 2)):
        p = plan(shapes, calibration=cal, nodes=nodes, gpus_per_node=local, **kw)
        rows[name] = p.row(spec, "sparse_rs")
    without, got = rows["without"], rows["with"]
    layout = buckets_of(shapes, 25 * 1024 * 1024, FIRST_BUCKET_BYTES)
    expect = [host[0] + host[1] * len(b) + host[2] * sum(math.prod(s) for s in b) for b in layout]
    assert len(layout) == len(got.buckets) == 2
    assert [g.code - w.code for g, w in zip(got.buckets, without.buckets)] == pytest.approx(expect, rel=1e-9)
    assert got.exchange_s - without.exchange_s == pytest.approx(sum(expect), rel=1e-9)
    # on a CPU the codec's core computes: the step grows by the overhead, less what the link hid
    assert max(expect) <= got.step_s - without.step_s <= sum(expect) + 1e-12
    other = plan(shapes, calibration=ROUTE_HOST_CAL, nodes=2, gpus_per_node=2, **kw).row(spec, "sparse_rs")
    assert rows["other world"].step_s == pytest.approx(other.step_s, rel=1e-12)
    # the codec's timing: a node-aware route takes its inner route's figure; an untimed route none
    t = calibration.codec_timing(timed, "topk", ranks=4)
    assert t.overhead_seconds("node:sparse_rs", [(10, 10)]) == t.overhead_seconds("sparse_rs", [(100,)]) == \
        pytest.approx(host[0] + host[1] + 100 * host[2])
    assert t.overhead_seconds("node:sparse_rs", [(100,)], local=4) == pytest.approx(host[0] + host[1] + 25 * host[2])
    assert t.overhead_seconds("twophase", [(100,)]) == 0.0
    assert calibration.codec_timing(timed, "topk", ranks=8).overhead_seconds("sparse_rs", [(100,)]) == 0.0
    # the same ranks laid out otherwise (2 nodes x 2) are another world; the file's own (1 x 4) is not
    assert calibration.codec_timing(timed, "topk", ranks=4, nodes=2, local=2).overhead_seconds(
        "sparse_rs", [(100,)]) == 0.0
    assert calibration.codec_timing(timed, "topk", ranks=4, nodes=1, local=4).overhead_seconds(
        "sparse_rs", [(100,)]) > 0


def test_a_routes_measured_overhead_moves_a_jobs_route_choice(tmp_path, monkeypatch):
    """The job's route choice prices with the calibration's route overhead as the planner does: a
    sparse reduce-scatter the file found costly on the host loses to the allgather, in the file's
    world only."""
    from hvd_ext.exchange.routes import route_options
    from hvd_ext.spec import compression_from_spec

    comp = compression_from_spec("topk:ratio=0.01")
    shapes = [(4096, 256)]
    link = LinkModel(alpha=1e-4, bandwidth=1e7)
    monkeypatch.setattr(calibration, "_CACHE", {})
    monkeypatch.setenv(calibration.ENV, write(tmp_path, ROUTE_HOST_CAL, "plain.json"))
    assert route_options(comp, "auto", shapes, 4, link=link)["flat"] == "sparse_rs"
    costly = {**ROUTE_HOST_CAL, "route_overhead_s": {"topk": {"sparse_rs": [1.0, 0.0, 0.0]}}}
    monkeypatch.setenv(calibration.ENV, write(tmp_path, costly, "costly.json"))
    opts = route_options(comp, "auto", shapes, 4, link=link)
    assert opts["flat"] == "allgather"
    assert route_options(comp, "auto", shapes, 8, link=link)["flat"] == "sparse_rs"  # another world


def test_collectives_timed_inside_a_step_replace_the_idle_ones():
    """A calibration's busy_lat_by_kind (collectives right after a step: the slowest rank, shared cores)
    is what a bucket's first collective costs in the prediction, where the world is the calibrated
    one; the collectives after it in the bucket cost the idle figure."""
    idle = {"allreduce": 1e-4, "allgather": 1e-4, "alltoall": 1e-4}
    busy = {"allreduce": 0.03, "allgather": 0.02, "alltoall": 0.04}
    cal = {"version": 1, "ranks": 4, "nodes": 1, "local": 4, "device": "cpu", "compute_s": 0.02,
           "links": {"flat": {"lat": 1e-4, "bandwidth": 1e9, "lat_by_kind": idle},
                     "intra": {"alpha": 3e-5, "bandwidth": 1e9}}}
    kw = dict(cluster=None, nodes=1, methods=["qsgd:bits=8"], breakeven_search=False)
    before = plan(1_000_000, calibration=cal, **kw)
    after = plan(1_000_000, calibration={**cal, "links": {**cal["links"], "flat": {**cal["links"]["flat"],
                                                                                   "busy_lat_by_kind": busy}}}, **kw)
    two = after.row("qsgd:bits=8", "twophase").step_s - before.row("qsgd:bits=8", "twophase").step_s
    one = after.row("horovod").step_s - before.row("horovod").step_s
    # per bucket an alltoall, which waits for the slowest rank, then an allgather with the ranks together
    assert two == pytest.approx(0.04 - 1e-4, rel=1e-6)
    assert one == pytest.approx(0.03 - 1e-4, rel=1e-6)  # Horovod: one fused allreduce


def test_a_collectives_cost_inside_a_step_is_taken_in_rounds_the_kinds_in_turns(monkeypatch):
    """Tries inside a step are heavy-tailed where ranks share cores: a run of slow tries (a rank off its
    core) does not decide the figure when the kinds are tried in turns, round after round, and each
    kind's figure is typical of its rounds: the last round falls in a burst, and the others pay one
    slow try in four (round means 0.02 and 0.03 s)."""
    import types

    from hvd_ext.plan import calibration as measure

    clock, calls = [0.0], []
    burst = {"allreduce": 1.0, "alltoall": 0.5}

    class Job:
        def small_collectives(self, tag):
            def run(kind):
                def go():
                    r, i = divmod(sum(1 for k in calls if k == kind), 4)
                    calls.append(kind)
                    clock[0] += burst[kind] if r == 2 else 0.01 * (r + 1) + (0.04 if i == 3 else 0.0)
                return go
            return {k: run(k) for k in burst}

        def run_step(self, step):
            step()

        def mean(self, values):
            return list(values)

    monkeypatch.setattr(measure, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    got = measure._measure_busy_latency(Job(), lambda: None, steps=4, kinds=("allreduce", "alltoall"))
    assert calls == (["allreduce"] * 4 + ["alltoall"] * 4) * measure.BUSY_ROUNDS
    # the median try pooled: 0.035; the first round alone 0.02, the last 1.0 and 0.5
    assert got == pytest.approx({"allreduce": 0.03, "alltoall": 0.03})


def test_a_collectives_typical_cost_is_the_median_over_rounds_spread_in_time(monkeypatch):
    """A collective's waits come in bursts of a few seconds: the first and the last of six rounds fall
    into one and take 0.3 s a try; the others pay 0.08 s, and 0.4 s for their last try. The figure is
    typical of the rounds (the ranks' mean of it): the burst does not decide it, every round's slow
    try is in it. Each round of a probe first lines the ranks up with an untimed call (a rank's wait
    for the others' work before), and a probe inside a step runs the step before each try, untimed."""
    import types

    from hvd_ext.plan import calibration as measure

    clock, calls, steps = [0.0], [], []
    burst = {0, 5}  # rounds in the burst

    def probe(name, per_round):
        def go():
            calls.append(name)
            r, i = divmod(sum(c == name for c in calls) - 1, per_round)
            clock[0] += 0.3 if r in burst else (0.4 if i == per_round - 1 else 0.08)
        return go

    class Job:
        def mean(self, values):
            return [v * 1.5 for v in values]  # stands for the other rank's

    monkeypatch.setattr(measure, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    spread = measure._SpreadTries(Job())
    spread.add("idle", probe("idle", 4), 3)
    spread.add("busy", probe("busy", 5), 4, before=lambda: steps.append(clock[0]) or clock.__setitem__(0, clock[0] + 9))
    for _ in range(6):
        spread.round()
    assert calls == (["idle"] * 4 + ["busy"] * 5) * 6 and len(steps) == 24
    assert [len(r) for r in spread.rounds["idle"]] == [3] * 6 and [len(r) for r in spread.rounds["busy"]] == [4] * 6
    # round means: idle (0.08 + 0.08 + 0.4) / 3, busy (3 x 0.08 + 0.4) / 4; the median try pooled: 0.3 and 0.08
    assert spread.seconds() == pytest.approx({"idle": 1.5 * 0.56 / 3, "busy": 1.5 * 0.16})


def test_a_collectives_typical_cost_pays_the_tail_of_every_round_not_a_burst_round():
    """A run of steps pays every collective it waits for: a slow try that comes every round is part of
    the typical cost (the round's mean, not the median try), a round inside a burst is not (the
    median over rounds)."""
    from hvd_ext.plan import calibration as measure

    tail = [0.08, 0.08, 0.08, 0.4]  # every round: one try in four is slow
    assert measure.typical([tail] * 5) == pytest.approx(0.16)  # the median try: 0.08
    assert measure.typical([tail] * 3 + [[0.5] * 4] * 2) == pytest.approx(0.16)  # two burst rounds of five
    assert measure.typical([[0.01] * 4, [0.5] * 4]) == pytest.approx(0.255)  # two rounds: their middle


def test_ranks_that_would_calibrate_differently_are_refused_on_every_rank():
    """One allreduce agrees whether any rank sleeps (then every rank times Horovod's own allreduce) and
    checks that every rank calibrates alike: ranks whose rounds would run different collectives (a
    step on one rank only, other steps a round, other codecs) all raise instead of hanging."""
    from hvd_ext.plan import calibration as measure

    class Job:  # two ranks: this one and ``other`` (its sleeps, shape and squares)
        def __init__(self, *other):
            self.other = [float(v) for v in other]

        def mean(self, values):
            return [(a + b) / 2 for a, b in zip(values, self.other)]

    assert measure._agree(Job(0, 1, 8, 5, 1, 64, 25), True, (True, 8, 5)) is True  # one rank sleeps: both time it
    assert measure._agree(Job(0, 1, 8, 5, 1, 64, 25), False, (True, 8, 5)) is False
    for other in [(0, 0, 8, 5, 0, 64, 25), (0, 1, 10, 5, 1, 100, 25), (0, 1, 8, 6, 1, 64, 36)]:
        with pytest.raises(ValueError, match="calibrate differently"):
            measure._agree(Job(*other), False, (True, 8, 5))


def test_a_later_collective_is_priced_at_its_typical_cost_the_link_at_its_fastest(monkeypatch):
    """A collective waits for the next cycle of Horovod's background thread; the fastest of a few tries
    happened not to. The link's fit keeps the fastest tries (the link itself); each kind's fixed cost,
    which a bucket's later collectives pay, is typical of its rounds of tries spread over the
    calibration, and goes into the file's ``lat_by_kind`` (Horovod's own allreduce's, idle and inside
    a step, where timed, into ``links.horovod``)."""
    import types

    from hvd_ext.plan import calibration as measure

    clock, n = [0.0], {"allreduce": 0, "allgather": 0, "alltoall": 0}
    cost = {"allreduce": [1e-3, 3e-3, 3e-3, 3e-3], "allgather": [2e-3] * 4, "alltoall": [2e-3, 4e-3, 4e-3, 4e-3]}

    def collective(kind):
        def go():
            clock[0] += cost[kind][n[kind] % 4]
            n[kind] += 1
        return go

    class Job:
        device, N = torch.device("cpu"), 2

        def small_collectives(self, tag):
            return {k: collective(k) for k in cost}

        def allreduce(self, t, name):
            clock[0] += 0.01

        def mean(self, values):
            return list(values)

    monkeypatch.setattr(measure, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    link = measure._flat_link(Job(), "probe")
    assert link["lat"] == pytest.approx(1e-3) and set(link) == {"lat", "bandwidth"}  # the fastest small allreduce
    n.update(dict.fromkeys(n, 0))  # each round: the untimed call, then three at the kind's usual cost
    spread = measure._SpreadTries(Job())
    measure._add_idle_probes(spread, Job(), Job())
    for _ in range(2):
        spread.round()
    links = {"flat": dict(link), "horovod": {"lat": 1e-3, "bandwidth": 1e8}}
    measure._put_spread(links, {**spread.seconds(), "horovod.busy": 0.05})
    assert links["flat"]["lat_by_kind"] == pytest.approx({"allreduce": 3e-3, "allgather": 2e-3, "alltoall": 4e-3})
    assert list(links["horovod"]) == ["lat", "bandwidth", "lat_by_kind", "busy_lat_by_kind"]
    assert links["horovod"]["busy_lat_by_kind"] == {"allreduce": 0.05}
    assert links["horovod"]["lat_by_kind"]["allreduce"] == pytest.approx(3e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_the_link_probe_sums_gradient_like_values_afresh_every_try(dtype):
    """Horovod's float16 sum on a CPU is scalar code whose speed depends on the values (zeros take its
    fast path): the large probe sums values drawn as a gradient's, many of them float16 subnormals, and
    the same values every try although an allreduce reduces in place."""
    from hvd_ext.plan import calibration as measure

    seen = []

    class Job:
        device, N = torch.device("cpu"), 2

        def small_collectives(self, tag):
            return {"allreduce": lambda: None}

        def allreduce(self, t, name):
            if name.endswith(".large"):
                seen.append(t.clone())
                t.mul_(self.N)  # in place, as Horovod sums

        def mean(self, values):
            return list(values)

    rng = torch.get_rng_state()
    link = measure._flat_link(Job(), "probe", dtype=dtype)
    assert torch.equal(torch.get_rng_state(), rng)  # a job calibrating mid-training keeps its random stream
    assert link["bandwidth"] > 0 and len(seen) == 3
    assert all(torch.equal(s, seen[0]) for s in seen) and seen[0].dtype == dtype
    nonzero = seen[0] != 0
    assert nonzero.float().mean() > 0.99
    if dtype == torch.float16:  # below float16's smallest normal value (6.1e-5): its slow path
        assert (nonzero & (seen[0].abs() < 6.1e-5)).float().mean() > 0.3


def test_a_nodes_collectives_timed_inside_a_step_price_the_node_aware_routes_first():
    """Across nodes, the node-aware route's first collective (the reduce-scatter in the node) waits
    for the slowest rank: it costs a node's alltoall as timed inside a step; the collectives after it
    (across nodes, the allgather in the node) find the ranks together: messages x alpha. Horovod's
    hierarchical row keeps its alphas (its own groups, not timed)."""
    busy = {"allreduce": 0.005, "allgather": 0.007, "alltoall": 0.011}
    a_in, a_out = 1e-5, 2e-5
    cal = {"version": 1, "ranks": 4, "nodes": 2, "local": 2, "device": "cpu", "compute_s": 0.02,
           "links": {"flat": {"lat": 1e-4, "bandwidth": 1e8},
                     "intra": {"alpha": a_in, "bandwidth": 1e9}, "inter": {"alpha": a_out, "bandwidth": 1e8}}}
    kw = dict(cluster=None, nodes=2, gpus_per_node=2, methods=["qsgd:bits=8", "topk:ratio=0.01"],
              breakeven_search=False)
    before = plan(1_000_000, calibration=cal, **kw)
    timed = {**cal, "links": {**cal["links"], "intra": {**cal["links"]["intra"], "busy_lat_by_kind": busy}}}
    after = plan(1_000_000, calibration=timed, **kw)
    for label, route in (("qsgd:bits=8", "node:twophase"), ("topk:ratio=0.01", "node:sparse_rs")):
        new, old = after.row(label, route).buckets, before.row(label, route).buckets
        assert len(new) == len(old) > 0
        for b, a in zip(new, old):
            assert b.latency - a.latency == pytest.approx(0.011 - a_in, rel=1e-9)  # the first: a_in -> busy
            assert b.nic == a.nic and b.code == a.code
    assert after.row("horovod hierarchical").step_s == before.row("horovod hierarchical").step_s
    assert after.row("qsgd:bits=8", "twophase").step_s == before.row("qsgd:bits=8", "twophase").step_s
    assert plan(1_000_000, calibration=timed, **{**kw, "nodes": 4}).cluster.intra_lat == {}  # another world


def test_horovods_own_allreduce_prices_only_horovods_rows():
    """Where the calibration timed Horovod's own (spinning) allreduce apart from hvd_ext's, Horovod's
    rows take its latency and its slower bytes; hvd_ext's rows keep the flat link's."""
    cal = {"version": 1, "ranks": 4, "nodes": 1, "local": 4, "device": "cpu", "compute_s": 0.02,
           "links": {"flat": {"lat": 1e-3, "bandwidth": 1e8, "busy_lat_by_kind": {
                         "allreduce": 0.01, "allgather": 0.01, "alltoall": 0.01}},
                     "intra": {"alpha": 3e-5, "bandwidth": 1e8}}}
    kw = dict(cluster=None, nodes=1, methods=["qsgd:bits=8"], breakeven_search=False)
    base = plan(1_000_000, calibration=cal, **kw)
    hv = {"lat": 2e-3, "bandwidth": 5e7, "busy_lat_by_kind": {"allreduce": 0.03}}
    spun = plan(1_000_000, calibration={**cal, "links": {**cal["links"], "horovod": hv}}, **kw)
    wire = 2.0 * 3 / 4 * 4e6  # the ring's bytes per rank for 1M floats on 4 ranks
    link = base.row("horovod").exchange_s - 0.01
    assert link == pytest.approx(wire / 1e8, rel=1e-6)
    assert spun.row("horovod").exchange_s == pytest.approx(0.03 + wire / 5e7, rel=1e-6)
    assert spun.row("qsgd:bits=8", "twophase").step_s == base.row("qsgd:bits=8", "twophase").step_s
    # Horovod's float16 sum, measured at a quarter of the float32 bytes/s: only its fp16 row slows
    half = plan(1_000_000, calibration={**cal, "links": {**cal["links"], "horovod_fp16": {"lat": 1e-3,
                                                                                           "bandwidth": 2.5e7}}}, **kw)
    assert half.row("horovod fp16").exchange_s - base.row("horovod fp16").exchange_s == pytest.approx(
        wire / 2 / 2.5e7 - wire / 2 / 1e8, rel=1e-6)
    assert half.row("horovod").exchange_s == base.row("horovod").exchange_s
    other_world = plan(1_000_000, calibration={**cal, "links": {**cal["links"], "horovod": hv}},
                       **{**kw, "nodes": 2, "gpus_per_node": 4})
    assert other_world.cluster.horovod_lat is None  # measured for the calibrated world only


@pytest.mark.parametrize("content,needle", [
    ("{not json", "is not JSON"),
    ({"version": 1, "links": {"horovod": {"lat": 1e-3}}}, "links.horovod needs lat and bandwidth"),
    ({"version": 1, "links": {"horovod": {"lat": 1e-3, "bandwidth": 1e8, "busy_lat_by_kind": {"allreduce": -1}}}},
     "links.horovod.busy_lat_by_kind maps"),
    ({"version": 1, "links": {"intra": {"alpha": 1e-5, "bandwidth": 1e8, "busy_lat_by_kind": {"gather": 0.1}}}},
     "links.intra.busy_lat_by_kind maps"),
    ({"version": 1, "codec_compiled": {"qsgd": 1e9}}, "codec_compiled needs compile_min"),
    ({"version": 1, "codec_compiled": {"qsgd": 0}, "compile_min": 10}, "codec_compiled speed of 'qsgd'"),
    ({"version": 2}, "version must be 1"),
    ({"version": 1, "route_overhead_s": {"topk": {"sparse_rs": [1e-3, 0.0]}}},
     r"route_overhead_s.topk.sparse_rs must be"),
    ({"version": 1, "route_overhead_s": {"topk": {"sparse_rs": [1e-3, -1.0, 0.0]}}}, "per tensor, per element"),
    ({"version": 1, "route_overhead_s": {"topk": [1e-3]}}, "route_overhead_s.topk must be an object"),
    ({"version": 1, "links": {"inter": {"alpha": 1e-5}}}, "links.inter needs alpha and bandwidth"),
    ({"version": 1, "codec": {"topk": 0}}, "codec speed of 'topk'"),
    ({"version": 1, "links": {"flat": {"lat": 1e-4, "bandwidth": 1e8, "lat_by_kind": {"bcast": 1e-4}}}},
     "lat_by_kind maps allreduce, allgather, alltoall"),
    ({"version": 1, "links": {"flat": {"lat": 1e-4, "bandwidth": 1e8, "busy_lat_by_kind": {"allreduce": -1}}}},
     "busy_lat_by_kind maps allreduce, allgather, alltoall"),
    ({"version": 1, "links": []}, "links must be an object, got list"),
    ({"version": 1, "links": None}, "links must be an object, got NoneType"),
    ({"version": 1, "codec": []}, "codec must be an object"),
    ({"version": 1, "links": {"flat": {"lat": 1e-4, "bandwidth": float("nan")}}}, "links.flat needs lat and bandwidth"),
    ({"version": 1, "ranks": "2"}, "ranks must be an int >= 1"),
    ({"version": 1, "compute_s": -1}, "compute_s must be seconds >= 0"),
    (b"\xff\xfe{}", "is not UTF-8"),
])
def test_bad_calibration_file_says_what_is_wrong(tmp_path, content, needle):
    with pytest.raises(calibration.CalibrationError, match=needle):
        calibration.load(write(tmp_path, content))
    with pytest.raises(calibration.CalibrationError, match="cannot be read"):
        calibration.load(str(tmp_path / "missing.json"))


JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
                    max_leaves=8)
KEYS = ["ranks", "nodes", "local", "device", "compute_s", "links", "codec", "codec_fixed_s", "codec_compiled",
        "compile_min", "links.flat", "links.intra", "links.inter", "links.horovod", "links.horovod_fp16",
        "links.flat.lat_by_kind", "links.flat.busy_lat_by_kind", "links.flat.bandwidth", "route_overhead_s",
        "route_overhead_s.topk", "route_overhead_s.topk.sparse_rs"]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(where=st.lists(st.sampled_from(KEYS), min_size=1, max_size=3), values=st.lists(JSON, min_size=3, max_size=3))
def test_any_calibration_file_loads_or_says_what_is_wrong(tmp_path, monkeypatch, where, values):
    """Whatever a file holds, reading it gives a calibration or a CalibrationError, never another
    exception: the ranks compare what each read (env_digest) before any of them may raise."""
    cal = {"version": 1, "links": {"flat": {"lat": 1e-4, "bandwidth": 1e8}}}
    for key, value in zip(where, values):
        *parents, last = key.split(".")
        node = cal
        for k in parents:
            node = node.setdefault(k, {}) if isinstance(node.get(k, {}), dict) else {}
        node[last] = value
    path = tmp_path / "fuzz.json"
    path.write_text(json.dumps(cal))
    try:
        calibration.load(str(path))
    except calibration.CalibrationError:
        pass
    monkeypatch.setenv(calibration.ENV, str(path))
    monkeypatch.setattr(calibration, "_CACHE", {})
    digest = calibration.env_digest()
    assert isinstance(digest, str) and len(digest) > 0


def test_command_line_writes_table_json_and_plot(tmp_path):
    out, png = tmp_path / "plan.json", tmp_path / "plan.png"
    r = subprocess.run([sys.executable, "-m", "hvd_ext.plan", "--model", "bert-large", "--cluster", "dgx-a100",
                        "--nodes", "4", "--json", str(out), "--plot", str(png)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "| horovod fp16 |" in r.stdout and "auto would pick" in r.stdout
    rows = json.loads(out.read_text())["rows"]
    assert {"horovod", "horovod fp16", "horovod hierarchical", "auto"} <= {x["method"] for x in rows}
    assert png.stat().st_size > 10_000
    bad = subprocess.run([sys.executable, "-m", "hvd_ext.plan", "--params", "1e6", "--cluster", "nope"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "dgx-a100" in bad.stderr
    bad = subprocess.run([sys.executable, "-m", "hvd_ext.plan", "--params", "1e6", "--compute-ms", "5",
                          "--methods", "threshold"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "accepted: codecs of a fixed size" in bad.stderr
    assert "Traceback" not in bad.stderr


MODEL_FILE = """
import torch

def model():
    return torch.nn.Sequential(torch.nn.Linear(40, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))

def step(m):
    x = torch.randn(16, 40, device=next(m.parameters()).device)
    m(x).square().mean().backward()
"""


def test_command_line_takes_tensor_sizes_and_a_model_file(tmp_path):
    from hvd_ext.plan.__main__ import main
    net = tmp_path / "net.py"
    net.write_text(MODEL_FILE)
    args = ["--compute-ms", "5", "--cluster", "pcie-consumer-10gbe", "--methods", "qsgd:bits=8"]
    for what, params, tensors in ((["--model-file", str(net)], 40 * 64 + 64 + 64 * 10 + 10, 4),
                                  (["--sizes", "4096x1024, 1024"], 4096 * 1024 + 1024, 2)):
        out = tmp_path / "plan.json"
        assert main(what + args + ["--json", str(out)]) == 0
        doc = json.loads(out.read_text())
        assert (doc["inputs"]["params"], doc["inputs"]["tensors"]) == (params, tensors)
    # the file's module gives the rows plan() gives for the module itself
    module = torch.nn.Sequential(torch.nn.Linear(40, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    p = plan(module, compute_s=0.005, cluster="pcie-consumer-10gbe", methods=["qsgd:bits=8"])
    assert main(["--model-file", str(net)] + args + ["--json", str(out)]) == 0
    rows = {(r["method"], r["route"]): r["step_s"] for r in json.loads(out.read_text())["rows"]}
    assert rows == pytest.approx({(r["method"], r["route"]): r["step_s"] for r in p.records()})
    assert ("qsgd:bits=8", "twophase") in rows


def test_model_file_loads_as_python_runs_it(tmp_path, monkeypatch):
    """Any file name; its folder importable; dataclasses under postponed annotations (sys.modules)."""
    from hvd_ext.plan.__main__ import build_model, load_model_file
    monkeypatch.setattr(sys, "path", list(sys.path))          # the loader adds the file's folder
    for name in ("layers", "hvd_ext_plan_model_net"):
        monkeypatch.delitem(sys.modules, name, raising=False)  # restored (absent) after the test
    (tmp_path / "layers.py").write_text("import torch\nWIDTH = 32\n")
    net = tmp_path / "net.model"
    net.write_text("from __future__ import annotations\nimport dataclasses\nimport torch\nfrom layers import WIDTH\n\n"
                   "@dataclasses.dataclass\nclass Config:\n    width: int = WIDTH\n\n"
                   "def model():\n    return torch.nn.Linear(8, Config().width)\n")
    assert tuple(build_model(load_model_file(str(net)), str(net)).weight.shape) == (32, 8)


@pytest.mark.parametrize("argv,needle", [
    (["--sizes", "0x3"], "accepted: tensor sizes or shapes >= 1"),
    (["--sizes", "4096,a"], "accepted: tensor sizes or shapes >= 1"),
    (["--model-file", "MISSING"], "no file"),
    (["--model-file", "NOMODEL"], "defines no model()"),
    (["--model-file", "NOTMODULE"], "model\\(\\) returned NoneType; accepted: a torch.nn.Module"),
    (["--measure", "--model-file", "NOSTEP"], "defines no step()"),
    (["--measure", "--model-file", "NOTMODULE"], "accepted: a torch.nn.Module"),
    (["--measure", "--params", "1e6"], "--params not used in a measurement; accepted with --measure"),
    (["--measure", "--model-file", "GOOD", "--compute-ms", "5"], "--compute-ms not used in a measurement"),
    (["--measure", "--json", "x.json"], "--json not used in a measurement"),
    (["--params", "1e6", "--compute-ms", "5", "--bucket-mb", "0"], "--bucket-mb: bad value 0.0; accepted: MiB"),
    (["--params", "1e6", "--compute-ms", "5", "--bucket-mb", "inf"], "--bucket-mb: bad value inf; accepted: MiB"),
    (["--params", "1e6", "--compute-ms", "5", "--bucket-mb", "nan"], "--bucket-mb: bad value nan; accepted: MiB"),
    (["--model-file", "RAISES"], "loading it raised ImportError: no module named torchvision"),
    (["--measure", "--model-file", "EXITS"], "loading it raised SystemExit: 0"),
])
def test_command_line_model_inputs_refuse_bad_values(tmp_path, monkeypatch, argv, needle):
    """Each bad input says what is accepted, and --measure refuses it before any collective."""
    import horovod.torch as hvd

    from hvd_ext.plan.__main__ import main

    def no_collective():
        raise AssertionError("hvd.init() ran before the bad input was refused")
    monkeypatch.setattr(hvd, "init", no_collective)
    (tmp_path / "nomodel.py").write_text("import torch\n")
    (tmp_path / "nostep.py").write_text(MODEL_FILE.split("def step")[0])
    (tmp_path / "notmodule.py").write_text("def model():\n    return None\n\ndef step(m):\n    pass\n")
    (tmp_path / "good.py").write_text(MODEL_FILE)
    (tmp_path / "raises.py").write_text("raise ImportError('no module named torchvision')\n")
    (tmp_path / "exits.py").write_text("import sys\nsys.exit(0)\n")
    monkeypatch.setattr(sys, "path", list(sys.path))
    files = {k: str(tmp_path / f"{k.lower()}.py") for k in ("MISSING", "NOMODEL", "NOSTEP", "NOTMODULE", "GOOD",
                                                           "RAISES", "EXITS")}
    argv = [files.get(a, a) for a in argv]
    with pytest.raises(SystemExit, match=needle):
        main(argv if "--measure" in argv else argv + ["--compute-ms", "5"])


def test_presets_cite_their_sources():
    for c in CLUSTERS.values():
        assert len(c.source) > 40 and c.inter.bandwidth > 0
    for m in MODELS.values():
        assert len(m.source) > 40


def test_a_codec_is_timed_past_its_dense_warm_up(monkeypatch):
    """PowerSGD sends its first exchanges dense (``warmup=``, 100 by default): timed there, its codec
    would look free. The calibration times every codec in the steady state the planner prices."""
    from hvd_ext.plan import calibration as measure
    from hvd_ext.spec import compression_from_spec

    comp = compression_from_spec("powersgd")
    assert comp.warmup_length() > 0
    seen = []
    real = comp.compress

    def compress(g, info):
        payload, ctx = real(g, info)
        seen.append((info.step, payload.numel(), g.numel()))
        return payload, ctx

    comp.compress = compress
    monkeypatch.setattr(measure, "compression_from_spec", lambda spec: comp)
    assert measure.time_codec("powersgd", 64 * 256, torch.device("cpu"), reps=2) > 0
    assert seen and all(step >= comp.warmup_length() for step, _, _ in seen)
    assert all(sent < numel / 4 for _, sent, numel in seen)  # the low-rank factors, not the dense tensor


def test_codec_speed_fitted_where_the_jobs_calls_run(monkeypatch):
    """On a CPU the codec's speed is fitted on sizes that run as the job's layers do (below the compile
    threshold); the speed at the large size is kept apart only when that size alone runs compiled."""
    from hvd_ext.plan import calibration as measure

    cpu = torch.device("cpu")
    fixed, speed, compiled = measure.fit_codec("qsgd:bits=8", 64 * 1024, cpu)
    assert speed > 0 and fixed >= 0 and compiled == 0.0  # one regime: nothing kept apart
    seen = []
    real = measure.time_codec
    monkeypatch.setattr(measure, "time_codec", lambda spec, n, dev: seen.append(n) or real(spec, n, dev))
    monkeypatch.setattr(measure, "MIN_NUMEL", 200_000)
    monkeypatch.setattr(measure, "compile_enabled", lambda n, dev=None: n >= 200_000)
    fixed, speed, compiled = measure.fit_codec("qsgd:bits=8", 400_000, cpu)
    assert seen == [16 * 1024, 64 * 1024, 400_000]  # the fit stays below the threshold
    assert speed > 0 and compiled > 0


def test_a_codec_is_timed_and_looked_up_under_its_own_spec(tmp_path, monkeypatch):
    """The options that only route a payload (``exchange=``, ``hierarchy_trial=``) leave a codec's pass as
    it is: the planner's method and a job's codec both find the speed ``--measure`` wrote under the
    codec's own spec (``Compressor.codec_spec``), and the job prices its routes with it."""
    from hvd_ext.exchange.routes import route_options
    from hvd_ext.spec import compression_from_spec

    spec = "qsgd:bits=8,exchange=twophase,hierarchy_trial=0"
    assert compression_from_spec(spec).codec_spec() == "qsgd:bits=8"
    assert compression_from_spec(spec).spec() == "qsgd:bits=8,route=twophase,hierarchy_trial=0"
    assert compression_from_spec("topk:ratio=0.01,feedback=none").codec_spec() == "topk:feedback=none"
    slow = 1e5  # elements per second: the codec, not the link, decides
    cal = {"version": 1, "ranks": 4, "nodes": 1, "local": 4, "device": "cpu",
           "links": {"flat": {"lat": 2e-4, "bandwidth": 3e7}, "intra": {"alpha": 3e-5, "bandwidth": 3e7}},
           "codec": {"qsgd:bits=8": slow}, "compute_s": 0.02}
    n = 1_000_000
    row = plan(n, cluster=None, nodes=1, methods=[spec], calibration=cal, breakeven_search=False).row(spec, "twophase")
    assert sum(b.code for b in row.buckets) >= 4 * n / slow  # worker and owner, encode and decode
    comp = compression_from_spec(spec)
    untimed = route_options(comp, comp.route, n, 4)["flat_s"]
    monkeypatch.setenv(calibration.ENV, write(tmp_path, cal))
    monkeypatch.setattr(calibration, "_CACHE", {})
    timed = route_options(comp, comp.route, n, 4)["flat_s"]
    assert untimed < 4 * n / slow <= timed  # the default speed is the link's (250M elements/s)
