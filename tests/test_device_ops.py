"""hvd_ext.ops.device (the sanctioned host-device crossings) and the emulated GPU that counts syncs."""
from __future__ import annotations

import pytest
import torch

from hvd_ext.ops import device as D
from hvd_ext.testing.device import EmulatedDevice, SyncCounter, to_device, to_host


def test_emulated_device_counts_what_would_wait_for_a_gpu():
    with EmulatedDevice() as emu:
        x = to_device(torch.randn(1000))
        y = (x * 2).abs()
        assert y.is_cuda and y.device.type == "cuda" and emu.counter.total() == 0
        float(y.sum()), y[:3].tolist(), bool(y[0] > 0), y.sum().item()
        assert emu.counter.total() == 4
        (y > 1).nonzero()
        y[y > 1]
        torch.repeat_interleave(torch.arange(3, device=x.device), torch.tensor([1, 2, 3], device=x.device))
        assert emu.counter.total() == 7 + 1   # the last line also uploaded a Python list
        y.cpu()
        torch.tensor([1, 2, 3]).to(x.device)                       # a blocking upload
        torch.tensor([1, 2, 3]).pin_memory().to(x.device, non_blocking=True)  # not blocking: not counted
        assert emu.counter.total() == 10
        kinds = [w.split(" at ")[0] for w in emu.counter.where()]
        assert kinds.count("upload") == 2 and kinds.count("read") == 8
        # a host tensor of one element or more mixed into a device operation: a device mismatch
        with pytest.raises(RuntimeError, match="same device"):
            y[:3] + torch.ones(3)
        assert torch.equal(to_host(y[:3] + torch.tensor(1.0)), to_host(y[:3]) + 1)  # a 0-d CPU tensor is a scalar


def test_emulation_is_per_thread_and_counts_by_phase():
    import threading
    counter = SyncCounter()
    seen = []

    def work():
        with EmulatedDevice(counter):
            x = to_device(torch.ones(4))
            counter.phase = "hook"
            x.sum().item()
            counter.phase = "step"
            x.tolist()
            seen.append(torch.zeros(2, device=x.device).is_cuda)
    t = threading.Thread(target=work)
    t.start()
    t.join()
    assert seen == [True] and counter.total("hook") == 1 and counter.total("step") == 1


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
