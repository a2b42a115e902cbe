"""The shaped-network testbed (scripts/shaped-cluster) and the benchmark helpers.

Namespace tests need root and iproute2 (ip, tc): they skip with the reason otherwise.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHAPED = ROOT / "scripts" / "shaped-cluster"
sys.path.insert(0, str(ROOT / "benchmarks"))


def _why_not():
    if os.geteuid() != 0:
        return "not root: network namespaces and tc need CAP_NET_ADMIN"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"'{tool}' (iproute2) not installed"
    return None


WHY_NOT = _why_not()
needs_testbed = pytest.mark.skipif(WHY_NOT is not None, reason=WHY_NOT or "")


def _env():
    env = dict(os.environ)
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("OMP_NUM_THREADS", "1")
    env["GLOO_SOCKET_IFNAME"] = "lo"
    return env


def _netns():
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout


def _shaped(*args, timeout=60, env=None):
    return subprocess.run([str(SHAPED), *args], capture_output=True, text=True, timeout=timeout,
                          env=env or _env())


@needs_testbed
def test_namespace_removed_after_success():
    r = _shaped("--rate", "100mbit", "--name", "tbtest", "--",
                "bash", "-c", 'echo "NS=$SHAPED_CLUSTER_NS"; tc qdisc show dev lo; ip -o link show')
    assert r.returncode == 0, r.stderr
    ns = next(ln[3:] for ln in r.stdout.splitlines() if ln.startswith("NS="))
    assert ns.startswith("tbtest-")
    assert "tbf" in r.stdout and "100Mbit" in r.stdout
    links = [ln for ln in r.stdout.splitlines() if ": " in ln and "link/" in ln]
    assert len(links) == 1 and " lo:" in links[0], "only loopback inside the namespace"
    assert ns not in _netns()


@needs_testbed
def test_namespace_removed_after_failure():
    r = _shaped("--name", "tbtest", "--", "bash", "-c", 'echo "NS=$SHAPED_CLUSTER_NS"; exit 7')
    assert r.returncode == 7
    ns = next(ln[3:] for ln in r.stdout.splitlines() if ln.startswith("NS="))
    assert ns not in _netns()
    # a command that cannot be started at all
    r = _shaped("--name", "tbtest", "--", "/nonexistent/cmd")
    assert r.returncode != 0
    assert "tbtest-" not in _netns()


@needs_testbed
def test_namespace_and_processes_removed_after_signal(tmp_path):
    marker = tmp_path / "ns"
    p = subprocess.Popen([str(SHAPED), "--name", "tbtest", "--", "bash", "-c",
                          f'echo "$SHAPED_CLUSTER_NS" > {marker}; sleep 60 & wait'],
                         env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 20
    while not (marker.exists() and marker.read_text().strip()) and time.time() < deadline:
        time.sleep(0.05)
    ns = marker.read_text().strip()
    assert ns in _netns()
    pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()
    assert pids
    p.send_signal(signal.SIGTERM)
    out, err = p.communicate(timeout=20)
    assert p.returncode == 128 + signal.SIGTERM, err
    assert ns not in _netns()
    time.sleep(0.2)
    alive = [pid for pid in pids if Path(f"/proc/{pid}").exists()
             and "Z" not in Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]]
    assert not alive, f"processes of the namespace still alive: {alive}"


def test_clear_errors(tmp_path):
    r = _shaped("--rate", "100mbit")
    assert r.returncode == 2 and "no command" in r.stderr
    r = _shaped("--bogus", "--", "true")
    assert r.returncode == 2 and "unknown option" in r.stderr
    if os.geteuid() == 0 and shutil.which("setpriv"):
        r = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", str(SHAPED), "--", "true"],
                           capture_output=True, text=True, timeout=30)
        assert r.returncode == 2 and "must run as root" in r.stderr, r.stderr
    if os.geteuid() == 0:
        # a PATH with every tool but tc
        bindir = tmp_path / "bin"
        bindir.mkdir()
        for d in ("/usr/local/sbin", "/usr/local/bin", "/usr/sbin", "/usr/bin", "/sbin", "/bin"):
            if not os.path.isdir(d):
                continue
            for name in os.listdir(d):
                if name != "tc" and not (bindir / name).exists():
                    (bindir / name).symlink_to(os.path.join(d, name))
        env = {**_env(), "PATH": str(bindir)}
        r = subprocess.run(["/bin/bash", str(SHAPED), "--", "true"], capture_output=True, text=True, timeout=30,
                           env=env)
        assert r.returncode == 2 and "'tc'" in r.stderr, r.stderr
        r = subprocess.run(["/bin/bash", str(SHAPED), "--unshaped", "--name", "tbtest", "--", "true"],
                           capture_output=True, text=True, timeout=30, env=env)
        assert r.returncode == 0, r.stderr  # an unshaped namespace needs no tc


@needs_testbed
def test_shaped_tcp_bandwidth_within_30_percent():
    r = _shaped("--rate", "100mbit", "--", sys.executable, str(ROOT / "benchmarks" / "netprobe.py"), "--mbytes", "6",
                timeout=60)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout.strip().splitlines()[-1])["mbit_s"]
    assert 70 <= got <= 130, f"TCP over the 100 Mbit/s loopback measured {got:.1f} Mbit/s"


@needs_testbed
def test_shaped_allreduce_bandwidth_within_30_percent():
    """2 gloo ranks allreduce 4 MiB x 3; every byte any rank sends crosses the one 100 Mbit/s shaper."""
    r = _shaped("--rate", "100mbit", "--", sys.executable, str(ROOT / "benchmarks" / "allreduce_probe.py"),
                "--mbytes", "4", "--iters", "3", timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert res["correct"]
    assert 70 <= res["aggregate_mbit_s"] <= 130, f"allreduce over 100 Mbit/s measured {res['aggregate_mbit_s']:.1f}"


def test_compare_plans_and_skips_unregistered():
    """compare.py: baselines always present, unknown compressors skipped (not crashed), DDP commands built."""
    import compare

    a = compare.parse_args(["--quick", "--methods", "nosuchcodec:ratio=0.1", "topk:ratio=5", "fp16"])
    methods = compare.method_list(a)
    assert methods[:5] == ["horovod", "horovod:fp16", "none", "ddp", "ddp-powersgd:rank=2"]
    assert methods.count("fp16") == 1
    plans = {m: compare.plan(m, a, Path("/tmp")) for m in methods}
    assert plans["nosuchcodec:ratio=0.1"]["status"] == "skipped"
    assert "not registered" in plans["nosuchcodec:ratio=0.1"]["reason"]
    assert plans["topk:ratio=5"]["status"] == "skipped"
    assert "--gloo" in plans["none"]["cmd"]
    # the reference is Horovod's own optimizer, not hvd_ext's uncompressed path
    assert "--plain-horovod" in plans["horovod"]["cmd"] and "--plain-horovod" not in plans["none"]["cmd"]
    i = plans["horovod:fp16"]["cmd"].index("--compression")
    assert plans["horovod:fp16"]["cmd"][i + 1] == "fp16"
    assert "torchrun" in plans["ddp"]["cmd"][0] and "--hook" in plans["ddp-powersgd:rank=2"]["cmd"]
    i = plans["ddp-powersgd:rank=2"]["cmd"].index("--rank")
    assert plans["ddp-powersgd:rank=2"]["cmd"][i + 1] == "2"


def test_time_to_target_and_ratios():
    import compare

    a = compare.parse_args(["--target", "0.9"])
    hist = [{"epoch": 1, "test_acc": 0.5, "train_time_s": 2.0}, {"epoch": 2, "test_acc": 0.92, "train_time_s": 4.0}]
    ref = {"method": "horovod", "framework": "horovod", "status": "ok", "result": {"history": hist, "ms_per_step": 10.0, "bytes_sent_per_step": 1000,
                                                          "test_acc": 0.92, "epochs": 2, "exchanges": 250}}
    fast = {"method": "x", "framework": "horovod+hvd_ext", "status": "ok", "result": {"history": [dict(h, train_time_s=h["train_time_s"] / 2) for h in hist],
                                                       "ms_per_step": 5.0, "bytes_sent_per_step": 10, "test_acc": 0.92,
                                                       "epochs": 2, "exchanges": 250}}
    for e in (ref, fast):
        compare.summarize(e, a)
    compare.add_ratios([ref, fast])
    assert ref["time_to_target_s"] == 4.0 and ref["epochs_to_target"] == 2
    assert fast["vs_horovod"]["speedup_ms_per_step"] == 2.0
    assert fast["vs_horovod"]["bytes_fewer"] == 100.0
    assert fast["vs_horovod"]["speedup_time_to_target"] == 2.0
    md = compare.markdown({"config": {"ranks": 2, "epochs": 2, "rate": "300mbit", "tbf_latency": "50ms", "target": 0.9},
                           "methods": [ref, fast, {"method": "y", "status": "skipped", "reason": "not registered"}]})
    assert "| `x` |" in md and "2.00x" in md and "100.0x" in md and "`y`: skipped" in md
