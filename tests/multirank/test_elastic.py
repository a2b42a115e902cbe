"""Horovod elastic around hvd_ext.DistributedOptimizer (and LocalSGD): a real elastic ``horovodrun``
on localhost whose host-discovery script removes a worker and adds it back
(tests/multirank/workers/elastic_train.py, which checks each rank in-process; the tests compare the
ranks), with a hard timeout on the whole process group. The single-process checks (size 1) are in
tests/unit/test_world.py and tests/unit/test_optimizer.py."""
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import pytest

from conftest import WORKERS, _env, read_results, run_job
from helpers.checks import assert_checks

TIMEOUT_S = 110


def run_elastic(tmp_path, *args, hosts_text="localhost:2\n", timeout=TIMEOUT_S):
    hosts = tmp_path / "hosts"
    hosts.write_text(hosts_text)
    disc = tmp_path / "discover.sh"
    disc.write_text(f"#!/bin/sh\ncat '{hosts}'\n")
    disc.chmod(0o755)
    py = sys.executable
    hvdrun = shutil.which("horovodrun", path=str(Path(py).parent) + os.pathsep + os.environ.get("PATH", ""))
    # --network-interface: without it an elastic Gloo job waits for two distinct hosts (NIC discovery).
    cmd = [hvdrun, "-np", "2", "--min-np", "1", "--max-np", "2", "--host-discovery-script", str(disc),
           "--network-interface", "lo", "--start-timeout", "60", "--gloo",
           py, str(WORKERS / "elastic_train.py"), "--hosts-file", str(hosts), *map(str, args)]
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="hvdx-results-") as results_dir:
        rc, out, _ = run_job(cmd, timeout, "elastic job", _env(results_dir), merge_stderr=True)
        results = read_results(results_dir)
    elapsed = time.monotonic() - t0
    if rc != 0:
        pytest.fail(f"elastic job exited {rc}\n{out[-6000:]}")
    return sorted(results, key=lambda r: r.get("rank", 0)), out, elapsed


def test_elastic_remove_and_readd_worker(tmp_path):
    results, out, elapsed = run_elastic(tmp_path)
    assert len(results) == 2, out[-6000:]
    # Each rank checked itself: "all: ..." (reached the end at size 2, hvd_ext state followed the synced
    # step counter), "survivor: ..." (sizes 2, 1, 2, resets, routes rebuilt, owner memory dropped, residuals
    # kept, converged), "joiner: ..." (started from zero state, took the step counter over).
    assert_checks(results)
    survivor = next(r for r in results if r["joined_at"] == 0)
    joiner = next(r for r in results if r["joined_at"] > 0)
    assert any(n.startswith("survivor:") for n in survivor["checks"]), sorted(survivor["checks"])
    assert any(n.startswith("joiner:") for n in joiner["checks"]), sorted(joiner["checks"])
    assert survivor["step"] == joiner["step"]
    # LocalSGD counters agreed: both ranks averaged at the same steps
    assert survivor["sync_end"] == {k: {**v, "world_changes": 2} for k, v in joiner["sync_end"].items()}
    # Converged, identical models on both ranks
    for k, loss in survivor["final_loss"].items():
        assert abs(loss - joiner["final_loss"][k]) < 1e-4 * max(1.0, loss), (k, loss, joiner["final_loss"][k])
    assert elapsed < 120, elapsed


def test_elastic_worker_crash_restores_committed_state(tmp_path):
    """A worker dies (exits mid-training). Two "hosts" (localhost, 127.0.0.1): Horovod blacklists the
    crashed worker's host, so on a single hostname the whole job would stop. The survivor's collective
    fails, TorchState.restore loads the last commit -- hvd_ext state included -- and it trains on
    alone with the pipeline rebuilt for size 1 (checked by the survivor: "crash: ...")."""
    crash_at, steps = 10, 60
    results, out, elapsed = run_elastic(tmp_path, "--crash-at", crash_at, "--max-steps", steps,
                                        hosts_text="localhost:1\n127.0.0.1:1\n")
    assert len(results) == 1, out[-6000:]
    assert_checks(results, section="crash")
    assert elapsed < 120, elapsed
