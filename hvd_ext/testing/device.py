"""An emulated GPU for tests: CUDA-looking tensors with CPU data, and a count of host syncs.

A CUDA program stalls whenever the host needs a value that lives on the device: the CPU waits
until the stream has computed it, and stops queueing work meanwhile. In the gradient pipeline
such a wait inside a backward hook stops the CPU from queueing the rest of backward. These
waits cannot be seen on a machine without a GPU -- unless the code runs on tensors that behave
like device tensors. This module provides them:

* :class:`DeviceTensor` holds a CPU tensor but reports ``device == cuda:0`` and ``is_cuda``,
  so every ``t.is_cuda`` / ``t.device`` test in the code takes the GPU branch. Operations run on
  the CPU data (``__torch_dispatch__``); a plain CPU tensor of one element or more mixed into
  an operation raises, as a device mismatch would on a GPU (0-d CPU tensors are scalars there).
* :class:`EmulatedDevice` (a ``TorchFunctionMode``, entered per thread) turns factories asked
  for a CUDA device (``torch.zeros(n, device=t.device)``) into :class:`DeviceTensor`, stands in
  for ``torch.cuda`` streams, events and device properties, and counts, per thread:

  - **reads**: ``.item()``, ``.tolist()``, ``bool()`` / ``int()`` / ``float()`` / index use of a
    device tensor, ``.cpu()``, ``.numpy()``, ``.to("cpu")``, a copy into a CPU tensor, and the
    operations whose output size depends on the data (``nonzero``, boolean-mask indexing,
    ``masked_select``, ``unique``, ``bincount``, ``repeat_interleave`` without ``output_size``)
    -- each is a device-to-host synchronisation on a GPU;
  - **uploads**: a host tensor or Python data copied to the device without
    ``non_blocking=True`` from pinned memory (``torch.tensor(values, device=dev)``,
    ``host.to(dev)``, a CPU index tensor into a device tensor): each waits for the stream.

Counts are kept per *phase* (``counter.phase``: the test sets ``"hook"`` while the backward
hooks run, ``"step"`` otherwise) with the source line of each one (``counter.sites``).

    with EmulatedDevice() as dev:
        g = to_device(torch.randn(10))
        ... run the code under test ...
    print(dev.counter.total())

Each thread that runs code on emulated tensors must enter its own :class:`EmulatedDevice`
(PyTorch keeps function modes per thread); give them one shared :class:`SyncCounter` to
count together. Kernel launches need a stand-in too: ``hvd_ext.ops.cuda_kernels`` then runs its torch
references (CuPy finds no device), or a test installs a CPU execution of the CUDA sources.
"""
from __future__ import annotations

import collections
import contextlib
import sys
import threading
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map

__all__ = ["DeviceTensor", "EmulatedDevice", "SyncCounter", "to_device", "to_host", "is_emulated"]

CUDA = torch.device("cuda", 0)
_aten = torch.ops.aten
_PKG = str(Path(__file__).resolve().parents[1])
_HERE = str(Path(__file__).resolve())
_HELPERS = (_HERE, str(Path(_PKG) / "ops" / "device.py"))  # frames reported by their caller

# aten operations whose output size depends on the values: the host reads a count first
_SIZE_FROM_DATA = {
    _aten.nonzero.default, _aten.masked_select.default, _aten.bincount.default, _aten.equal.default,
    _aten.is_nonzero.default, _aten._unique2.default, _aten.unique_dim.default,
    _aten.unique_consecutive.default, _aten._unique.default,
}


class SyncCounter:
    """Host-device synchronisations seen, by phase and kind, with where they came from."""

    def __init__(self):
        self.phase = "step"
        self._lock = threading.Lock()
        self.counts: Dict[Tuple[str, str], int] = collections.Counter()
        self.sites: List[Tuple[str, str, str]] = []  # (phase, kind, "file:line (what)")

    def add(self, kind: str, what: str) -> None:
        site = _site(what)
        with self._lock:
            self.counts[(self.phase, kind)] += 1
            self.sites.append((self.phase, kind, site))

    def total(self, phase: Optional[str] = None) -> int:
        return sum(v for (p, _), v in self.counts.items() if phase is None or p == phase)

    def reset(self) -> None:
        with self._lock:
            self.counts = collections.Counter()
            self.sites = []

    def where(self, phase: Optional[str] = None) -> List[str]:
        """``"kind at file:line (what)"`` for each sync of ``phase`` (all phases by default)."""
        return [f"{k} at {s}" for p, k, s in self.sites if phase is None or p == phase]


def _site(what: str) -> str:
    """The innermost hvd_ext frame (outside this module) that led here."""
    f = sys._getframe(2)
    first = None
    while f is not None:
        fn = f.f_code.co_filename
        if fn not in _HELPERS and fn.startswith(_PKG):
            return f"{Path(fn).relative_to(Path(_PKG).parent)}:{f.f_lineno} ({what})"
        if first is None and fn != _HERE and "torch" not in fn:
            first = f"{fn}:{f.f_lineno} ({what})"
        f = f.f_back
    return first or f"? ({what})"


_tls = threading.local()


def _counter() -> Optional[SyncCounter]:
    return getattr(_tls, "counter", None)


def _record(kind: str, what: str) -> None:
    c = _counter()
    if c is not None:
        c.add(kind, what)


class DeviceTensor(torch.Tensor):
    """A tensor that says it lives on ``cuda:0`` and keeps its data on the CPU (``.host``)."""

    host: torch.Tensor

    @staticmethod
    def __new__(cls, data: torch.Tensor):
        if isinstance(data, DeviceTensor):
            return data
        r = torch.Tensor._make_wrapper_subclass(
            cls, data.shape, strides=data.stride(), storage_offset=data.storage_offset(), dtype=data.dtype,
            device="meta", layout=data.layout, requires_grad=data.requires_grad)
        r.host = data
        return r

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return CUDA

    @property
    def is_cuda(self) -> bool:  # type: ignore[override]
        return True

    def __repr__(self, *, tensor_contents=None) -> str:
        return f"DeviceTensor({self.host!r})"

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = _READS.get(func)
        if name is not None:
            _record("read", name)
            with torch._C.DisableTorchFunctionSubclass():
                return func(*tree_map(_unwrap, args), **tree_map(_unwrap, kwargs))
        if func is torch.Tensor.data_ptr:  # a raw pointer for a kernel stand-in: the CPU data's
            return args[0].host.data_ptr()
        if func in _SCALARS_AS_TENSORS:  # Python numbers would become tensors on the (meta) device: CPU scalars
            args = tuple(torch.tensor(a) if isinstance(a, (int, float, bool)) else a for a in args)
        elif func is torch.Tensor.__setitem__ and isinstance(args[2], (int, float, bool)):
            args = (args[0], args[1], torch.tensor(args[2], dtype=args[0].dtype))
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _SIZE_FROM_DATA:
            _record("read", str(func.overloadpacket.__name__))
        elif func is _aten.repeat_interleave.Tensor and kwargs.get("output_size") is None:
            _record("read", "repeat_interleave without output_size")
        elif func in (_aten.index.Tensor, _aten.index_put_.default, _aten.index_put.default) and any(
                isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] or ())):
            _record("read", "boolean mask indexing")
        elif func is _aten.copy_.default:
            dst, src = args[0], args[1]
            if not isinstance(dst, DeviceTensor) and isinstance(src, DeviceTensor):
                _record("read", "copy to the host")
                return dst.copy_(src.host)
            if isinstance(dst, DeviceTensor) and not isinstance(src, DeviceTensor) and src.dim() > 0:
                if not (kwargs.get("non_blocking", args[2] if len(args) > 2 else False) and _pinned(src)):
                    _record("upload", "copy from the host")
                dst.host.copy_(src)
                return dst
        elif func is _aten._to_copy.default and _is_host(kwargs.get("device")):
            _record("read", "to the host")
            return func(*tree_map(_unwrap, args), **kwargs)
        plain = []
        a = _unwrap_all(args, plain)
        k = _unwrap_all(kwargs, plain) if kwargs else kwargs
        if plain:
            _check_devices(func, plain)
        out = func(*a, **k)
        if func is _aten._local_scalar_dense.default:
            return out
        return _wrap_all(out)


# functions whose Python-number arguments torch turns into tensors on the first tensor's device
_SCALARS_AS_TENSORS = {torch.where, torch.Tensor.where}


def _unwrap(x):
    if isinstance(x, DeviceTensor):
        return x.host
    if isinstance(x, torch.device) and x.type in ("cuda", "meta"):
        return torch.device("cpu")
    return x


def _wrap(x):
    return DeviceTensor(x) if isinstance(x, torch.Tensor) and not isinstance(x, DeviceTensor) else x


def _unwrap_all(x, plain: list):
    """``x`` with every DeviceTensor replaced by its CPU data and device arguments by the CPU; plain
    tensors of one element or more are collected in ``plain`` (a device mismatch, see below)."""
    if isinstance(x, DeviceTensor):
        return x.host
    if isinstance(x, torch.Tensor):
        if x.dim() > 0:
            plain.append(x)
        return x
    if isinstance(x, (tuple, list)):
        return type(x)(_unwrap_all(v, plain) for v in x)
    if isinstance(x, dict):
        return {key: _unwrap_all(v, plain) for key, v in x.items()}
    if isinstance(x, torch.device) and x.type in ("cuda", "meta"):
        return torch.device("cpu")
    return x


def _wrap_all(x):
    if isinstance(x, torch.Tensor):
        return x if isinstance(x, DeviceTensor) else DeviceTensor(x)
    if isinstance(x, (tuple, list)):
        return type(x)(_wrap_all(v) for v in x)
    return x


def _pinned(t: torch.Tensor) -> bool:
    return bool(getattr(t, "_hvd_pinned", False))


def _check_devices(func, plain) -> None:
    """A host tensor of one element or more among device tensors: a device mismatch on a GPU
    (an index tensor is copied to the device instead: a blocking upload)."""
    if func in (_aten.index.Tensor, _aten.index_put_.default, _aten.index_put.default, _aten.index_select.default):
        _record("upload", f"host index tensor in {func.overloadpacket.__name__}")
        return
    raise RuntimeError(f"Expected all tensors to be on the same device, but found at least two devices, cuda:0 "
                       f"and cpu! (emulated GPU: {func} got a host tensor of shape {tuple(plain[0].shape)})")


def _method(name):
    return getattr(torch.Tensor, name)


_READS = {_method(n): n for n in ("item", "tolist", "__float__", "__int__", "__bool__", "__index__", "numpy",
                                  "__complex__", "cpu", "__array__")}


def _is_host(device) -> bool:
    return device is not None and torch.device(device).type == "cpu"


def _is_gpu(device) -> bool:
    if device is None:
        return False
    if isinstance(device, torch.Tensor):
        return device.is_cuda
    if isinstance(device, int):
        return True
    try:
        return torch.device(device).type == "cuda"
    except (TypeError, RuntimeError):
        return False


def _to_target(args, kwargs):
    """(device, has device) of a ``Tensor.to`` call."""
    if "device" in kwargs:
        return kwargs["device"], True
    for a in args[1:]:
        if isinstance(a, (str, torch.device, int)) or isinstance(a, torch.Tensor):
            return (a.device if isinstance(a, torch.Tensor) else a), True
    return None, False


def to_device(t: torch.Tensor) -> torch.Tensor:
    """``t`` (a CPU tensor) as a :class:`DeviceTensor` (no copy; not counted)."""
    return DeviceTensor(t.detach()) if isinstance(t, torch.Tensor) else t


def to_host(t):
    """The CPU data of a :class:`DeviceTensor` (not counted); anything else unchanged."""
    return t.host if isinstance(t, DeviceTensor) else t


def is_emulated(t) -> bool:
    return isinstance(t, DeviceTensor)


# ---- torch.cuda stand-ins (installed while any EmulatedDevice is active) -----------------------

class _Stream:
    cuda_stream = 0
    device = CUDA

    def synchronize(self):
        _record("read", "stream.synchronize")

    def wait_stream(self, other):
        pass

    def wait_event(self, event):
        pass

    def record_event(self, event=None):
        event = event or _Event()
        event.record(self)
        return event

    def query(self):
        return True


_STREAM = _Stream()


class _Event:
    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False):
        self.t = None

    def record(self, stream=None):
        self.t = time.perf_counter()

    def synchronize(self):
        _record("read", "event.synchronize")

    def query(self):
        return True

    def wait(self, stream=None):
        pass

    def elapsed_time(self, end) -> float:
        return (end.t - self.t) * 1000.0


class _Props:
    multi_processor_count = 4
    name = "emulated GPU (CPU data)"
    total_memory = 1 << 34
    major, minor = 9, 0


def _sync(device=None):
    _record("read", "torch.cuda.synchronize")


_CUDA_STANDINS = {
    "current_stream": lambda device=None: _STREAM,
    "default_stream": lambda device=None: _STREAM,
    "stream": lambda stream=None: contextlib.nullcontext(),
    "Event": _Event,
    "Stream": lambda device=None, priority=0: _Stream(),
    "synchronize": _sync,
    "get_device_properties": lambda device=None: _Props(),
    "current_device": lambda: 0,
    "device_count": lambda: 1,
    "set_sync_debug_mode": lambda mode: None,
}
_patch_lock = threading.Lock()
_patch_depth = 0
_saved: Dict[str, Any] = {}


def _install_cuda_standins() -> None:
    global _patch_depth
    with _patch_lock:
        if _patch_depth == 0:
            for k, v in _CUDA_STANDINS.items():
                _saved[k] = getattr(torch.cuda, k, None)
                setattr(torch.cuda, k, v)
        _patch_depth += 1


def _remove_cuda_standins() -> None:
    global _patch_depth
    with _patch_lock:
        _patch_depth -= 1
        if _patch_depth == 0:
            for k, v in _saved.items():
                setattr(torch.cuda, k, v)
            _saved.clear()


class EmulatedDevice(TorchFunctionMode):
    """The emulated GPU on this thread (see the module docstring). ``counter``: where syncs are
    counted (a new :class:`SyncCounter` unless one is given, e.g. shared by the ranks' threads)."""

    def __init__(self, counter: Optional[SyncCounter] = None):
        super().__init__()
        self.counter = counter if counter is not None else SyncCounter()
        self._prev = None

    def __enter__(self):
        self._prev = _counter()
        _tls.counter = self.counter
        _install_cuda_standins()
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            _tls.counter = self._prev
            _remove_cuda_standins()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.pin_memory:  # no pinned memory without a GPU: mark it instead
            args[0]._hvd_pinned = True
            return args[0]
        if func in (torch.Tensor.to, torch.Tensor.cuda):
            src = args[0]
            dev, has = (kwargs.get("device", args[1] if len(args) > 1 else CUDA), True) \
                if func is torch.Tensor.cuda else _to_target(args, kwargs)
            if has and _is_gpu(dev):
                dtype = kwargs.get("dtype")
                for a in args[1:]:
                    if isinstance(a, torch.dtype):
                        dtype = a
                if isinstance(src, DeviceTensor):  # already there: a dtype conversion at most
                    out = src if dtype is None else src.to(dtype)
                    return out.clone() if kwargs.get("copy") and out is src else out
                if src.dim() > 0 and not (kwargs.get("non_blocking", False) and _pinned(src)):
                    _record("upload", "host tensor to the device")
                out = src.to(dtype=dtype, copy=True) if dtype is not None else src.clone()
                return DeviceTensor(out)
            return func(*args, **kwargs)
        if "pin_memory" in kwargs:
            pin = kwargs.pop("pin_memory")
            out = func(*args, **kwargs)
            if pin and isinstance(out, torch.Tensor):
                out._hvd_pinned = True
            return out
        if "device" in kwargs and _is_gpu(kwargs["device"]) and not any(isinstance(a, DeviceTensor) for a in args):
            kwargs["device"] = "cpu"
            if func in (torch.tensor, torch.as_tensor):  # host data copied to the device (even one value)
                _record("upload", f"torch.{func.__name__}(host data, device=...)")
            out = func(*args, **kwargs)
            return tree_map(_wrap, out)
        return func(*args, **kwargs)
