"""``compression="auto"`` and the planner decide alike: fed one calibration file (links and each
collective's fixed cost, codec speeds, compute time), the job's ``auto`` picks per bucket the codec
and route that ``hvd_ext.plan`` predicts it would (simulated ranks, on one node and on two)."""
from __future__ import annotations

import json

import pytest
import torch

from hvd_ext.auto import AutoTuner
from hvd_ext.exchange import calibration
from hvd_ext.plan import plan
from hvd_ext.testing.harness import run_pipeline

N = 4
SHAPES = {"w1": (256, 512), "b1": (512,), "w2": (512, 256), "w3": (96 * 1024,), "w4": (300, 300)}
SPEED = {"none": 1e15, "fp16": 2e9, "qsgd": 3e8, "topk": 2.6e8}  # elements per second of one codec pass
COMPUTE = 0.02
BUCKET = 512 * 1024


def calibration_file(bandwidth: float, lat: float, alltoall: float, nodes: int = 1) -> dict:
    """One node: ``bandwidth`` is the flat link's; two nodes of N/2 ranks: the inter-node link's, with
    10 GB/s inside a node and a node's reduce-scatter timed inside a step."""
    idle = {"allreduce": lat, "allgather": 0.8 * lat, "alltoall": alltoall}
    links = {"flat": {"lat": lat, "bandwidth": bandwidth, "lat_by_kind": idle,
                      "busy_lat_by_kind": {k: 2 * v for k, v in idle.items()}},
             "intra": {"alpha": lat / (2 * (N - 1)), "bandwidth": bandwidth}}
    if nodes > 1:
        links["intra"] = {"alpha": 1e-5, "bandwidth": 1e10, "busy_lat_by_kind": {"alltoall": 3e-4}}
        links["inter"] = {"alpha": lat / 4, "bandwidth": bandwidth}
    return {"version": 1, "ranks": N, "nodes": nodes, "local": N // nodes, "device": "cpu", "compute_s": COMPUTE,
            "links": links, "codec": SPEED}


def grads(steps: int):
    g = torch.Generator().manual_seed(0)
    return [[{n: torch.randn(*s, generator=g) for n, s in SHAPES.items()} for _ in range(N)] for _ in range(steps)]


def job_picks(monkeypatch, tmp_path, cal: dict) -> list:
    """What the job's auto picks per bucket (``"spec (route)"``, the same on every rank) with ``cal``
    as HVD_EXT_CALIBRATION: its codecs timed at the file's speeds (their bytes are the real
    payloads), the step's compute the file's, and no exchange measured before the decision (the
    in-job correction the planner has no input for)."""
    path = tmp_path / "cal.json"
    path.write_text(json.dumps(cal))
    monkeypatch.setenv(calibration.ENV, str(path))
    monkeypatch.setattr(calibration, "_CACHE", {})
    real = AutoTuner._time_codec_once

    def at_file_speed(self, c, b, gs):
        n = sum(g.numel() for g in gs)
        return dict(real(self, c, b, gs), enc=n / SPEED[c.name], dec=n / SPEED[c.name])

    def compute_only(self, seconds):
        self._measured.append(0.0)
        self._periods.append(COMPUTE)

    monkeypatch.setattr(AutoTuner, "_time_codec_once", at_file_speed)
    monkeypatch.setattr(AutoTuner, "exchange_time", compute_only)
    runs = run_pipeline("auto:warmup=2,accuracy=relaxed,trial=0", grads(3), N, bucket_bytes=BUCKET,
                        ranks_per_node=cal["local"] if cal["nodes"] > 1 else 0)
    picks = [[f"{r.pipeline.auto.auto.candidate_specs[r.pipeline.auto.choice[b.index]]} ({b.route.name})"
              for b in r.pipeline.buckets] for r in runs]
    assert all(p == picks[0] for p in picks)
    return picks[0]


ONE_NODE = [(1e6, 1e-4, 1e-4), (3e6, 1e-4, 5e-3), (1e7, 2e-3, 1e-4), (1e9, 1e-4, 5e-3), (1e9, 2e-3, 1e-4),
            (1e10, 2e-3, 1e-4)]
TWO_NODES = [(1e6, 2e-3, 1e-4, 2), (1e7, 1e-4, 1e-4, 2), (1e9, 2e-3, 1e-4, 2), (1e10, 1e-4, 1e-4, 2)]


def planned(cal: dict) -> list:
    """The planner's ``auto`` pick per bucket, in the optimizer's bucket order."""
    return plan(list(SHAPES.values()), cluster=None, nodes=cal["nodes"], gpus_per_node=cal["local"], calibration=cal,
                methods=[], breakeven_search=False, bucket_bytes=BUCKET, optimizer="none").row("auto").picks


@pytest.mark.parametrize("case", ONE_NODE + TWO_NODES)
def test_auto_in_the_job_picks_what_the_planner_predicts(monkeypatch, tmp_path, case):
    """Same calibration, same choice, bucket by bucket: the codec (dense on a fast link, fp16 or
    top-k where the link's latency or bandwidth costs) and the route (the sparse reduce-scatter's two
    alltoalls against one allgather, as the file times each collective; across nodes, flat or
    node-aware on the node links)."""
    cal = calibration_file(*case)
    assert job_picks(monkeypatch, tmp_path, cal) == planned(cal)


def test_the_sweep_reaches_different_choices():
    """The cases above are not one answer repeated: the planner's picks differ between them, and
    across nodes some buckets take the node-aware route and some the flat one."""
    picks = [planned(calibration_file(*case)) for case in ONE_NODE + TWO_NODES]
    assert len({tuple(sorted(p)) for p in picks}) >= 8
    routes = {label.split("(")[1] for p in picks[len(ONE_NODE):] for label in p}
    assert any(r.startswith("node:") for r in routes) and any(not r.startswith("node:") for r in routes)


def test_collective_latencies_are_the_files_for_its_world_only():
    cal = calibration_file(1e8, 1e-3, 4e-3)
    first, then = calibration.collective_latencies(cal, N)
    assert first == {"allreduce": 2e-3, "allgather": 1.6e-3, "alltoall": 8e-3}
    assert then == {"allreduce": 1e-3, "allgather": 8e-4, "alltoall": 4e-3}
    assert calibration.collective_latencies(cal, N, 1, N) == (first, then)
    assert calibration.collective_latencies(cal, 2 * N) is None       # another world size
    assert calibration.collective_latencies(cal, N, 2, N // 2) is None  # another layout
    del cal["links"]["flat"]["busy_lat_by_kind"]
    assert calibration.collective_latencies(cal, N) == (then, then)   # untimed inside a step: the idle figure
    del cal["links"]["flat"]["lat_by_kind"]
    assert calibration.collective_latencies(cal, N) is None


def test_a_collective_the_file_did_not_time_costs_its_flat_allreduce_latency():
    """A file that timed some kinds only (written by hand, or by an older --measure): the others cost
    the flat allreduce's latency, for the planner and for auto alike."""
    cal = calibration_file(1e8, 1e-3, 4e-3)
    cal["links"]["flat"]["lat_by_kind"] = {"allreduce": 2e-3}
    cal["links"]["flat"]["busy_lat_by_kind"] = {"alltoall": 5e-3}
    first, then = calibration.collective_latencies(cal, N)
    assert then == {"allreduce": 2e-3, "allgather": 1e-3, "alltoall": 1e-3}
    assert first == {"allreduce": 2e-3, "allgather": 1e-3, "alltoall": 5e-3}
    assert len(planned(cal)) == len(planned(calibration_file(1e8, 1e-3, 4e-3)))  # priced (was a KeyError)


def fixed_routes(monkeypatch, tmp_path, spec: str, cal: dict) -> list:
    """The route a job with the fixed codec ``spec`` (and ``hierarchy_trial=0``: the model's routes,
    untried) gives each bucket, with ``cal`` as HVD_EXT_CALIBRATION."""
    path = tmp_path / "cal.json"
    path.write_text(json.dumps(cal))
    monkeypatch.setenv(calibration.ENV, str(path))
    monkeypatch.setattr(calibration, "_CACHE", {})
    runs = run_pipeline(spec + ("," if ":" in spec else ":") + "hierarchy_trial=0", grads(1), N, bucket_bytes=BUCKET,
                        ranks_per_node=cal["local"] if cal["nodes"] > 1 else 0)
    routes = [[b.route.name for b in r.pipeline.buckets] for r in runs]
    assert all(r == routes[0] for r in routes)
    return routes[0]


def planned_fastest(spec: str, cal: dict) -> list:
    """Per bucket, the route of the planner's rows for ``spec`` that prices that bucket fastest."""
    rows = [r for r in plan(list(SHAPES.values()), cluster=None, nodes=cal["nodes"], gpus_per_node=cal["local"],
                            calibration=cal, methods=[spec], breakeven_search=False, bucket_bytes=BUCKET,
                            optimizer="none").rows if r.spec == spec]
    return [min(rows, key=lambda r: r.buckets[b].seconds).route for b in range(len(rows[0].buckets))]


@pytest.mark.parametrize("spec", ["qsgd:bits=8", "topk:ratio=0.03", "fp16"])
def test_a_fixed_codec_takes_the_route_the_planner_prices_fastest(monkeypatch, tmp_path, spec):
    """A job with a fixed codec prices its routes before any step from the same file, with the same
    functions (:func:`hvd_ext.exchange.routes.route_cost`, each codec call as
    :class:`hvd_ext.exchange.calibration.CodecTiming` prices it): each bucket takes the route whose
    planner row is fastest for it, on every link of the sweep (where the file makes the alltoall dear,
    flat routes differ from the cost model's defaults; across nodes, node-aware ones win on slow links)."""
    timed = {"codec_fixed_s": {k: 2e-5 for k in SPEED}, "codec_compiled": {k: 3 * v for k, v in SPEED.items()},
             "compile_min": 64 * 1024}  # a fixed cost per call (the two-phase route makes many), compiled calls
    for case in ONE_NODE + TWO_NODES:
        for cal in (calibration_file(*case), {**calibration_file(*case), **timed}):
            assert fixed_routes(monkeypatch, tmp_path, spec, cal) == planned_fastest(spec, cal), case
