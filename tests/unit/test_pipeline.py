"""hvd_ext.pipeline: bucket planning, and the dense warm-up before the codec (simulated ranks)."""
from __future__ import annotations

import pytest
import torch

from hvd_ext.pipeline import plan_buckets
from hvd_ext.spec import compression_from_spec
from hvd_ext.testing.harness import run_pipeline

from helpers.simgrads import make_grads, mean_of


def test_plan_buckets_is_deterministic_and_bounded():
    params = [(f"p{i}", torch.zeros(n)) for i, n in enumerate([10, 300, 50, 700, 5])]
    b = plan_buckets(params, bucket_bytes=1200)
    assert b == plan_buckets(params, bucket_bytes=1200)
    assert sorted(i for bucket in b for i in bucket) == list(range(5))
    assert b[0][0] == 4  # reverse order: last parameter first (backward order)
    for bucket in b:
        if len(bucket) > 1:
            assert sum(params[i][1].numel() * 4 for i in bucket) <= 1200


def test_first_bucket_takes_the_tensor_that_crosses_its_size():
    """The first bucket (backward order) closes once it holds first_bucket_bytes, so a large last
    layer goes in it and its exchange overlaps the rest of backward; no bucket exceeds bucket_bytes
    unless it holds a single tensor."""
    params = [(f"p{i}", torch.zeros(n)) for i, n in enumerate([400, 300, 200, 250, 10])]
    b = plan_buckets(params, bucket_bytes=4000, first_bucket_bytes=800)
    assert b[0] == [4, 3]  # 40 B, then 1000 B crosses 800 B: both in the first bucket
    assert b[1:] == [[2, 1, 0]]
    assert plan_buckets(params, bucket_bytes=900, first_bucket_bytes=800)[0] == [4]  # never past bucket_bytes


def test_pipeline_dense_warmup_then_codec():
    """The first ``warmup`` exchanges are the exact mean with no memory kept; then the codec runs
    (with its error feedback starting from zero), on every simulated rank alike."""
    size, steps, warm = 3, 5, 2
    grads = make_grads(size, steps, seed=3)
    runs = run_pipeline("topk:ratio=0.05", grads, size, warmup=warm)
    for r in runs:
        for step in range(steps):
            exact = mean_of(grads, step, size)
            got = r.results[step]
            same = all(torch.allclose(got[k], exact[k], atol=1e-6) for k in exact)
            assert same == (step < warm), (r.rank, step)
        assert r.pipeline.routes == runs[0].pipeline.routes
    plain = run_pipeline("topk:ratio=0.05", grads[warm:], size)
    for step in range(steps - warm):  # after the warm-up: exactly a fresh topk run
        for k in grads[0][0]:
            assert torch.allclose(runs[0].results[warm + step][k], plain[0].results[step][k], atol=1e-6)


def _pipeline(spec: str, bucket_bytes: int = 1 << 20):
    """One rank's pipeline for ``spec`` over two float32 tensors (p0: 6, p1: 4 elements)."""
    from hvd_ext.exchange.core import Exchange
    from hvd_ext.pipeline import GradientPipeline
    from hvd_ext.spec import compression_from_spec
    from hvd_ext.testing.simulated import run_world

    def body(rank, transport):
        comp = compression_from_spec(spec)
        named = [("p0", torch.nn.Parameter(torch.zeros(6))), ("p1", torch.nn.Parameter(torch.zeros(4)))]
        return GradientPipeline(named, comp, comp.feedback, Exchange(op="average", transport=transport),
                                bucket_bytes, warmup=comp.warmup_length())
    return run_world(1, body)[0]


def test_takes_flat_only_when_the_step_codes_element_by_element_without_memory():
    """A caller's flat buffer may stand for the bucket (the DDP hook) only when the pipeline's one bucket
    runs an elementwise codec (none, fp16, bf16) on the allreduce route this step and keeps no memory
    for it; what auto releases of an earlier codec's memory is added into the buffer first."""
    f32, f16 = torch.zeros(10), torch.zeros(10, dtype=torch.float16)
    none = _pipeline("none")
    assert none.takes_flat(f32) and not none.takes_flat(f16)  # float16: summed in float32 by the exchange
    assert _pipeline("fp16").takes_flat(f32) and _pipeline("bf16").takes_flat(f32)
    assert not _pipeline("none", bucket_bytes=30).takes_flat(f32)  # two buckets: not one flat buffer
    assert not _pipeline("topk:ratio=0.5").takes_flat(f32)
    assert not _pipeline("qsgd:bits=8").takes_flat(f32)  # a scale per tensor
    psgd = _pipeline("powersgd:rank=1,warmup=3")
    assert psgd.takes_flat(f32)  # the dense warm-up
    psgd.set_step(3)
    assert not psgd.takes_flat(f32)
    auto = _pipeline("auto:candidates=none,fp16")
    assert auto.takes_flat(f32)
    # an earlier codec's memory, released over 4 steps: its share goes into the flat buffer's views
    auto.auto.debt["p0"], auto.auto.debt_left["p0"] = torch.full((6,), 4.0), 4
    assert auto.takes_flat(f32)
    buf = torch.zeros(10)
    views = {"p0": buf[:6], "p1": buf[6:]}
    for name, p in zip(auto.buckets[0].names, auto.buckets[0].params):
        p.grad = views[name]
    auto.start_flat(buf)
    assert torch.equal(buf, torch.tensor([1.0] * 6 + [0.0] * 4))  # the 1/4 share of p0's debt, before the sum
    auto.finish()
    assert auto.auto.debt_left["p0"] == 3



def _two_powersgd_pipelines(rank, transport, raise_in_second=False):
    """A DDP model's two pipelines (one per DDP bucket) on one exchange, PowerSGD on a matrix each;
    the exchange's allreduces logged as ("start"|"wait", name)."""
    from hvd_ext.exchange.core import Exchange
    from hvd_ext.pipeline import GradientPipeline

    ex = Exchange(op="average", transport=transport)
    events, names = [], {}
    start, finish = ex.start_allreduce, ex.finish_allreduce

    def logged_start(name, payloads, nonfinite, **kw):
        pending = start(name, payloads, nonfinite, **kw)
        names[id(pending)] = name
        events.append(("start", name))
        return pending

    def logged_finish(pending):
        events.append(("wait", names[id(pending)]))
        return finish(pending)

    ex.start_allreduce, ex.finish_allreduce = logged_start, logged_finish
    pipes = []
    for k in range(2):
        comp = compression_from_spec("powersgd:warmup=0,rank=2")
        p = torch.nn.Parameter(torch.zeros(32, 24))
        pipe = GradientPipeline([(f"w{k}", p)], comp, comp.feedback, ex, 1 << 20)
        p.grad = torch.randn(32, 24, generator=torch.Generator().manual_seed(10 * rank + k))
        pipe.flush()
        pipes.append(pipe)
    if raise_in_second:
        def broken():
            raise RuntimeError("a route's progress failed")
        pipes[1].buckets[0].route.progress = broken
    return pipes, events


def test_finish_together_starts_every_pipelines_second_rounds_before_waiting_for_one():
    from hvd_ext.pipeline import finish_together
    from hvd_ext.testing.simulated import SimulatedWorld

    def body(rank, transport):
        pipes, events = _two_powersgd_pipelines(rank, transport)
        finish_together(pipes)
        return events

    for events in SimulatedWorld(2, timeout=60).run(body):
        seconds = [name for kind, name in events if kind == "start" and name.endswith(".r2")]
        assert len(seconds) == 2  # one per pipeline, each once
        first_wait = next(i for i, (kind, name) in enumerate(events) if kind == "wait" and name.endswith(".r2"))
        assert sum(1 for kind, name in events[:first_wait] if kind == "start" and name.endswith(".r2")) == 2


def test_finish_together_forgets_the_step_in_every_pipeline_when_one_fails():
    """A pipeline whose next phase raises: every pipeline forgets the step, so none finishes the next
    step with this one's buckets."""
    from hvd_ext.pipeline import finish_together
    from hvd_ext.testing.simulated import SimulatedWorld

    def body(rank, transport):
        pipes, _ = _two_powersgd_pipelines(rank, transport, raise_in_second=True)
        with pytest.raises(RuntimeError, match="progress failed"):
            finish_together(pipes)
        return [[b.started for b in pipe.buckets] for pipe in pipes]

    for started in SimulatedWorld(2, timeout=60).run(body):
        assert started == [[False], [False]]


def test_buckets_of_one_layout_are_priced_once_per_codec(monkeypatch):
    """A model's repeated layers make buckets of the same shapes: their routes are priced once per codec
    (route choice costs milliseconds per bucket at a thousand ranks), and each still takes the route
    that pricing picks, through the dense warm-up and after it, on every rank alike."""
    import hvd_ext.pipeline as pipeline_mod

    calls = []
    price = pipeline_mod.route_options

    def counting(comp, mode, shapes, *args, **kw):
        calls.append((comp.name, tuple(map(tuple, shapes))))
        return price(comp, mode, shapes, *args, **kw)

    monkeypatch.setattr(pipeline_mod, "route_options", counting)
    g = torch.Generator().manual_seed(0)
    layers = {f"l{i}.w": (64, 64) for i in range(6)}
    grads = [[{n: torch.randn(*s, generator=g) for n, s in layers.items()} for _ in range(4)] for _ in range(3)]
    runs = run_pipeline("qsgd:bits=8", grads, 4, bucket_bytes=64 * 64 * 4, warmup=1)
    pipe = runs[0].pipeline
    assert len(pipe.buckets) == 6 and all(r.pipeline.routes == pipe.routes for r in runs)
    per_rank = len(calls) // 4
    assert per_rank == 2, calls   # one layout, two codecs (the dense warm-up's, then qsgd's)
    assert set(pipe.routes) == {pipe.route_options(pipe.buckets[0], pipe.compressor)["flat"]}
