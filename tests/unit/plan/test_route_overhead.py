"""hvd_ext.plan.route_overhead: a bucket's host work on its route beyond its codec's passes, measured
through the real gradient pipeline on the job's exchange -- here over a simulated two-rank world."""
import time

import pytest
import torch

from hvd_ext.exchange.calibration import CodecTiming
from hvd_ext.exchange.core import Exchange
from hvd_ext.exchange.routes import sparse_rs
from hvd_ext.feedback.residual import ResidualFeedback
from hvd_ext.plan import route_overhead
from hvd_ext.plan.calibration import _Job, gradient_like
from hvd_ext.testing.simulated import SimulatedTransport, SimulatedWorld

TIMINGS = {"topk": CodecTiming(1e12), "powersgd": CodecTiming(1e12)}  # passes priced at almost nothing


def _measure(specs, size=2):
    def rank(r, t):
        return route_overhead.measure_route_overhead(_Job(Exchange(transport=t), torch.device("cpu")), specs,
                                                     TIMINGS, gradient_like)
    return SimulatedWorld(size, timeout=120.0).run(rank)


def test_every_rank_gets_the_same_figures_for_each_route_its_codec_may_take():
    got = _measure(["topk", "powersgd"])
    assert got[0] == got[1]  # the ranks' mean
    assert {s: set(r) for s, r in got[0].items()} == {"topk": {"allgather", "sparse_rs"}, "powersgd": {"allreduce"}}
    assert all(len(v) == 3 for r in got[0].values() for v in r.values())


def test_host_work_is_split_into_per_bucket_per_tensor_and_per_element(monkeypatch):
    """Injected host work: the sparse reduce-scatter's owner phase takes 20 ms a bucket and 1 us per
    element of its range (half the bucket at two ranks), the error feedback 3 ms per tensor."""
    progress, compensate = sparse_rs.SparseReduceScatterRoute.progress, ResidualFeedback.compensate

    def slow_progress(self):
        if self._p2 is None:
            time.sleep(0.02 + 1e-6 * (self.bounds[self.exchange.rank + 1] - self.bounds[self.exchange.rank]))
        progress(self)

    def slow_compensate(self, *a, **kw):
        time.sleep(0.003)
        return compensate(self, *a, **kw)

    monkeypatch.setattr(sparse_rs.SparseReduceScatterRoute, "progress", slow_progress)
    monkeypatch.setattr(ResidualFeedback, "compensate", slow_compensate)
    got = _measure(["topk"])[0]["topk"]
    bucket, tensor, element = got["sparse_rs"]
    assert 0.015 < bucket < 0.04 and 0.002 < tensor < 0.008 and 4.5e-7 < element < 8e-7, got
    bucket, tensor, element = got["allgather"]
    assert bucket < 0.015 and 0.002 < tensor < 0.008 and element < 2e-7, got


def test_waits_for_collectives_are_left_out(monkeypatch):
    """Every collective takes 20 ms more (a slow wait): the link's cost, measured apart, not host work."""
    wait = SimulatedTransport.wait

    def slow_wait(self, handle):
        time.sleep(0.02)
        return wait(self, handle)

    monkeypatch.setattr(SimulatedTransport, "wait", slow_wait)
    got = _measure(["powersgd", "topk"])[0]
    assert got["powersgd"]["allreduce"][0] < 0.008 and got["topk"]["sparse_rs"][0] < 0.008, got


def test_across_nodes_each_bucket_stays_on_the_flat_route_it_is_timed_on():
    """On 2 nodes x 2 ranks a codec may trial the node-aware routes against the flat ones; the timed
    buckets run the flat route asked for, so no node-aware collective runs."""
    world = SimulatedWorld(4, timeout=120.0, ranks_per_node=2)
    got = world.run(lambda r, t: route_overhead.measure_route_overhead(
        _Job(Exchange(transport=t), torch.device("cpu")), ["qsgd:bits=8"], {"qsgd:bits=8": CodecTiming(1e12)},
        gradient_like))
    assert set(got[0]["qsgd:bits=8"]) == {"allgather", "twophase"}
    names = [n for w in [world, *world._groups.values()] for _, n in w.calls]
    assert names and not any(n.startswith(("hvd_ext.nrs.", "hvd_ext.nag.")) for n in names)


def test_one_rank_measures_nothing():
    assert _measure(["topk"], size=1) == [{}]


@pytest.mark.parametrize("route", ["sparse_rs", "node:sparse_rs"])
def test_the_file_figure_prices_a_bucket_of_any_layout(route):
    t = CodecTiming(1e9, route_overhead={"sparse_rs": [1e-3, 2e-4, 1e-9]})
    assert t.overhead_seconds(route, [(10, 100), (5,)]) == pytest.approx(1e-3 + 2 * 2e-4 + 1005 * 1e-9)
    shard = 4 if route.startswith("node:") else 1  # the node-aware route codes a rank's shard
    assert t.overhead_seconds(route, [(1000,)], local=4) == pytest.approx(1e-3 + 2e-4 + 1000 / shard * 1e-9)
    assert CodecTiming(1e9).overhead_seconds(route, [(10,)]) == 0.0


def test_given_the_training_step_each_exchange_is_timed_right_after_it_and_the_step_is_not(monkeypatch):
    """The training step (untimed, long) leaves the host colder: the owner phase right after it takes
    longer. The figure counts that, once per bucket, and none of the step's own time; on every rank
    each exchange follows a step."""
    import threading

    from hvd_ext.pipeline import GradientPipeline

    cold, calls, order = threading.local(), [], {}
    progress, finish = sparse_rs.SparseReduceScatterRoute.progress, GradientPipeline.finish

    def slow_after_step(self):
        if getattr(cold, "on", False) and self._p2 is None:
            cold.on = False
            time.sleep(0.01)
        progress(self)

    def step():
        calls.append(threading.get_ident())
        order.setdefault(threading.get_ident(), []).append("step")
        time.sleep(0.03)
        cold.on = True

    def finish_in_order(self):
        order.setdefault(threading.get_ident(), []).append("exchange")
        return finish(self)

    monkeypatch.setattr(sparse_rs.SparseReduceScatterRoute, "progress", slow_after_step)
    monkeypatch.setattr(GradientPipeline, "finish", finish_in_order)
    got = SimulatedWorld(2, timeout=120.0).run(lambda r, t: route_overhead.measure_route_overhead(
        _Job(Exchange(transport=t), torch.device("cpu")), ["topk"], TIMINGS, gradient_like, step))
    bucket = got[0]["topk"]["sparse_rs"][0]
    assert 0.007 < bucket < 0.025, got
    per_rank = (route_overhead.WARM + route_overhead.STEP_REPS) * 3 * 2  # 3 buckets on each of 2 routes
    assert len(calls) == 2 * per_rank and len(set(calls)) == 2
    assert all(seq == ["step", "exchange"] * per_rank for seq in order.values()), order
    monkeypatch.setattr(GradientPipeline, "finish", finish)
    assert _measure(["topk"])[0]["topk"]["sparse_rs"][0] < 0.008  # no step: no cold start
