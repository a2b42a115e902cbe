"""hvd_ext.testing.device: the emulated GPU that counts what would wait for a GPU."""
from __future__ import annotations

import pytest
import torch

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
