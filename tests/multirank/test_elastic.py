"""Horovod elastic around hvd_ext.DistributedOptimizer (and LocalSGD): a real elastic ``horovodrun``
on localhost whose host-discovery script removes a worker and adds it back
(tests/multirank/workers/elastic_train.py), with a hard timeout on the whole process group. The
in-process checks (size 1) are in tests/unit/test_world.py and tests/unit/test_optimizer.py."""
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import ROOT, WORKERS, _env

TIMEOUT_S = 110


def _results(text):
    out, dec = [], json.JSONDecoder()
    i = text.find("RESULT {")
    while i >= 0:
        obj, end = dec.raw_decode(text, i + 7)
        out.append(obj)
        i = text.find("RESULT {", end)
    return out


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
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env(),
                            cwd=str(ROOT), start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the driver and every worker it started
        out, _ = proc.communicate()
        pytest.fail(f"elastic job hung for {timeout}s\n{out[-6000:]}")
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # a worker left behind by the driver
        except ProcessLookupError:
            pass
    elapsed = time.monotonic() - t0
    if proc.returncode != 0:
        pytest.fail(f"elastic job exited {proc.returncode}\n{out[-6000:]}")
    return _results(out), out, elapsed


def test_elastic_remove_and_readd_worker(tmp_path):
    results, out, elapsed = run_elastic(tmp_path)
    assert len(results) == 2, out[-6000:]
    survivor = next(r for r in results if r["joined_at"] == 0)
    joiner = next(r for r in results if r["joined_at"] > 0)
    for r in results:
        assert r["finished"], r  # reached the end through both phases, not the step limit
        assert r["phase"] == 4 and r["size"] == 2
        # hvd_ext state followed the synced step counter through both resets (local: never exchanges)
        assert r["pipeline_steps"] == {**{k: r["step"] for k in r["pipeline_steps"]}, "local": 0}, r
        assert r["routes"]["topk"] == ["sparse_rs"]
    assert survivor["step"] == joiner["step"]
    # LocalSGD counters agreed: both ranks averaged at the same steps
    assert survivor["sync_end"] == {k: {**v, "world_changes": 2} for k, v in joiner["sync_end"].items()}
    assert survivor["sync_end"]["local"]["syncs"] >= survivor["step"] // 4 - 2

    # The survivor trained at sizes 2, 1, 2; the reset callbacks saw the new sizes.
    after = [e for e in survivor["events"] if e["when"] == "after"]
    before = [e for e in survivor["events"] if e["when"] == "before"]
    assert [e["size"] for e in after] == [2, 1, 2]
    assert [x["size"] for x in survivor["resets"]] == [1, 2]
    assert survivor["world_changes"] == {"topk": 2, "powersgd": 2, "none": 2, "warm": 2, "local": 0}
    for e in after:  # routes rebuilt for the new size; the step counter continued
        t = e["opts"]["topk"]
        assert t["pipeline_size"] == e["size"]
        assert t["routes"] == (["sparse_rs"] if e["size"] == 2 else ["allgather"])
        assert all(o["pipeline_step"] == e["step"] for k, o in e["opts"].items() if k != "local")
        assert all(s["steps"] == e["step"] for s in e["syncs"].values())
    # At size 1: the owner-side memory of the sparse reduce-scatter (its residual and owner ranges)
    # was dropped, the worker residual (error feedback) came through the reset
    assert before[1]["opts"]["topk"]["residual"] > 0 and before[1]["opts"]["topk"]["owner_entries"] >= 1
    assert after[1]["opts"]["topk"]["owner_entries"] == 0
    assert before[2]["opts"]["topk"]["residual"] > 0 and before[2]["opts"]["powersgd"]["residual"] > 0

    # The joined worker started from zero residual and step 0 and took the step counter over
    jb = [e for e in joiner["events"] if e["when"] == "before"][0]
    ja = [e for e in joiner["events"] if e["when"] == "after"][0]
    assert joiner["resets"] == [] and jb["size"] == 2
    assert all(o["pipeline_step"] == 0 and o["residual"] == 0 for o in jb["opts"].values())
    assert all(s["steps"] == 0 for s in jb["syncs"].values())
    assert all(o["pipeline_step"] == joiner["joined_at"] + 1 for k, o in ja["opts"].items() if k != "local")
    assert all(s["steps"] == joiner["joined_at"] + 1 for s in ja["syncs"].values())
    assert ja["opts"]["topk"]["residual"] > 0

    # Converged, identical models on both ranks
    for k, loss in survivor["final_loss"].items():
        assert loss < 0.5 and loss < 0.05 * survivor["init_loss"][k], (k, loss)
        assert abs(loss - joiner["final_loss"][k]) < 1e-4 * max(1.0, loss), (k, loss, joiner["final_loss"][k])
    assert elapsed < 120, elapsed


def test_elastic_worker_crash_restores_committed_state(tmp_path):
    """A worker dies (exits mid-training). Two "hosts" (localhost, 127.0.0.1): Horovod blacklists the
    crashed worker's host, so on a single hostname the whole job would stop. The survivor's collective
    fails, TorchState.restore loads the last commit -- hvd_ext state included -- and it trains on
    alone with the pipeline rebuilt for size 1."""
    crash_at, steps = 10, 60
    results, out, elapsed = run_elastic(tmp_path, "--crash-at", crash_at, "--max-steps", steps,
                                        hosts_text="localhost:1\n127.0.0.1:1\n")
    assert len(results) == 1, out[-6000:]
    r = results[0]
    assert r["finished"] and r["size"] == 1 and r["step"] == steps, r
    assert r["restores"] and r["restores"][0] <= crash_at, r            # HorovodInternalError -> restore
    assert [x["size"] for x in r["resets"]] == [1]
    assert r["pipeline_steps"] == {**{k: steps for k in r["pipeline_steps"]}, "local": 0}
    assert r["world_changes"] == {"topk": 1, "powersgd": 1, "none": 1, "warm": 1, "local": 0}
    before = [e for e in r["events"] if e["when"] == "before"]
    after = [e for e in r["events"] if e["when"] == "after"]
    assert [e["size"] for e in after] == [2, 1]
    # the restored hvd_ext state matches the restored step counter; residuals came back with it
    assert before[1]["size"] == 1
    assert all(o["pipeline_step"] == before[1]["step"] for k, o in before[1]["opts"].items() if k != "local")
    assert before[1]["opts"]["topk"]["residual"] > 0
    assert after[1]["opts"]["topk"]["routes"] == ["allgather"] and after[1]["opts"]["topk"]["owner_entries"] == 0
    for k, loss in r["final_loss"].items():
        assert loss < 0.5 and loss < 0.05 * r["init_loss"][k], (k, loss)
    assert elapsed < 120, elapsed
