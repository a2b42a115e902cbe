"""Shared test helpers: launching real multi-rank Horovod jobs with a timeout; the kernel devices.

Layout of tests/ (``python -m pytest -rs -q tests``):

  unit/       single-process tests, mirroring hvd_ext/: unit/<package path>/test_<module>.py
              (unit/exchange/routes/test_twophase.py tests hvd_ext/exchange/routes/twophase.py)
  multirank/  tests that launch several processes (``launch`` / ``run_ranks`` below); the scripts
              they launch are in multirank/workers/ (each emits RESULTs that ``launch`` collects)
  system/     checks of the repository as a whole: layer contracts, scripts, docs, testbed, fuzzing,
              the sync budget on the emulated GPU
  helpers/    helpers shared by several test modules, each written once; cuda_cpu/: the CUDA-on-CPU
              harness

Every folder below tests/ is a package (``__init__.py``), so test modules may share a basename
(unit/test_variance_freeze.py, multirank/test_variance_freeze.py); tests/ itself is not, so pytest
puts it on ``sys.path`` and ``conftest``, ``helpers`` and ``cuda_cpu`` import from any depth.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
WORKERS = Path(__file__).resolve().parent / "multirank" / "workers"


def _env(results_dir=None):
    env = dict(os.environ)
    if results_dir:
        env["HVDX_TEST_RESULTS_DIR"] = results_dir  # workers/common.emit writes each RESULT there
    env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
    env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    env.setdefault("OMPI_MCA_btl_vader_single_copy_mechanism", "none")
    env.setdefault("OMPI_MCA_rmaps_base_oversubscribe", "1")
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONUNBUFFERED"] = "1"
    return env


def launch(script, *args, np=2, launcher="gloo", timeout=180, expect=None):
    """Run ``script`` (a path, or a name under tests/multirank/workers) on ``np`` ranks.

    launcher: "gloo" -> horovodrun --gloo, "mpi" -> horovodrun --mpi, "mpirun" -> plain mpirun.
    Returns the list of JSON objects the ranks emitted (workers/common.emit writes them to files in a
    fresh folder, so a launcher that splits long output lines cannot garble them): ``expect`` of them,
    default one per rank, sorted by their "rank" key. A hang fails after ``timeout`` seconds; a
    non-zero exit fails with the output.
    """
    script = Path(script)
    if not script.is_absolute():
        script = WORKERS / script
    py = sys.executable
    hvdrun = shutil.which("horovodrun", path=str(Path(py).parent) + os.pathsep + os.environ.get("PATH", ""))
    if launcher == "gloo":
        cmd = [hvdrun, "-np", str(np), "--gloo", py, str(script), *map(str, args)]
    elif launcher == "mpi":
        cmd = [hvdrun, "-np", str(np), "--mpi", "--mpi-args=--oversubscribe --allow-run-as-root",
               py, str(script), *map(str, args)]
    elif launcher == "mpirun":
        cmd = ["mpirun", "-np", str(np), "--oversubscribe", "--allow-run-as-root", "--bind-to", "none",
               "-x", "PYTHONPATH", "-x", "OMP_NUM_THREADS", "-x", "HVDX_TEST_RESULTS_DIR",
               py, str(script), *map(str, args)]
    else:
        raise ValueError(f"launcher must be gloo, mpi or mpirun, got {launcher!r}")
    with tempfile.TemporaryDirectory(prefix="hvdx-results-") as results_dir:
        rc, stdout, stderr = run_job(cmd, timeout, " ".join(cmd), _env(results_dir))
        out = stdout + stderr
        if rc != 0:
            pytest.fail(f"{' '.join(cmd)} exited {rc}\n{out[-6000:]}")
        results = read_results(results_dir)
    results.sort(key=lambda r: r.get("rank", 0))
    expect = np if expect is None else expect
    if len(results) != expect:
        pytest.fail(f"expected {expect} RESULTs, got {len(results)}\n{out[-6000:]}")
    return results


def run_job(cmd, timeout, what, env, merge_stderr=False):
    """Run a launcher command in its own session: on a hang the launcher and every rank it started are
    killed and the test fails after ``timeout`` seconds; a rank left behind when it ends is killed too.
    Returns (returncode, stdout, stderr); with ``merge_stderr`` stderr is in stdout."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT if merge_stderr else subprocess.PIPE,
                            text=True, env=env, cwd=str(ROOT), start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        pytest.fail(f"{what} hung for {timeout}s (deadlock?)\n{(stdout + (stderr or ''))[-4000:]}")
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return proc.returncode, stdout, stderr or ""


def read_results(results_dir):
    """The RESULT objects the workers wrote to ``results_dir`` (workers/common.emit), in file order."""
    return [json.loads(line) for f in sorted(Path(results_dir).glob("*.jsonl"))
            for line in f.read_text().splitlines() if line.strip()]


@pytest.fixture
def run_ranks():
    return launch


# ---- devices the CUDA kernels run on: a real GPU, and the CPU execution of the same sources -------

def _kernel_devices():
    """``cuda`` when torch sees a GPU and CuPy imports; ``cpu-harness`` always (skipped without g++)."""
    out = []
    import torch
    if torch.cuda.is_available():
        try:
            import cupy  # noqa: F401
            out.append("cuda")
        except Exception:
            pass
    out.append("cpu-harness")
    return out


KERNEL_DEVICES = _kernel_devices()
HARNESS_VARIANT = os.environ.get("HVD_CUDA_CPU_VARIANT", "plain")
HARNESS_CAP = int(os.environ.get("HVD_CUDA_CPU_CAP", "60000"))  # largest n a harness test takes


@pytest.fixture(scope="session")
def cuda_cpu_lib():
    """The CPU build of kernels/*.cu (``HVD_CUDA_CPU_VARIANT``: plain, asan or tsan; a sanitizer build
    needs its runtime preloaded, see tests/cuda_cpu/harness.py)."""
    from cuda_cpu import harness
    why = harness.available()
    if why is not None:
        pytest.skip(f"CPU execution of the CUDA kernels not run: {why}")
    return harness.build(HARNESS_VARIANT)


class KernelDevice:
    """Where a kernel test runs: ``put`` a CPU tensor there, ``get`` it back; ``n`` scales the sizes
    the CPU harness would take minutes on (one OS thread per CUDA thread) down to its ``cap``."""

    def __init__(self, name: str, cap: int = 0):
        self.name = name
        self.cap = cap

    def put(self, t):
        if self.name == "cuda":
            return t.cuda()
        from hvd_ext.testing.device import to_device
        return to_device(t)

    def get(self, t):
        if self.name == "cuda":
            return t.cpu()
        from hvd_ext.testing.device import to_host
        return to_host(t)

    def n(self, n: int) -> int:
        return n if not self.cap else min(n, self.cap)


@pytest.fixture(params=KERNEL_DEVICES)
def kdev(request):
    """Each kernel test once per device: a real GPU (skipped without one), and the CPU harness --
    the kernels of kernels/*.cu executed on CPU threads under an emulated GPU
    (hvd_ext.testing.device), launched by hvd_ext.ops.cuda_kernels' own host code."""
    from hvd_ext.ops import cuda_kernels as K
    K.use_reference(False)
    if request.param == "cuda":
        yield KernelDevice("cuda")
        return
    from cuda_cpu.harness import CpuRuntime
    from hvd_ext.testing.device import EmulatedDevice
    lib = request.getfixturevalue("cuda_cpu_lib")
    prev = K.use_runtime(CpuRuntime(lib))
    try:
        with EmulatedDevice():
            yield KernelDevice("cpu-harness", cap=HARNESS_CAP)
    finally:
        K.use_runtime(prev)
