"""Host or device, and the sanctioned crossings between them.

Rule (``docs/gpu.md``): the data path never asks the host for a device value per tensor and never
inside a backward hook. On a GPU every such read (``.item()``, ``.tolist()``, ``bool(t)``,
``nonzero``, ...) makes the CPU wait until the stream has computed it, and a copy of Python
values to the device without pinned memory waits too. So:

* decisions are device tensors (a non-finite flag, a failed check) combined on the device and
  read once per step (:func:`read_step`);
* sizes the host must know (a payload's length, the split sizes of an alltoall) are read with one
  :func:`read` per collective at most, outside the hooks;
* small host values reach the device by :func:`upload` (pinned memory, non-blocking copy);
* expectations on device values (indices in range, sorted levels) are :func:`expect`-ed: read at
  once on the host, deferred to the step's read on a device.

On CPU tensors all of this costs nothing extra: reads are free there, and the host paths keep
their own branches (:func:`on_host`).
"""
from __future__ import annotations

import contextlib
import threading
import time
from typing import Iterator, List, Optional, Sequence, Tuple, Type

import torch

__all__ = ["on_host", "upload", "upload_tensor", "read", "Timer", "in_range", "nonfinite", "any_nonfinite", "compact", "Checks", "deferred_checks",
           "expect", "read_step"]


def on_host(t: torch.Tensor) -> bool:
    """True for a CPU tensor: reading its values costs nothing, so host code paths may branch on them."""
    return t.device.type == "cpu"


def upload(values, dtype: torch.dtype, device) -> torch.Tensor:
    """Python values as a tensor on ``device``. On a GPU from pinned memory with a non-blocking copy:
    queued on the current stream, the host does not wait (torch keeps the pinned block until the copy
    has run)."""
    t = torch.tensor(values, dtype=dtype)
    if torch.device(device).type == "cpu":
        return t
    return t.pin_memory().to(device, non_blocking=True)


def upload_tensor(t: torch.Tensor, device) -> torch.Tensor:
    """A host tensor copied to ``device`` as :func:`upload` does (pinned, non-blocking); itself on the host."""
    if torch.device(device).type == "cpu":
        return t
    return t.pin_memory().to(device, non_blocking=True)


def read(t: torch.Tensor) -> list:
    """The values of a small tensor on the host: THE device-to-host read (one per collective at
    most; stack what is needed into one tensor first)."""
    return t.reshape(-1).tolist()


class Timer:
    """Seconds between marks of the work queued on ``device``: CUDA events on a GPU (what the stream
    took, not how long the launches took -- ``perf_counter`` around kernel launches measures the
    launches), ``perf_counter`` on the host. ``seconds()`` waits for the last mark (one read)."""

    def __init__(self, device):
        self.cuda = torch.device(device).type == "cuda"
        self.marks: list = []

    def mark(self) -> None:
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            self.marks.append(e)
        else:
            self.marks.append(time.perf_counter())

    def seconds(self) -> List[float]:
        """The intervals between consecutive marks."""
        if self.cuda:
            self.marks[-1].synchronize()
            return [a.elapsed_time(b) / 1000.0 for a, b in zip(self.marks, self.marks[1:])]
        return [b - a for a, b in zip(self.marks, self.marks[1:])]


def any_nonfinite(tensors: Sequence[torch.Tensor]) -> bool:
    """Host test: True when some floating tensor holds a NaN or an Inf. One sum per tensor and one
    read: a sum is finite only when every element is, so only a non-finite sum (a NaN/Inf, or finite
    values overflowing) pays for the exact elementwise test. On CPU ``isfinite(t).all()`` is much
    slower than a sum. Half precision is summed in its own dtype (torch accumulates in float32
    inside, and it is faster on CPU than asking for a float32 result)."""
    fl = [t for t in tensors if t.is_floating_point() and t.numel()]
    if not fl:
        return False
    sums = torch.stack([t.sum().double() for t in fl])
    if bool(torch.isfinite(sums).all()):
        return False
    return any(not bool(torch.isfinite(t).all()) for t in fl)


def nonfinite(tensors: Sequence[torch.Tensor], device=None) -> torch.Tensor:
    """0-d bool tensor: some floating tensor holds a NaN or an Inf. On the host the answer of
    :func:`any_nonfinite`; on a device computed there without a read: a float64 sum of float32 or
    half values cannot overflow, so it is finite exactly when every element is."""
    fl = [t for t in tensors if t.is_floating_point() and t.numel()]
    if not fl:
        dev = device if device is not None else (tensors[0].device if tensors else "cpu")
        return torch.zeros((), dtype=torch.bool, device=dev)
    if on_host(fl[0]):
        return torch.tensor(any_nonfinite(fl))
    parts = [t.sum(dtype=torch.float64) if t.dtype != torch.float64 else (~torch.isfinite(t)).any().double()
             for t in fl]
    return ~torch.isfinite(torch.stack(parts)).all() if len(parts) > 1 else ~torch.isfinite(parts[0])


def compact(mask: torch.Tensor, count: int) -> torch.Tensor:
    """Ascending int64 indices of the True entries of a flat bool ``mask`` that holds ``count`` of
    them (``nonzero`` without a read: the caller knows the count). Host: ``nonzero``."""
    if on_host(mask):
        return mask.nonzero().squeeze(1)
    mask = mask.reshape(-1)
    pos = torch.cumsum(mask, 0) - 1
    dest = torch.where(mask & (pos < count), pos, count)  # the others land in a slot past the end
    out = torch.zeros(count + 1, dtype=torch.int64, device=mask.device)
    out.scatter_(0, dest, torch.arange(mask.numel(), device=mask.device))
    return out[:count]


class Checks:
    """Expectations on device values made during one step, read with the step's flags."""

    def __init__(self):
        self.items: List[Tuple[torch.Tensor, str, Type[Exception]]] = []
        self._lock = threading.Lock()

    def add(self, ok: torch.Tensor, message: str, error: Type[Exception]) -> None:
        with self._lock:
            self.items.append((ok, message, error))

    def take(self) -> List[Tuple[torch.Tensor, str, Type[Exception]]]:
        with self._lock:
            items, self.items = self.items, []
        return items


_tls = threading.local()


@contextlib.contextmanager
def deferred_checks(checks: Optional[Checks]) -> Iterator[Optional[Checks]]:
    """Inside: :func:`expect` on device values adds to ``checks`` instead of reading (this thread)."""
    prev = getattr(_tls, "checks", None)
    _tls.checks = checks
    try:
        yield checks
    finally:
        _tls.checks = prev


def current_checks() -> Optional[Checks]:
    return getattr(_tls, "checks", None)


def expect(ok, message: str, error: Type[Exception] = ValueError) -> None:
    """``ok`` (a bool, or a 0-d bool tensor) must hold, else ``error(message)``. A device tensor is
    read with the step's flags when the step defers its checks (:func:`deferred_checks`), else now."""
    if not isinstance(ok, torch.Tensor):
        if not ok:
            raise error(message)
        return
    chk = current_checks()
    if chk is None or on_host(ok):
        if not bool(ok):
            raise error(message)
        return
    chk.add(ok.reshape(()), message, error)


def in_range(idx: torch.Tensor, n: int, what: str) -> torch.Tensor:
    """``idx`` (integer) must lie in [0, n), else ValueError naming ``what``. On the host checked at once
    (one min/max pass); on a device with the step's checks, and the indices returned clamped into the
    range meanwhile, so that nothing is written out of bounds before the step reads its checks."""
    if on_host(idx):
        if idx.numel():
            lo, hi = torch.aminmax(idx)
            if int(lo) < 0 or int(hi) >= n:
                raise ValueError(f"{what}: an index outside [0, {n}) (a corrupt payload?)")
        return idx
    ok = (idx >= 0) & (idx < n)
    expect(ok.all(), f"{what}: an index outside [0, {n}) (a corrupt payload?)")
    return torch.where(ok, idx, 0)


def read_step(flags: Sequence[torch.Tensor], checks: Optional[Checks] = None) -> bool:
    """The step's one read: True when some flag (0-d bool tensors) is set. A failed check raises its
    error first (a corrupt payload, ranks that disagree), before the step's results are used."""
    items = checks.take() if checks is not None else []
    vals = [f.reshape(()).to(torch.bool) for f in flags] + [~ok.to(torch.bool) for ok, _, _ in items]
    if not vals:
        return False
    by_dev = {}
    for i, v in enumerate(vals):
        by_dev.setdefault(str(v.device), []).append(i)
    got = [False] * len(vals)
    for idxs in by_dev.values():  # one read per device (one device in practice)
        for i, x in zip(idxs, read(torch.stack([vals[i] for i in idxs]))):
            got[i] = bool(x)
    for (ok, message, error), bad in zip(items, got[len(flags):]):
        if bad:
            raise error(message)
    return any(got[:len(flags)])
