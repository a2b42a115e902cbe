"""Build ``kernels/*.cu`` for the CPU and run them as ``hvd_ext.ops.cuda_kernels``' runtime.

    lib = build()                         # g++, cached under build/cuda_cpu/
    prev = hvd_ext.ops.cuda_kernels.use_runtime(CpuRuntime(lib))

The sources are the ones CuPy compiles (``kernels.kernel_source``: common.cuh inlined); one
rewrite makes them C++ -- ``extern __shared__ T name[];`` becomes the launch's dynamic shared
buffer -- and ``cuda_cpu.h`` maps the execution model onto CPU threads. Each ``.cu`` is its own
translation unit with a generated entry table; ``runtime.cpp`` launches.

Variants: ``plain`` (-O2), ``asan`` (AddressSanitizer + UndefinedBehaviorSanitizer), ``tsan``
(ThreadSanitizer). A sanitizer library must come first in the process, so sanitizer builds run
in a child process started with :func:`sanitizer_env`.

:class:`CpuRuntime` is a runtime for ``hvd_ext.ops.cuda_kernels.use_runtime``: it takes tensors that
``hvd_ext.ops.device.on_host`` calls device tensors (the emulated GPU of
``hvd_ext.testing.device``), or -- ``all_tensors=True`` -- CPU tensors too, and passes their
data pointers to the kernels.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Dict, Optional

import numpy as np
import torch

from hvd_ext.ops import cuda_kernels as K
from hvd_ext.ops.device import on_host

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
CXX = os.environ.get("CXX_CUDA_CPU", "g++")
BASE_FLAGS = ["-std=c++17", "-g", "-fPIC", "-shared", "-pthread", "-ffp-contract=off", "-fno-strict-aliasing",
              "-Wall", "-Wno-unknown-pragmas", "-Wno-unused-variable", "-I", str(HERE)]
VARIANTS: Dict[str, list] = {
    "plain": ["-O2"],
    "asan": ["-O1", "-fsanitize=address,undefined", "-fno-sanitize-recover=undefined", "-fno-omit-frame-pointer"],
    "tsan": ["-O1", "-fsanitize=thread"],
}
_DYN_SHARED = re.compile(r"extern\s+__shared__\s+(\w+)\s+(\w+)\s*\[\s*\]\s*;")
_ENTRY = re.compile(r'extern "C" __global__ void (\w+)\(')


def available() -> Optional[str]:
    """None when a C++ compiler is there, else why the harness cannot run."""
    return None if shutil.which(CXX) else f"no C++ compiler ({CXX}) on PATH"


def cpp_source(cu_name: str, text: Optional[str] = None) -> str:
    """The C++ translation unit of one ``.cu`` file (``text``: its source, default the shipped one)."""
    src = K.kernel_source(cu_name) if text is None else text
    src = _DYN_SHARED.sub(lambda m: f"{m.group(1)}* {m.group(2)} = ({m.group(1)}*)hvd_cpu::dynamic_shared();", src)
    names = _ENTRY.findall(src)
    table = ",\n".join(f'    {{"{n}", [](void** a) {{ hvd_cpu::invoke({n}, a); }}}}' for n in names)
    return (f'#include "cuda_cpu.h"\n#include "cuda_cpu_entry.h"\n\n{src}\n\n'
            f"static const hvd_cpu::Entry hvd_entries[] = {{\n{table}\n}};\n"
            f"static hvd_cpu::Registrar hvd_registrar(hvd_entries, {len(names)});\n")


def build(variant: str = "plain", sources: Optional[Dict[str, str]] = None, out_dir: Optional[Path] = None) -> Path:
    """Compile the kernels (``sources``: .cu name -> text, default the shipped files) into a shared
    library; cached by the hash of everything that goes in."""
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {', '.join(VARIANTS)}, got {variant!r}")
    texts = {name: cpp_source(name, (sources or {}).get(name)) for name in K.KERNEL_FILES}
    runtime = (HERE / "runtime.cpp").read_text()
    h = hashlib.sha256()
    for part in [variant, " ".join(BASE_FLAGS + VARIANTS[variant]), runtime, (HERE / "cuda_cpu.h").read_text(),
                 (HERE / "cuda_cpu_entry.h").read_text()] + [texts[n] for n in sorted(texts)]:
        h.update(part.encode())
    out_dir = Path(out_dir) if out_dir is not None else ROOT / "build" / "cuda_cpu" / f"{variant}-{h.hexdigest()[:16]}"
    lib = out_dir / "libhvd_cuda_cpu.so"
    if lib.is_file():
        return lib
    out_dir.mkdir(parents=True, exist_ok=True)
    files = [HERE / "runtime.cpp"]
    for name, text in texts.items():
        p = out_dir / (name.replace(".cu", "") + "_cu.cpp")
        p.write_text(text)
        files.append(p)
    tmp = out_dir / f"libhvd_cuda_cpu.{os.getpid()}.so"
    cmd = [CXX, *BASE_FLAGS, *VARIANTS[variant], *map(str, files), "-o", str(tmp)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"building the CPU kernels failed:\n{' '.join(cmd)}\n{proc.stderr[-6000:]}")
    tmp.replace(lib)
    return lib


def sanitizer_env(variant: str) -> Dict[str, str]:
    """The environment a child process needs to load a sanitizer build (its runtime preloaded)."""
    env = dict(os.environ)
    if variant == "plain":
        return env
    libs = {"asan": ["libasan.so", "libubsan.so"], "tsan": ["libtsan.so"]}[variant]
    paths = [subprocess.run([CXX, f"-print-file-name={n}"], capture_output=True, text=True).stdout.strip()
             for n in libs]
    env["LD_PRELOAD"] = ":".join(paths + [env["LD_PRELOAD"]] if env.get("LD_PRELOAD") else paths)
    env["ASAN_OPTIONS"] = "detect_leaks=0:abort_on_error=0:halt_on_error=1:exitcode=86"
    env["UBSAN_OPTIONS"] = "print_stacktrace=1:halt_on_error=1:exitcode=87"
    env["TSAN_OPTIONS"] = "halt_on_error=1:exitcode=88:report_signal_unsafe=0:ignore_noninstrumented_modules=1"
    return env


class CpuRuntime:
    """An ``hvd_ext.ops.cuda_kernels`` runtime that executes the kernels on CPU threads (see the module docstring)."""

    name = "cpu"

    def __init__(self, lib: Path, all_tensors: bool = False, sm_count: int = 2, timeout: float = 20.0):
        self.lib = ctypes.CDLL(str(lib))
        self.lib.hvd_cpu_launch.restype = ctypes.c_int
        self.lib.hvd_cpu_launch.argtypes = [ctypes.c_char_p, ctypes.c_uint, ctypes.c_uint, ctypes.c_ulonglong,
                                            ctypes.POINTER(ctypes.c_void_p), ctypes.c_char_p, ctypes.c_int]
        self.lib.hvd_cpu_set_timeout.argtypes = [ctypes.c_double]
        self.lib.hvd_cpu_set_timeout(float(timeout))
        self.lib.hvd_cpu_name.restype = ctypes.c_char_p
        self.all_tensors = all_tensors
        self._sm = sm_count
        self.launches: Dict[str, int] = {}

    def kernels(self):
        return sorted(self.lib.hvd_cpu_name(i).decode() for i in range(self.lib.hvd_cpu_count()))

    def unavailable(self) -> Optional[str]:
        return None

    def accepts(self, t: torch.Tensor) -> bool:
        return self.all_tensors or not on_host(t)

    def sm_count(self, device) -> int:
        return self._sm

    _CTYPES = {np.int64: ctypes.c_int64, np.int32: ctypes.c_int32, np.uint32: ctypes.c_uint32,
               np.float32: ctypes.c_float, np.uint64: ctypes.c_uint64}

    def launch(self, device, module, fn, grid, block, args, shared_mem) -> None:
        vals = []
        for a in args:
            if isinstance(a, torch.Tensor):
                vals.append(ctypes.c_void_p(a.data_ptr()))
            else:
                vals.append(self._CTYPES[type(a)](a.item()))
        ptrs = (ctypes.c_void_p * len(vals))(*[ctypes.cast(ctypes.pointer(v), ctypes.c_void_p) for v in vals])
        err = ctypes.create_string_buffer(1024)
        rc = self.lib.hvd_cpu_launch(fn.encode(), int(grid), int(block), int(shared_mem), ptrs, err, len(err))
        self.launches[fn] = self.launches.get(fn, 0) + 1
        if rc:
            raise KernelFault(f"{fn}: {err.value.decode()}")


class KernelFault(RuntimeError):
    """A kernel deadlocked or failed in the CPU harness."""
