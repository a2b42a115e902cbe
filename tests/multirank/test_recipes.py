"""Horovod's documented recipes, misconfiguration and faults, on real multi-rank jobs.

Each test is one launch with a timeout; the worker scripts are tests/multirank/workers/recipes_*.py."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import WORKERS, _env, launch


# ---- 1. resume recipe: rank 0 loads, broadcast_parameters + broadcast_optimizer_state -------------
def test_resume_recipe_only_rank0_has_state():
    res = launch("recipes_resume.py", np=2, launcher="gloo", timeout=300)
    for r in res:
        assert len(r["optimizers"]) >= 10
        for name, c in r["optimizers"].items():
            assert c["after_recipe"] == 0.0, name     # the state-creating step moved no parameter
            assert c["spread"] == 0.0 and c["finite"], name
            assert c["same_hvd_ext_state"] and c["step"] == 6, name
        for spec, c in r["compressors"].items():
            assert c["after_recipe"] == 0.0 and c["spread"] == 0.0 and c["finite"], spec
            assert c["step"] == 6, spec               # rank 1 took rank 0's exchange count
            if spec != "signum":                      # signum's momentum is per rank by design
                assert c["same_hvd_ext_state"], spec
        for spec, c in r["sync"].items():
            assert c["spread"] == 0.0, spec
        assert r["sync"]["local:period=2"]["steps"] == 8  # rank 1 took rank 0's strategy counters
        # 2 ranks, process set {0}: rank 1 builds the optimizer and steps locally, no collective
        ps = r["outside_set"]
        assert ps["included"] == (r["rank"] == 0) and ps["changed"]
        if r["rank"] == 1:
            assert ps["collectives"] == 0 and ps["local_step_err"] < 1e-6


# ---- 2. process sets: odd/even on 4 ranks -------------------------------------------------------
def test_process_sets_odd_even_four_ranks():
    res = launch("recipes_process_sets.py", np=4, launcher="gloo", timeout=300)
    for r in res:
        for case, c in r.items():
            if not isinstance(c, dict):
                continue
            member = (r["rank"] % 2 == 0) == case.startswith("even")
            assert c["included"] == member, (r["rank"], case)
            assert c["members_spread"] == 0.0, case          # the set's ranks agree
            if member:
                assert c["differs_from_member"] == 0.0 and c["local_err"] > 0  # they did exchange
            else:
                assert c["collectives"] == 0, case             # never communicated
                assert c["local_err"] < 1e-6, case            # exactly a local torch step
                assert c["differs_from_member"] > 0


# ---- 3. ranks configured differently: clear error on every rank, at construction ---------------
def test_config_mismatch_fails_fast_with_both_values():
    res = launch("recipes_config.py", np=2, launcher="gloo", timeout=180)
    for r in res:
        want = {"none_vs_fp16": ("compression", "'none", "'fp16"),
                "topk_vs_qsgd": ("compression", "'topk:", "'qsgd:bits=8"),
                "qsgd4_vs_qsgd8": ("compression", "qsgd:bits=4", "qsgd:bits=8"),
                "feedback": ("compression", "feedback=residual", "feedback=ewma"),
                "shapes": ("parameters", "(8, 6)", "(9, 6)"),
                "bucket_bytes": ("bucket_bytes", "1048576", "64"),
                "op": ("op", "'average'", "'sum'"),
                "passes": ("backward_passes_per_step", "has 1", "has 2"),
                "sync": ("sync", "period=4", "period=8")}
        for case, words in want.items():
            err = r[case]["error"]
            assert err is not None, case
            assert "configured differently" in err and all(w in err for w in words), (case, err)
            assert r[case]["s"] < 30, case
        assert r["same"]["error"] is None
        # once at construction, nothing per step: the first step adds one agreement collective only
        assert r["collectives_per_step"][1:] == [1, 1]


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
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env(),
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"{mode}: job still running {timeout}s after start (a rank hangs)\n{out[-3000:]}")
    end = time.time()
    killed = [float(line.split("KILLED ")[1].split()[0]) for line in out.splitlines() if "KILLED " in line]
    return proc.returncode, (end - killed[0]) if killed else None, out


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
    for r in res:
        for case, c in r.items():
            if case == "rank":
                continue
            assert c["finite_all"] and c["spread"] == 0.0, case   # rank 1's NaN left out, rank 1 recovered
            assert c["skipped_syncs"] >= 1 and c["final_finite"], case
            if r["rank"] == 1:
                # a NaN gradient in a local step: hvd_ext's optimizer skips it; a plain one cannot
                assert c["nan_grad_step_skipped"] is case.endswith("hvd_ext"), case


def test_nonfinite_never_reaches_parameter_server():
    res = launch("recipes_nonfinite.py", "event", np=2, launcher="mpirun", timeout=180)
    for r in res:
        e = r["event"]
        assert e["server_finite"] and e["finite_all"] and e["spread"] == 0.0
    assert res[1]["event"]["skipped_pushes"] >= 1 and res[0]["event"]["skipped_pushes"] == 0


# ---- 6. compatibility: patterns of Horovod scripts (see also multirank/test_optimizer.py's horovod_compat)
def test_horovod_usage_patterns_gloo():
    res = launch("recipes_compat.py", np=2, launcher="gloo", timeout=180)
    for r in res:
        for spec in ("none", "topk:ratio=0.5"):
            c = r[f"requires_grad|{spec}"]
            assert c["spread"] == 0.0 and not c["frozen_moved"], spec  # frozen: not even feedback moves it
        assert r["bpps"] == {"err": 0.0, "spread": 0.0, "third_backward_raises": True}
        o = r["one_rank_module"]
        assert o["spread"] == 0.0 and o["extra_moved"] and o["unused_grad_zero"]


# ---- 7. sparse gradients ---------------------------------------------------------------------------------
def test_sparse_embedding_gradients():
    res = launch("recipes_sparse.py", np=2, launcher="gloo", timeout=180)
    for r in res:
        for case in ("sgd", "sgd_topk", "sparse_adam"):
            c = r[case]
            assert all(c["sparse_grad"]) and c["spread"] == 0.0 and c["err"] < 1e-6, case
            # first step learns which gradients are sparse (dense exchange); then indices + values only
            assert max(c["bytes"][1:]) * 20 < r["dense_bytes"], (case, c["bytes"])
        d = r["as_dense"]  # exchanged dense, handed back sparse (Horovod's sparse_as_dense)
        assert all(d["sparse_grad"]) and d["spread"] == 0.0 and d["err"] < 1e-6
        assert min(d["bytes"]) >= r["dense_bytes"]
        for case, h in r["horovod_sparse_embeddings"].items():  # SparseAdam from the first step
            assert h["sparse_grad"] == [True, True] and h["spread"] == 0.0, (case, h)
