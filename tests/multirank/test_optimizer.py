"""DistributedOptimizer on 2 real Horovod ranks (Gloo controller, MPI controller, plain mpirun)."""

import pytest

from conftest import ROOT, launch


@pytest.fixture(scope="module")
def checks():
    return launch("optimizer_checks.py", np=2, launcher="gloo", timeout=240)


def both(checks, name):
    assert len(checks) == 2 and checks[0]["size"] == 2
    return [r[name] for r in checks]


def test_average_none_is_exact_mean(checks):
    for r in both(checks, "average_none"):
        assert r["max_err"] == 0.0
        assert r["bytes_sent"] == r["expected_bytes"]
        assert r["spread"] == 0.0


def test_average_fp16_within_half_precision(checks):
    for r in both(checks, "average_fp16"):
        assert r["max_err"] < 1e-3
        assert r["bytes_sent"] == r["expected_bytes"]


def test_average_bf16_within_bfloat16_precision(checks):
    """Horovod has no bfloat16 collective: the bits travel as int16, summed in float32 by hvd_ext."""
    for r in both(checks, "average_bf16"):
        assert 0 < r["max_err"] < 2e-2
        assert r["bytes_sent"] == r["expected_bytes"]


@pytest.mark.parametrize("name", ["identical_none_adam", "identical_fp16", "identical_randomk",
                                  "identical_randomk_shared"])
def test_ranks_identical_after_steps(checks, name):
    for r in both(checks, name):
        assert r["spread"] == 0.0, "ranks disagree on parameters"
        assert r["moved"] > 1e-4, "parameters did not move"
        assert r["is_instance"] and r["steps"] == 5


def test_randomk_bytes_and_mass_conservation(checks):
    for r in both(checks, "randomk_bytes_mass"):
        assert r["bytes_sent"] == r["expected_bytes"]
        assert r["bytes_received"] == r["expected_received"]
        assert r["mass_err"] == 0.0
        assert r["spread"] == 0.0


def test_nan_on_one_rank_skips_step_everywhere(checks):
    for r in both(checks, "nan_skip"):
        assert r["changed_on_nan_step"] == 0.0
        assert r["memory_untouched"] is True
        assert r["skipped"] == 1
        assert r["finite"] and r["spread"] == 0.0


def test_checkpoint_resume_bit_identical(checks):
    for r in both(checks, "checkpoint_randomk"):
        assert r["checkpoint_has_memory"]
        assert r["identical"], f"resumed run differs by {r['diff']}"


def test_backward_passes_per_step(checks):
    for r in both(checks, "backward_passes"):
        assert r["max_err"] < 1e-6
        assert r["exchanges"] == 1


@pytest.mark.parametrize("name", ["overlap_thread_topk", "overlap_thread_qsgd"])
def test_worker_thread_overlap_trains_to_the_same_bits(checks, name):
    for r in both(checks, name):
        assert "overlap must be 'auto', True or False" in r["bad_setting"]
        assert r["overlap_True"]["resolved"] is True and r["overlap_True"]["stats"] is True
        assert r["overlap_False"]["resolved"] is False and r["overlap_False"]["stats"] is False
        for on in ("True", "False"):  # every bucket handed over (started) by the hooks, in backward
            assert r[f"overlap_{on}"]["buckets"] >= 3
            assert r[f"overlap_{on}"]["started_in_backward"] == r[f"overlap_{on}"]["buckets"]
        assert r["identical"], "overlap=True changed the numbers"
        assert r["moved"] > 1e-4 and r["spread"] == 0.0


def test_buckets_start_during_backward(checks):
    for r in both(checks, "overlap"):
        assert r["buckets"] >= 3
        assert r["started_in_backward"] == r["buckets"]
        assert r["collectives"] == r["buckets"]  # one fused collective per bucket, not one per tensor
        assert r["max_err"] == 0.0


@pytest.mark.parametrize("launcher", ["mpi", "mpirun"])
def test_horovod_script_patterns(launcher):
    res = launch("horovod_compat.py", np=2, launcher=launcher, timeout=180)
    for r in res:
        assert r["mpi"] is True
        assert r["typical_spread"] == 0.0
        assert r["typical_lr"] == pytest.approx(0.005)
        assert r["sum_err"] < 1e-6
        assert r["predivide_err"] < 1e-6
        assert r["adasum_spread"] == 0.0
        assert r["errors"] == {"duplicate": True, "unnamed": True, "zero_grad_race": True}
        assert len(r["optimizers"]) >= 10 and all(r["optimizers"].values()), r["optimizers"]
        assert r["frozen_grad_is_none"]


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
