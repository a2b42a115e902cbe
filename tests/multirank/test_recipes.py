"""Horovod's documented recipes, misconfiguration and faults, on real multi-rank jobs.

Each test is one launch with a timeout; the worker scripts are tests/multirank/workers/recipes_*.py,
which check each rank in-process as named checks (helpers.checks.assert_checks names any failed one)."""
from __future__ import annotations

import os
import shutil
import sys
import time
from pathlib import Path

import pytest

from conftest import WORKERS, _env, launch, run_job
from helpers.checks import assert_checks


# ---- 1. resume recipe: rank 0 loads, broadcast_parameters + broadcast_optimizer_state -------------
def test_resume_recipe_only_rank0_has_state():
    res = launch("recipes_resume.py", np=2, launcher="gloo", timeout=300)
    assert_checks(res)  # per optimizer, compressor, sync strategy; the process set that excludes rank 1
    for r in res:
        for sec in ("optimizers", "compressors", "sync", "outside_set"):
            assert any(n.startswith(sec + ":") for n in r["checks"]), sec


# ---- 2. process sets: odd/even on 4 ranks -------------------------------------------------------
def test_process_sets_odd_even_four_ranks():
    res = launch("recipes_process_sets.py", np=4, launcher="gloo", timeout=300)
    assert_checks(res)  # members agree and exchanged; the others stepped locally, never communicated
    for r in res:
        for case in ("even_none", "even_topk", "odd_qsgd", "odd_local"):
            assert any(n.startswith(case + ":") for n in r["checks"]), case


# ---- 3. ranks configured differently: clear error on every rank, at construction ---------------
def test_config_mismatch_fails_fast_with_both_values():
    res = launch("recipes_config.py", np=2, launcher="gloo", timeout=180)
    assert_checks(res)  # every case: an error naming what differs and both values, within 30 s
    for r in res:
        assert len(r["checks"]) == 2 * 10 + 2 + 2, sorted(r["checks"])


# ---- 4. faults: a rank killed mid-step ends the job non-zero, quickly ---------------------------
def _run_killed(mode: str, launcher: str, timeout: float = 240.0):
    py = sys.executable
    script = str(WORKERS / "recipes_faults.py")
    if launcher == "gloo":
        hvdrun = shutil.which("horovodrun", path=str(Path(py).parent) + os.pathsep + os.environ.get("PATH", ""))
        cmd = [hvdrun, "-np", "2", "--gloo", py, script, mode]
    else:
        cmd = ["mpirun", "-np", "2", "--oversubscribe", "--allow-run-as-root", "--bind-to", "none",
               "-x", "PYTHONPATH", "-x", "OMP_NUM_THREADS", py, script, mode]
    rc, out, _ = run_job(cmd, timeout, f"{mode}: job (a rank hangs?)", _env(), merge_stderr=True)
    end = time.time()
    killed = [float(line.split("KILLED ")[1].split()[0]) for line in out.splitlines() if "KILLED " in line]
    return rc, (end - killed[0]) if killed else None, out


@pytest.mark.parametrize("mode,launcher", [("every", "gloo"), ("local", "gloo"), ("event", "mpirun")])
def test_rank_killed_mid_step_ends_job(mode, launcher):
    rc, after_kill, out = _run_killed(mode, launcher)
    assert after_kill is not None, out[-3000:]
    assert rc != 0, out[-3000:]
    assert "unreachable" not in out
    assert after_kill < 60, f"job ended {after_kill:.1f}s after the kill"


# ---- 5. non-finite values never reach an average or the parameter server ------------------------
def test_nonfinite_never_reaches_parameter_average():
    res = launch("recipes_nonfinite.py", "avg", np=2, launcher="gloo", timeout=180)
    assert_checks(res)
    for r in res:
        for case in ("local:period=2|hvd_ext", "local:period=2|plain", "adaptive:min=2,max=4|hvd_ext",
                     "adaptive:min=2,max=4|plain"):
            assert any(n.startswith(case + ":") for n in r["checks"]), case


def test_nonfinite_never_reaches_parameter_server():
    res = launch("recipes_nonfinite.py", "event", np=2, launcher="mpirun", timeout=180)
    assert_checks(res, section="event")  # finite everywhere; rank 1's poisoned push skipped, rank 0's not


# ---- 6. compatibility: patterns of Horovod scripts (see also multirank/test_optimizer.py's horovod_compat)
def test_horovod_usage_patterns_gloo():
    res = launch("recipes_compat.py", np=2, launcher="gloo", timeout=180)
    assert_checks(res)
    for r in res:
        assert len(r["checks"]) == 6, sorted(r["checks"])


# ---- 7. sparse gradients ---------------------------------------------------------------------------------
def test_sparse_embedding_gradients():
    res = launch("recipes_sparse.py", np=2, launcher="gloo", timeout=180)
    assert_checks(res)
    for r in res:
        assert len(r["checks"]) == 3 * 2 + 2 + 2, sorted(r["checks"])
