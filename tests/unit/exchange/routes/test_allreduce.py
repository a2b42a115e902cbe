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


def test_second_rounds_of_every_bucket_start_before_any_is_waited_for():
    """PowerSGD's second round (Q) is queued in ``progress()`` for every bucket before the pipeline
    waits for any, as DDP chains its rounds per bucket, not one bucket's round trip after another;
    the result is the same low-rank average as a run that finishes bucket after bucket."""
    shapes = {"w1": (64, 48), "w2": (48, 32), "w3": (32, 40)}
    grads = make_grads(2, 2, seed=3, shapes=shapes)
    logs = {}

    def log_collectives(rank, step, pipe):
        ex = pipe.exchange
        if rank in logs:
            return
        logs[rank] = events = []
        start, finish = ex.start_allreduce, ex.finish_allreduce

        def logged_start(name, payloads, nonfinite, **kw):
            pending = start(name, payloads, nonfinite, **kw)
            events.append(("start", name))
            names[id(pending)] = name
            return pending

        def logged_finish(pending):
            events.append(("wait", names[id(pending)]))
            return finish(pending)

        names = {}
        ex.start_allreduce, ex.finish_allreduce = logged_start, logged_finish

    small = 48 * 32 * 4  # every tensor a bucket of its own
    runs = run_pipeline("powersgd:warmup=0,rank=2", grads, 2, bucket_bytes=small, before_step=log_collectives)
    events = logs[0]
    second = [name for kind, name in events if kind == "start" and name.endswith(".r2")]
    assert len(second) == 6  # 3 buckets x 2 steps
    first_wait_r2 = next(i for i, (kind, name) in enumerate(events) if kind == "wait" and name.endswith(".r2"))
    started_before = [name for kind, name in events[:first_wait_r2] if kind == "start" and name.endswith(".r2")]
    assert len(started_before) == 3, events[:first_wait_r2]

    def finish_bucket_by_bucket(rank, step, pipe):  # the old order: no round started in progress()
        for b in pipe.buckets:
            b.route.progress = lambda: None

    serial = run_pipeline("powersgd:warmup=0,rank=2", grads, 2, bucket_bytes=small, before_step=finish_bucket_by_bucket)
    for a, b in zip(runs, serial):
        for step in range(2):
            for k in shapes:
                assert torch.allclose(a.results[step][k], b.results[step][k], atol=1e-6)


def test_a_one_round_bucket_is_not_waited_for_in_progress():
    """Only a bucket whose codec asks for another round waits in ``progress()``: a dense bucket leaves
    its wait to ``finish()``, so it never holds up a later bucket's next phase."""
    grads = make_grads(2, 1, seed=4, shapes={"w1": (64, 48), "w2": (48, 32)})
    waited = []

    def log_waits(rank, step, pipe):
        if rank == 0:
            for b in pipe.buckets:
                finish = pipe.exchange.finish_allreduce
                b.route.progress = (lambda route=b.route, f=finish: (
                    setattr(pipe.exchange, "finish_allreduce", lambda p: waited.append(route.tag) or f(p)),
                    type(route).progress(route), setattr(pipe.exchange, "finish_allreduce", f)))

    run_pipeline("fp16", grads, 2, bucket_bytes=48 * 32 * 4, before_step=log_waits)
    assert waited == []
    run_pipeline("powersgd:warmup=0,rank=2", grads, 2, bucket_bytes=48 * 32 * 4, before_step=log_waits)
    assert len(waited) == 2  # each bucket's first round, waited for to start its second
