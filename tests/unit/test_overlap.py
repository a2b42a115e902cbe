"""Overlap (hvd_ext.overlap): buckets compressed on a worker thread give the same numbers as
compression inside the hooks, on simulated worlds of 2-4 ranks; the setting is checked and
resolved as documented; a codec's error on the worker surfaces at finish()."""
import threading

import pytest
import torch

from hvd_ext import overlap as ov
from hvd_ext.spec import compression_from_spec
from hvd_ext.testing.harness import run_pipeline
from helpers.simgrads import make_grads

# small buckets: each of the four tensors goes in its own bucket, so several are queued on the worker
BUCKET = 1024


@pytest.mark.parametrize("size", [2, 3, 4])
@pytest.mark.parametrize("spec", ["none", "fp16", "topk:ratio=0.05", "qsgd:bits=4",
                                  "qsgd:bits=8,route=twophase", "randomk:ratio=0.1",
                                  "powersgd:rank=2", "efsignsgd"])
def test_worker_thread_gives_the_same_numbers(spec, size):
    grads = make_grads(size, steps=4, seed=size)
    inline = run_pipeline(spec, grads, size, bucket_bytes=BUCKET)
    worker = run_pipeline(spec, grads, size, bucket_bytes=BUCKET, overlap=True)
    assert len(inline[0].pipeline.buckets) >= 3
    assert worker[0].pipeline.overlap and not inline[0].pipeline.overlap
    for a, b in zip(inline, worker):
        assert a.routes == b.routes
        assert a.received == b.received
        for step, (ra, rb) in enumerate(zip(a.results, b.results)):
            for name in ra:
                assert torch.equal(ra[name], rb[name]), f"{spec} rank {a.rank} step {step} {name}"


def test_buckets_are_compressed_off_the_calling_thread():
    """Each bucket's codec runs on the worker, not on the thread that marked it ready."""
    seen = []

    def spy(rank):
        comp = compression_from_spec("topk:ratio=0.1")
        inner = comp.compress

        def compress(tensor, info):
            seen.append(threading.current_thread().name)
            return inner(tensor, info)
        comp.compress = compress
        return comp

    grads = make_grads(2, steps=2)
    runs = run_pipeline(spy, grads, 2, bucket_bytes=BUCKET, overlap=True)
    assert seen and all(name == "hvd_ext-code" for name in seen), set(seen)
    assert len(runs[0].results) == 2


def test_nonfinite_on_one_rank_skips_the_step_on_every_rank_with_overlap():
    grads = make_grads(3, steps=3)
    grads[1][2]["w2"][0, 0] = float("nan")
    runs = run_pipeline("topk:ratio=0.1", grads, 3, bucket_bytes=BUCKET, overlap=True)
    for r in runs:
        assert r.skipped == [False, True, False]


class _Boom(RuntimeError):
    pass


def test_a_codec_error_on_the_worker_is_raised_at_finish():
    def failing(rank):
        comp = compression_from_spec("topk:ratio=0.1")
        inner = comp.compress

        def compress(tensor, info):
            if info.step == 1:
                raise _Boom("codec failed")
            return inner(tensor, info)
        comp.compress = compress
        return comp

    grads = make_grads(2, steps=3)
    with pytest.raises(_Boom, match="codec failed"):
        run_pipeline(failing, grads, 2, bucket_bytes=BUCKET, overlap=True, timeout=20)


@pytest.mark.parametrize("bad", ["yes", "on", 1, 0, None, "Auto"])
def test_overlap_setting_is_checked(bad):
    with pytest.raises(ValueError, match="overlap must be 'auto', True or False"):
        ov.check_overlap(bad)


def test_auto_turns_on_with_two_cores_per_local_rank(monkeypatch):
    monkeypatch.setattr(ov.os, "sched_getaffinity", lambda pid: set(range(8)))
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    assert ov.resolve_overlap("auto", cpu, local_size=4) is True    # 2 cores per rank
    assert ov.resolve_overlap("auto", cpu, local_size=8) is False   # 1 core per rank
    assert ov.resolve_overlap("auto", gpu, local_size=1) is False   # not measured on a GPU yet
    assert ov.resolve_overlap(True, cpu, local_size=8) is True
    assert ov.resolve_overlap(False, cpu, local_size=1) is False


def test_worker_drain_waits_for_every_job_in_order():
    w = ov.CodeWorker()
    out = []
    for i in range(50):
        w.submit(lambda i=i: out.append(i))
    w.drain()
    assert out == list(range(50)) and not w.busy
    w.close()


def test_worker_issues_gpu_work_on_the_gradients_stream():
    """On a GPU the worker runs a bucket inside ``torch.cuda.stream(s)`` of the stream that was current
    where the bucket completed (the one backward produced its gradients on), so its kernels queue
    behind those gradients; nothing of it runs on the hooks' thread."""
    import contextlib
    from hvd_ext.ops import cuda_kernels as kernels
    from hvd_ext.testing.device import EmulatedDevice, SyncCounter, to_device
    entered = []
    marker = object()
    kernels.use_reference(True)  # no kernels on the emulated GPU: their torch code
    with EmulatedDevice():  # the torch.cuda stand-ins stay installed while the ranks' threads run
        standins = (torch.cuda.current_stream, torch.cuda.stream)

        @contextlib.contextmanager
        def stream(s):  # (the worker's thread also needs the emulation: torch keeps function modes per thread)
            entered.append((s, threading.current_thread().name))
            with EmulatedDevice(SyncCounter()):
                yield
        torch.cuda.current_stream, torch.cuda.stream = (lambda device=None: marker), stream
        try:
            grads = [[{n: to_device(t) for n, t in per.items()} for per in step] for step in make_grads(2, 2)]
            runs = run_pipeline("qsgd:bits=8", grads, 2, overlap=True,
                                rank_context=lambda r: EmulatedDevice(SyncCounter()))
        finally:
            torch.cuda.current_stream, torch.cuda.stream = standins
            kernels.use_reference(False)
    assert entered and all(s is marker for s, _ in entered)
    assert all(name.startswith("hvd_ext-code") for _, name in entered)
    assert len(entered) == 2 * 2 * len(runs[0].pipeline.buckets)  # every bucket, rank and step
