"""Sync strategies on real ranks: LocalSGD, AdaptiveSync, ParameterServer, EventTriggeredSGD.

5 launches in all (two Gloo workers, one MPI worker, one killed + one resumed run of the main job),
each with a timeout. The workers check each rank in-process as named checks; the tests assert them
and compare the ranks. The in-process unit tests are in tests/unit/sync/."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import ROOT, _env, launch
from helpers.checks import assert_checks


# ---- multi-rank ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def local_checks():
    return launch("sync_local_checks.py", np=2, launcher="gloo", timeout=240)


@pytest.fixture(scope="module")
def async_checks():
    return launch("sync_async_checks.py", np=2, launcher="mpi", timeout=300)


def test_local_sgd_h1_equals_synchronous_sgd(local_checks):
    assert_checks(local_checks, section="h1")


def test_local_sgd_identical_after_sync_and_warmup(local_checks):
    assert_checks(local_checks, section="local")


def test_adaptive_sync_decisions(local_checks):
    assert_checks(local_checks, section="adaptive")
    a0, a1 = (r["adaptive"] for r in local_checks)
    assert a0["agree"] == a1["agree"] and a0["diverge"] == a1["diverge"] and a0["history"] == a1["history"]


def test_adaptive_balance_steps_in_proportion_to_speed(local_checks):
    assert_checks(local_checks, section="balance")
    fast, slow = (r["balance"] for r in local_checks)
    assert fast["steps"] > 1.5 * slow["steps"], (fast["steps"], slow["steps"])
    # the same decisions (divergence, period, plan) at every sync; the histories' own step counts differ
    assert fast["syncs"] == slow["syncs"] and fast["plans"] == slow["plans"]
    assert [h[1:] for h in fast["history"]] == [h[1:] for h in slow["history"]]


def test_adaptive_and_balance_on_three_ranks_of_three_speeds():
    """The decision in flight, a checkpoint on rank 0 alone, the plans and the normalised average
    with 3 ranks: every rank decides the same periods and plans."""
    runs = launch("sync_adaptive_ranks3.py", np=3, launcher="gloo", timeout=240)
    assert_checks(runs)
    first = runs[0]
    for r in runs[1:]:
        assert r["adaptive3"]["history"] == first["adaptive3"]["history"]
        assert r["balance3"]["plans"] == first["balance3"]["plans"] and r["balance3"]["syncs"] == first["balance3"]["syncs"]
        assert [h[1:] for h in r["balance3"]["history"]] == [h[1:] for h in first["balance3"]["history"]]


def test_finite_average_flag_travels_with_the_tensors(local_checks):
    assert_checks(local_checks, section="finite")


def test_event_needs_mpi_controller(local_checks):
    assert_checks(local_checks, section="event")


def test_rma_concurrent_accumulates_sum_exactly(async_checks):
    assert_checks(async_checks, section="rma")


def test_event_trigger_respects_tau_min_and_tau_max(async_checks):
    assert_checks(async_checks, section="trigger")


def test_slow_rank_async_no_deadlock_fast_rank_more_steps(async_checks):
    assert_checks(async_checks, section="slow")  # both finished identical; the slow rank's delays, weights
    fast, slow = (r["slow"] for r in async_checks)
    assert fast["steps"] > 1.5 * slow["steps"], (fast["steps"], slow["steps"])
    assert fast["exchanges"] > slow["exchanges"]
    # after finish every push is on the board: global_steps() is both ranks' steps, on either rank
    assert fast["global_steps"] == slow["global_steps"] == fast["steps"] + slow["steps"]


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


def test_local_sgd_main_job_holds_its_accuracy(tmp_path):
    """Guard (main job, ``--sync local:period=8``, 8 epochs, seeds 0 and 3). With each rank's momentum
    buffer kept local, these two seeds ended at 90.8% and 90.1% (a 1e-4 change of the starting point,
    the parameters put back after broadcast_optimizer_state's state-creating step, had moved seed 0 from
    96.55%); averaging the buffers with the parameters (``sync_momentum``, Yu et al. 2019) gives 96.0%
    and 96.95%. Both must stay above 95%."""
    accs = {}
    for seed in (0, 3):
        js = tmp_path / f"local{seed}.json"
        rc, out = _run_train(["--sync", "local:period=8", "--epochs", "8", "--seed", str(seed), "--json", str(js)],
                             timeout=300)
        assert rc == 0, out[-4000:]
        r = json.loads(js.read_text())
        assert r["sync"].startswith("local:period=8")
        accs[seed] = r["test_acc"]
    assert min(accs.values()) >= 0.95, accs


def test_main_job_global_budget_lets_the_fast_rank_step_on(tmp_path):
    """``--sync event --budget global``: the budget is batches over both ranks; the rank that is not slowed
    takes more steps than the one that is, and together they take the budget (plus at most the steps
    not yet pushed to the server's board when each rank last read it)."""
    js = tmp_path / "global.json"
    rc, out = _run_train(["--sync", "event:tau_min=4,tau_max=12", "--budget", "global", "--epochs", "2",
                          "--lr", "0.1", "--slow-rank", "1", "--slow-factor", "3", "--json", str(js)], timeout=240)
    assert rc == 0, out[-4000:]
    r = json.loads(js.read_text())
    fast, slow = r["local_steps_per_rank"]
    budget = 2 * r["steps"]
    assert fast > 1.5 * slow, (fast, slow)
    assert budget <= fast + slow <= budget + 2 * 12, (fast, slow, budget)
    bad = subprocess.run([sys.executable, str(ROOT / "scripts" / "train.py"), "--budget", "global"],
                         capture_output=True, text=True, timeout=120, env=_env())
    assert bad.returncode != 0 and "--budget global needs --sync event" in bad.stderr
