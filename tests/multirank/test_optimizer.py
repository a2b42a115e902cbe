"""DistributedOptimizer on 2 real Horovod ranks (Gloo controller, MPI controller, plain mpirun).

The workers (optimizer_checks.py, horovod_compat.py) check each rank in-process as named checks;
each test asserts its section of them (helpers.checks.assert_checks)."""

import pytest

from conftest import ROOT, launch
from helpers.checks import assert_checks


@pytest.fixture(scope="module")
def checks():
    return launch("optimizer_checks.py", np=2, launcher="gloo", timeout=240)


def both(checks, name):
    """Both ranks ran the check ``name``: its named checks (run in the worker) all passed."""
    assert len(checks) == 2 and checks[0]["size"] == 2
    assert all(name in r for r in checks), name
    assert_checks(checks, section=name)


def test_average_none_is_exact_mean(checks):
    both(checks, "average_none")


def test_average_fp16_within_half_precision(checks):
    both(checks, "average_fp16")


def test_average_bf16_within_bfloat16_precision(checks):
    """Horovod has no bfloat16 collective: the bits travel as int16, summed in float32 by hvd_ext."""
    both(checks, "average_bf16")


@pytest.mark.parametrize("name", ["identical_none_adam", "identical_fp16", "identical_randomk",
                                  "identical_randomk_shared"])
def test_ranks_identical_after_steps(checks, name):
    both(checks, name)


def test_randomk_bytes_and_mass_conservation(checks):
    both(checks, "randomk_bytes_mass")


def test_nan_on_one_rank_skips_step_everywhere(checks):
    both(checks, "nan_skip")


def test_checkpoint_resume_bit_identical(checks):
    both(checks, "checkpoint_randomk")


def test_backward_passes_per_step(checks):
    both(checks, "backward_passes")


@pytest.mark.parametrize("name", ["overlap_thread_topk", "overlap_thread_qsgd"])
def test_worker_thread_overlap_trains_to_the_same_bits(checks, name):
    both(checks, name)


def test_buckets_start_during_backward(checks):
    both(checks, "overlap")


@pytest.mark.parametrize("launcher", ["mpi", "mpirun"])
def test_horovod_script_patterns(launcher):
    res = launch("horovod_compat.py", np=2, launcher=launcher, timeout=180)
    assert_checks(res)


def test_main_job_runs_and_writes_json(tmp_path):
    """scripts/train.py end to end (1 epoch, randomk) under horovodrun --gloo."""
    import json

    out = tmp_path / "r.json"
    script = ROOT / "scripts" / "train.py"
    launch(script, "--compression", "randomk:ratio=0.05", "--epochs", "1", "--no-progress", "--json", out,
           np=2, launcher="gloo", timeout=240, expect=0)
    r = json.loads(out.read_text())
    for key in ("test_acc", "bytes_sent_per_step", "ms_per_step", "comm_wait_ms_per_step", "steps", "epochs",
                "compression"):
        assert key in r
    assert r["epochs"] == 1 and r["steps"] == 125
    assert r["compression"] == "randomk:ratio=0.05"
    assert 0.1 < r["test_acc"] <= 1.0
    assert r["bytes_sent_per_step"] < 0.2 * r["dense_bytes_per_step"]
