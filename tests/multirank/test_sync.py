"""Sync strategies on real ranks: LocalSGD, AdaptiveSync, ParameterServer, EventTriggeredSGD.

4 launches in all (one Gloo worker, one MPI worker, one killed + one resumed run of the main job),
each with a timeout. The in-process unit tests are in tests/unit/sync/."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import ROOT, _env, launch


# ---- multi-rank ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def local_checks():
    return launch("sync_local_checks.py", np=2, launcher="gloo", timeout=240)


@pytest.fixture(scope="module")
def async_checks():
    return launch("sync_async_checks.py", np=2, launcher="mpi", timeout=300)


def test_local_sgd_h1_equals_synchronous_sgd(local_checks):
    for r in local_checks:
        h = r["h1"]
        assert h["moved"] > 1e-3 and h["max_diff"] < 1e-5 and h["spread"] == 0.0 and h["exchanges"] == 6


def test_local_sgd_identical_after_sync_and_warmup(local_checks):
    for r in local_checks:
        L = r["local"]
        sp = L["spreads"]
        assert sp[0] == sp[1] == 0.0                    # warm-up: gradients exchanged each step
        assert sp[4] == sp[7] == 0.0                    # syncs after local steps 3 and 6
        assert sp[2] > 0 and sp[3] > 0 and sp[8] > 0    # ranks drift between syncs
        assert L["final_spread"] == 0.0
        assert L["grad_steps"] == 2 and L["syncs"] == 3 and L["exchanges"] == 5
        assert L["stats_exchanges"] == 5 and L["stats_steps"] == 10


def test_adaptive_sync_decisions(local_checks):
    a0, a1 = (r["adaptive"] for r in local_checks)
    assert a0["agree"] == a1["agree"] and a0["diverge"] == a1["diverge"] and a0["history"] == a1["history"]
    assert a0["agree"][0] == 0.0 and a0["agree"][1] == 9     # ranks agree -> H + 1
    assert a0["diverge"][0] > 0.5 and a0["diverge"][1] == 4  # ranks diverge -> H / 2
    assert a0["clamp"] == 2                                  # never below min_period
    assert a0["mom_spread"] == 0.0                           # momentum buffers are synced too
    assert a0["spread"] == 0.0 and a0["exchanges"] == len(a0["history"])
    assert all(1 <= h[2] <= 6 for h in a0["history"])


def test_event_needs_mpi_controller(local_checks):
    for r in local_checks:
        assert r["gloo_event_error"] and "MPI controller" in r["gloo_event_error"]


def test_rma_concurrent_accumulates_sum_exactly(async_checks):
    for r in async_checks:
        assert r["mpi_rank"] == r["rank"] and r["thread_level"] == 3  # one MPI world, THREAD_MULTIPLE
        assert r["rma"]["max_err"] == 0.0 and r["rma"]["pushes"] == 204
        assert r["rma"]["restore_err"] == 0.0
        board = r["rma"]["board"]
        assert [row[0] for row in board] == [0.5, 1.5] and [row[1] for row in board] == [10.0, 20.0]


def test_event_trigger_respects_tau_min_and_tau_max(async_checks):
    for r in async_checks:
        t = r["tau_max_only"]
        assert t["at"] == [5, 10, 15, 20] and t["reasons"]["tau_max"] == 4 and t["reasons"]["threshold"] == 0
        t = r["threshold"]
        assert t["at"] == [3, 6, 9, 12, 15, 18] and t["reasons"]["threshold"] == 6 and t["reasons"]["final"] == 1
        d = r["drift"]
        assert d["at"] == list(range(1, 21)) and d["reasons"]["threshold"] == 20  # drift fires before tau_max
        for x in (r["tau_max_only"], r["threshold"], r["drift"]):
            assert x["spread"] == 0.0 and x["exchanges"] == x["stats_exchanges"]
            assert len(x["weights"]) == len(x["delays"]) == x["exchanges"]
            assert all(0 < w <= 1 for w in x["weights"]) and all(d >= 1 for d in x["delays"])


def test_slow_rank_async_no_deadlock_fast_rank_more_steps(async_checks):
    fast, slow = (r["slow"] for r in async_checks)
    assert fast["spread"] == 0.0 and slow["spread"] == 0.0   # finished, identical after the final average
    assert fast["steps"] > 1.5 * slow["steps"], (fast["steps"], slow["steps"])
    assert fast["exchanges"] > slow["exchanges"]
    assert slow["max_delay"] > 1   # the slow rank sees the fast rank's pushes in between
    assert 0 < slow["min_weight"] <= 1 and slow["n_weights"] == slow["exchanges"]


def _run_train(args, timeout):
    py = sys.executable
    hvdrun = shutil.which("horovodrun", path=str(Path(py).parent) + os.pathsep + os.environ.get("PATH", ""))
    cmd = [hvdrun, "-np", "2", "--mpi", "--mpi-args=--oversubscribe --allow-run-as-root", py,
           str(ROOT / "scripts" / "train.py"), "--no-progress", *args]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=_env(), cwd=str(ROOT),
                           start_new_session=True)
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        pytest.fail(f"{' '.join(cmd)} hung for {timeout}s\n{out[-4000:]}")
    return p.returncode, p.stdout + p.stderr


def test_checkpoint_kill_and_resume_event_sync(tmp_path):
    ck, js = tmp_path / "ck.pt", tmp_path / "out.json"
    # lr 0.1: at the main job's 0.2 the 2-epoch asynchronous run varies 22-55% with scheduling; 0.1 gives 50-52%
    common = ["--epochs", "2", "--lr", "0.1", "--sync", "event:tau_min=4,tau_max=12", "--checkpoint", str(ck),
              "--checkpoint-every", "100", "--json", str(js)]
    rc, out = _run_train(common + ["--crash-at-step", "150"], timeout=240)
    assert rc != 0, "the simulated kill did not happen"
    assert ck.exists() and not js.exists()
    saved = torch.load(ck, weights_only=False)
    assert saved["step"] == 100 and saved["server"]["z"].shape[0] > 0 and len(saved["per_rank"]) == 2
    rc, out = _run_train(common + ["--resume"], timeout=240)
    assert rc == 0, out[-4000:]
    assert "resumed from" in out and "exchanges per rank" in out
    r = json.loads(js.read_text())
    assert r["resumed_from_step"] == 100 and r["steps"] == 250
    assert len(r["exchanges_per_rank"]) == 2 and 0 < r["exchanges"] <= 250 / 4 + 2
    assert r["test_acc"] > 0.3, r["test_acc"]   # 2 epochs only (one-cycle LR, ~50% typical); the full-length figures are in the report
