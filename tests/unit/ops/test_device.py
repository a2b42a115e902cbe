"""hvd_ext.ops.device: the sanctioned host-device crossings (uploads, the one read per step, deferred
checks, timers) and the non-finite test."""
from __future__ import annotations

import pytest
import torch

from hvd_ext.ops import device as D
from hvd_ext.testing.device import EmulatedDevice, to_device, to_host


def test_on_host_upload_read():
    cpu = torch.zeros(3)
    assert D.on_host(cpu)
    assert torch.equal(D.upload([1, 2], torch.int64, "cpu"), torch.tensor([1, 2]))
    with EmulatedDevice() as emu:
        x = to_device(torch.zeros(3))
        assert not D.on_host(x)
        up = D.upload([4, 5, 6], torch.int32, x.device)
        assert up.is_cuda and torch.equal(to_host(up), torch.tensor([4, 5, 6], dtype=torch.int32))
        assert emu.counter.total() == 0                              # pinned, non-blocking
        assert D.read(up) == [4, 5, 6] and emu.counter.total() == 1  # THE read


@pytest.mark.parametrize("where", ["host", "device"])
def test_nonfinite_is_exact_without_a_read(where):
    big = torch.full((1000,), 3e38)          # finite values whose float32 sum overflows
    cases = [(big, False), (torch.tensor([1.0, float("nan")]), True), (torch.tensor([float("-inf"), 2.0]), True),
             (torch.full((1000,), 65000.0), False), (torch.ones(3, dtype=torch.float16) * 60000, False)]
    with EmulatedDevice() as emu:
        for t, want in cases:
            t = to_device(t) if where == "device" else t
            f = D.nonfinite([t, torch.zeros(2) if where == "host" else to_device(torch.zeros(2))])
            assert f.dtype == torch.bool and f.dim() == 0
            assert bool(to_host(f)) is want, (t, want)
        if where == "device":
            assert emu.counter.total() == 0  # (to_host is not counted)


def test_compact_without_a_read():
    mask = torch.rand(5000, generator=torch.Generator().manual_seed(0)) < 0.1
    want = mask.nonzero().squeeze(1)
    assert torch.equal(D.compact(mask, int(mask.sum())), want)
    with EmulatedDevice() as emu:
        got = D.compact(to_device(mask), int(mask.sum()))
        assert emu.counter.total() == 0
        assert torch.equal(to_host(got), want)


def test_expect_reads_at_once_outside_a_step_and_with_the_step_inside():
    with pytest.raises(ValueError, match="bad"):
        D.expect(torch.tensor(False), "bad")
    D.expect(True, "fine")
    with EmulatedDevice() as emu:
        ok, bad = to_device(torch.tensor(True)), to_device(torch.tensor(False))
        with pytest.raises(KeyError, match="now"):
            D.expect(bad, "now", KeyError)                      # no step: read at once
        checks = D.Checks()
        with D.deferred_checks(checks):
            D.expect(ok, "fine")
            D.expect(bad, "later", RuntimeError)
        n = emu.counter.total()
        with pytest.raises(RuntimeError, match="later"):
            D.read_step([to_device(torch.tensor(False))], checks)
        assert emu.counter.total() == n + 1                     # flags and checks: one read
        assert D.read_step([to_device(torch.tensor(False)), to_device(torch.tensor(True))], D.Checks()) is True


def test_timer_uses_cuda_events_on_a_gpu():
    t = D.Timer("cpu")
    t.mark()
    t.mark()
    assert not t.cuda and len(t.seconds()) == 1
    recorded = []
    with EmulatedDevice():
        real = torch.cuda.Event

        class Event(real):
            def record(self, stream=None):
                recorded.append(self)
                super().record(stream)
        torch.cuda.Event = Event
        try:
            g = D.Timer(to_device(torch.zeros(1)).device)
            for _ in range(3):
                g.mark()
            assert g.cuda and len(g.seconds()) == 2 and len(recorded) == 3
        finally:
            torch.cuda.Event = real


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_any_nonfinite(dtype):
    from hvd_ext.ops.device import any_nonfinite

    big = torch.finfo(dtype).max
    ok = [torch.randn(1000).to(dtype), torch.full((8,), big, dtype=dtype), torch.arange(5)]  # the sum overflows
    assert not any_nonfinite(ok)
    assert not any_nonfinite([])
    for bad in (float("nan"), float("inf"), float("-inf")):
        t = torch.randn(300).to(dtype)
        t[123] = bad
        assert any_nonfinite(ok + [t])
