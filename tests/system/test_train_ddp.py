"""scripts/train.py --engine ddp: the main job on PyTorch DDP under torchrun, with hvd_ext's codecs on
DDP's buckets and with DDP's own hooks; bad options fail before any process group starts."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT

TORCHRUN = str(Path(sys.executable).with_name("torchrun"))


def _env():
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _run(tmp_path, compression, port, *extra):
    out = tmp_path / f"{port}.json"
    cmd = [TORCHRUN, "--nproc_per_node", "2", "--master_addr", "127.0.0.1", "--master_port", str(port),
           str(ROOT / "scripts" / "train.py"), "--engine", "ddp", "--compression", compression, "--epochs", "2",
           "--channels", "16", "--no-progress", "--json", str(out), *extra]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=_env()), out


def _train(tmp_path, compression, port, *extra):
    r, out = _run(tmp_path, compression, port, *extra)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert "test accuracy" in r.stdout and "bytes sent per step" in r.stdout
    return json.loads(out.read_text())


@pytest.mark.timeout(600)
def test_train_ddp_engine_hvd_ext_codecs_and_ddp_hooks(tmp_path):
    dense = _train(tmp_path, "ddp:allreduce", 29611)
    half = _train(tmp_path, "ddp:fp16", 29612)
    qsgd = _train(tmp_path, "qsgd:bits=8", 29613)
    assert dense["engine"] == "ddp" and dense["ranks"] == 2
    assert dense["bytes_sent_per_step"] == dense["dense_bytes_per_step"]  # DDP's allreduce: fp32 payload
    assert half["bytes_sent_per_step"] == dense["dense_bytes_per_step"] / 2
    # hvd_ext's 8-bit codec on DDP's bucket: about a quarter of the dense bytes, and it learns
    assert 0.2 < qsgd["bytes_ratio_vs_dense"] < 0.35, qsgd["bytes_ratio_vs_dense"]
    assert qsgd["routes"] and qsgd["compression"] == "qsgd:bits=8"
    for run in (dense, half, qsgd):
        assert run["test_acc"] > 0.3, (run["compression"], run["test_acc"])  # 10 classes: chance is 0.1


@pytest.mark.timeout(600)
def test_train_ddp_engine_killed_and_resumed_ends_as_an_uninterrupted_run(tmp_path):
    """--checkpoint-every, a kill, --resume: model, optimizer, schedule, every rank's error-feedback memory and
    the data order come back, so the resumed run ends bit for bit where the uninterrupted one does."""
    spec, ck = "topk:ratio=0.05", tmp_path / "ck.pt"
    whole = _train(tmp_path, spec, 29621)
    r, out = _run(tmp_path, spec, 29622, "--checkpoint", str(ck), "--checkpoint-every", "100", "--crash-at-step", "150")
    assert r.returncode != 0 and ck.exists() and not out.exists()  # killed after the checkpoint at step 100
    resumed = _train(tmp_path, spec, 29623, "--checkpoint", str(ck), "--resume")
    assert resumed["resumed_from_step"] == 100
    assert resumed["test_acc"] == whole["test_acc"]
    assert [h["test_acc"] for h in resumed["history"]] == [h["test_acc"] for h in whole["history"]]
    other = _run(tmp_path, "qsgd:bits=8", 29624, "--checkpoint", str(ck), "--resume")[0]
    assert other.returncode != 0 and "written with another compression" in other.stderr


@pytest.mark.timeout(120)
@pytest.mark.parametrize("extra, says", [
    (["--sync", "local:period=4"], "--sync belong to the Horovod engine"),
    (["--compression", "ddp:nosuch"], "unknown DDP hook 'nosuch'"),
    (["--compression", "ddp:powersgd:rank=0"], "bad option 'rank=0'"),
    (["--compression", "topk:ratio=7"], "--compression"),
    (["--compression", "ddp:powersgd", "--checkpoint", "x.pt"], "DDP's PowerSGD state"),
    ([], "start it with torchrun"),
])
def test_train_ddp_engine_bad_options_fail_before_any_collective(extra, says):
    env = {k: v for k, v in _env().items() if k not in ("RANK", "WORLD_SIZE")}
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "train.py"), "--engine", "ddp"] + extra,
                       capture_output=True, text=True, timeout=100, env=env)
    assert r.returncode != 0 and says in r.stderr, r.stderr[-2000:]


def _why_no_testbed():
    if os.geteuid() != 0:
        return "not root: the multi-node testbed needs network namespaces (CAP_NET_ADMIN)"
    import shutil

    return next((f"'{t}' (iproute2) not installed: no multi-node testbed" for t in ("ip", "tc")
                 if shutil.which(t) is None), None)


@pytest.mark.timeout(400)
@pytest.mark.skipif(_why_no_testbed() is not None, reason=_why_no_testbed() or "")
def test_train_ddp_engine_across_testbed_nodes_with_torchrun_nodes(tmp_path):
    """scripts/torchrun-nodes: one torchrun per testbed node (2 nodes x 2 ranks, rendezvous on node1);
    hvd_ext's 8-bit codec runs on DDP across them (on the route the cost model picks; no measured trial)."""
    out = tmp_path / "nodes.json"
    env = _env()
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    cmd = [str(ROOT / "scripts" / "shaped-cluster"), "--nodes", "2", "--ranks-per-node", "2", "--inter", "300mbit",
           "--name", "ddptest", "--", str(ROOT / "scripts" / "torchrun-nodes"), str(ROOT / "scripts" / "train.py"),
           "--engine", "ddp", "--compression", "qsgd:bits=8,hierarchy_trial=0", "--epochs", "1", "--channels", "16",
           "--no-progress",
           "--json", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=360, env=env, cwd=str(ROOT))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    got = json.loads(out.read_text())
    assert got["ranks"] == 4 and got["engine"] == "ddp"
    # the route is the cost model's on the links it measured (4 ranks on 2 cores: either can win)
    assert got["routes"] and all(x.split(":")[-1] in ("allgather", "twophase") for x in got["routes"]), got["routes"]
    assert got["test_acc"] > 0.15, got["test_acc"]  # one epoch of 10 classes on 4 ranks: it learns
