"""The shaped-network testbed (scripts/shaped-cluster).

Namespace tests need root and iproute2 (ip, tc): they skip with the reason otherwise."""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import ROOT

SHAPED = ROOT / "scripts" / "shaped-cluster"


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


@needs_testbed
@pytest.mark.parametrize("opts, at_rate", [([], False), (["--mtu", "9000", "--burst", "16kb", "--latency", "400ms"],
                                                          True)])
def test_a_link_shaped_with_a_small_bucket_sends_at_its_rate_after_an_idle_spell(opts, at_rate):
    """300 KB after 50 ms idle at 100 Mbit/s take 24 ms on a link; the default 256 KiB bucket lets most
    through at once (the burst a real NIC does not give); loopback's MTU lowered, a 16 KiB bucket does not
    (benchmarks/shaper_check.py's probe)."""
    r = _shaped("--rate", "100mbit", *opts, "--", sys.executable, str(ROOT / "benchmarks" / "shaper_check.py"),
                "--worker", "--only", "idle", timeout=60)
    assert r.returncode == 0, r.stderr
    took = json.loads(r.stdout.strip().splitlines()[-1])["idle"]["300000"]
    assert (took > 0.6 * 0.024) == at_rate, f"300 KB after an idle spell took {took * 1e3:.1f} ms ({opts})"


def _run_testbed(args, timeout, env=None):
    """Run shaped-cluster; on timeout SIGTERM it (so it removes its namespaces) and fail."""
    p = subprocess.Popen([str(SHAPED), *args], env=env or _env(), stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.send_signal(signal.SIGTERM)
        out, err = p.communicate(timeout=30)
        pytest.fail(f"shaped-cluster {' '.join(args)} timed out after {timeout}s\n{out[-3000:]}\n{err[-3000:]}")
    return subprocess.CompletedProcess(p.args, p.returncode, out, err)


def _kv(stdout):
    """KEY=VALUE lines of a testbed command's output."""
    return dict(ln.split("=", 1) for ln in stdout.splitlines() if "=" in ln and ln.split("=", 1)[0].isupper())


def _gone(namespaces):
    listed = {ln.split()[0] for ln in _netns().splitlines() if ln.strip()}
    return not (set(namespaces) & listed) and not any(Path("/etc/netns", ns).exists() for ns in namespaces)


@needs_testbed
def test_multinode_layout_addresses_hosts_and_ssh_standin():
    """3 nodes x 2: per-node namespaces, shaped veths both ways, /etc/hosts, the ssh stand-in, no way out."""
    cmd = r'''
echo "HOSTS=$SHAPED_CLUSTER_HOSTS"; echo "NP=$SHAPED_CLUSTER_NP"; echo "NSS=$SHAPED_CLUSTER_NAMESPACES"
echo "SW=$SHAPED_CLUSTER_SWITCH_NS"; echo "TMPBIN=$(dirname "$(command -v ssh)")"; echo "AGENT=$OMPI_MCA_plm_rsh_agent"
echo "HOSTNAME1=$(hostname)"
echo "ADDR1=$(ip -o -4 addr show dev eth0 | awk '{print $4}')"
echo "ROUTES1=$(ip -4 route | tr '\n' ';')"
echo "LINKS1=$(ip -o link | awk -F': ' '{print $2}' | cut -d@ -f1 | tr '\n' ' ')"
echo "QDISC1=$(tc qdisc show dev eth0) / $(tc qdisc show dev lo)"
echo "QDISCSW=$(ip netns exec "$SHAPED_CLUSTER_SWITCH_NS" tc qdisc show | grep -c 'tbf.*100Mbit')"
echo "RESOLVE=$(python -c 'import socket; print(*[socket.gethostbyname(f"node{i}") for i in (1, 2, 3)])')"
command -v nsenter >/dev/null && echo "ROOTADDR=$(nsenter --net=/proc/$TB_ROOT_PID/ns/net ip -o -4 addr show to 10.77.0.0/16 | wc -l)"
ssh -o PasswordAuthentication=no -o StrictHostKeyChecking=no node2 date >/dev/null; echo "SSHCHECK=$?"
echo "REMOTE=$(ssh -q -x -T -p 22 -i /nonexistent root@node3 -o ConnectTimeout=5 'echo $(hostname) $(pwd) $(ip -o -4 addr show dev eth0 | awk "{print \$4}") $FOO')"
echo "BYADDR=$(FOO=bar ssh 10.77.0.2 -n hostname)"
echo "ENVVAR=$(FOO=bar ssh node2 'echo "[$FOO]"')"
echo "REMOTEHOSTS=$(ssh node3 getent hosts node1 | awk '{print $1}')"
ssh node2 'exit 3'; echo "EXIT=$?"
ssh nosuchnode true 2>/dev/null; echo "UNKNOWN=$?"
'''
    env = {**_env(), "TB_ROOT_PID": str(os.getpid())}
    r = _run_testbed(["--nodes", "3", "--ranks-per-node", "2", "--inter", "100mbit", "--intra", "1gbit",
                      "--name", "tbtest", "--", "bash", "-c", cmd], timeout=60, env=env)
    assert r.returncode == 0, r.stderr
    kv = _kv(r.stdout)
    assert kv["HOSTS"] == "node1:2,node2:2,node3:2" and kv["NP"] == "6"
    nss = kv["NSS"].split() + [kv["SW"]]
    assert len(nss) == 4 and all(ns.startswith("tbtest-") for ns in nss)
    assert kv["AGENT"] == kv["TMPBIN"] + "/ssh"
    if shutil.which("unshare") and shutil.which("hostname"):
        assert kv["HOSTNAME1"] == "node1"
        assert kv["BYADDR"] == "node2"
    assert kv["ADDR1"] == "10.77.0.1/24"
    assert [x.strip() for x in kv["ROUTES1"].strip(";").split(";")] == ["10.77.0.0/24 dev eth0 proto kernel scope link src 10.77.0.1"], \
        "no default route: nothing can leave the testbed"
    assert sorted(kv["LINKS1"].split()) == ["eth0", "lo"]
    assert "tbf" in kv["QDISC1"] and "100Mbit" in kv["QDISC1"] and "1Gbit" in kv["QDISC1"]
    assert kv["QDISCSW"] == "3", "the switch-side end of every node's veth is shaped too"
    assert kv["RESOLVE"] == "10.77.0.1 10.77.0.2 10.77.0.3"
    if shutil.which("nsenter"):
        assert kv["ROOTADDR"] == "0", "no testbed address in the machine's own namespace"
    assert kv["SSHCHECK"] == "0"
    remote = kv["REMOTE"].split()
    assert remote[1:3] == [os.environ.get("HOME", "/root"), "10.77.0.3/24"] and len(remote) == 3, \
        "ssh lands in $HOME of node3, with a login environment (FOO not passed)"
    assert kv["ENVVAR"] == "[]"
    assert kv["REMOTEHOSTS"] == "10.77.0.1"
    assert kv["EXIT"] == "3" and kv["UNKNOWN"] == "255"
    assert _gone(nss), _netns()
    assert not Path(kv["TMPBIN"]).exists()


@needs_testbed
def test_multinode_removed_after_signal(tmp_path):
    """SIGTERM while a remote command runs on node2: every namespace, /etc/netns entry and process goes."""
    marker = tmp_path / "ns"
    p = subprocess.Popen([str(SHAPED), "--nodes", "2", "--inter", "100mbit", "--name", "tbtest", "--", "bash", "-c",
                          f'ssh node2 "sleep 60" & sleep 60 & '
                          f'echo "$SHAPED_CLUSTER_NAMESPACES $SHAPED_CLUSTER_SWITCH_NS" > {marker}; wait'],
                         env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 20
        nss, pids = [], []
        while time.time() < deadline:
            if marker.exists() and marker.read_text().strip():
                nss = marker.read_text().split()
                pids = subprocess.run(["ip", "netns", "pids", nss[1]], capture_output=True, text=True).stdout.split()
                if pids:
                    break
            time.sleep(0.05)
        assert len(nss) == 3 and pids, "the remote sleep never appeared in node2's namespace"
        assert all(ns in _netns() for ns in nss)
        p.send_signal(signal.SIGTERM)
        out, err = p.communicate(timeout=30)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 128 + signal.SIGTERM, err
    assert _gone(nss), _netns()
    time.sleep(0.2)
    alive = [pid for pid in pids if Path(f"/proc/{pid}").exists()
             and "Z" not in Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]]
    assert not alive, f"processes of node2 still alive: {alive}"


def test_multinode_clear_errors():
    r = _shaped("--nodes", "2", "--", "true")
    assert r.returncode == 2 and "--inter" in r.stderr
    r = _shaped("--nodes", "2", "--inter", "100mbit", "--rate", "1gbit", "--", "true")
    assert r.returncode == 2 and "--rate" in r.stderr
    r = _shaped("--nodes", "zero", "--inter", "100mbit", "--", "true")
    assert r.returncode == 2 and "--nodes" in r.stderr
    r = _shaped("--inter", "100mbit", "--", "true")
    assert r.returncode == 2 and "need --nodes" in r.stderr
    r = _shaped("--nodes", "2", "--inter", "100mbit", "--mtu", "9000", "--", "true")
    assert r.returncode == 2 and "--mtu" in r.stderr and "single-namespace" in r.stderr
    r = _shaped("--rate", "100mbit", "--mtu", "9k", "--", "true")
    assert r.returncode == 2 and "--mtu must be 1280..65536" in r.stderr
    r = _shaped("--rate", "100mbit", "--burst", "16kb", "--", "true")   # loopback's MTU: 64 KiB
    assert r.returncode == 2 and "smaller than the shaped device's MTU (65536 bytes)" in r.stderr, r.stderr
    r = _shaped("--rate", "100mbit", "--mtu", "9000", "--burst", "16kb", "--", "true")
    assert r.returncode == 0, r.stderr


@needs_testbed
def test_multinode_removed_after_setup_error():
    """tc refuses the rate half-way through the setup: what was made so far is removed."""
    p = subprocess.Popen([str(SHAPED), "--nodes", "2", "--inter", "fastest", "--name", "tbbad", "--", "true"],
                         env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 2 and "tc tbf rate fastest" in err, err
    mine = f"tbbad-{p.pid}-"
    assert mine not in _netns() and not any(d.name.startswith(mine) for d in Path("/etc/netns").glob("*"))


@needs_testbed
def test_multinode_probe_inter_shaped_intra_not():
    """Inter-node TCP (both directions, python sockets across namespaces) ~ the 100 Mbit/s shaped rate;
    inside a node (to the node's own address: loopback) >= 3x that; --intra RATE shapes the loopback."""
    probe = f"{sys.executable} {ROOT / 'benchmarks' / 'netprobe.py'}"
    cmd = f'''
{probe} --listen 5201 --mbytes 6 | sed 's/^/N2N1 /' &
ssh node2 {probe} --connect node1:5201 --mbytes 6 >/dev/null || exit 9; wait
ssh node2 {probe} --listen 5202 --mbytes 6 | sed 's/^/N1N2 /' &
{probe} --connect node2:5202 --mbytes 6 >/dev/null || exit 9; wait
{probe} --host node1 --mbytes 24 | sed 's/^/INTRA /'
'''

    def measure(*extra):
        r = _run_testbed(["--nodes", "2", "--inter", "100mbit", *extra, "--name", "tbtest", "--",
                          "timeout", "40", "bash", "-c", cmd], timeout=60)
        assert r.returncode == 0, r.stdout + r.stderr
        return {ln.split()[0]: json.loads(ln.split(None, 1)[1])["mbit_s"] for ln in r.stdout.splitlines()
                if ln[:4] in ("N2N1", "N1N2", "INTR")}

    got = measure()
    print("unshaped intra:", got)
    for way in ("N2N1", "N1N2"):
        assert 70 <= got[way] <= 130, f"inter-node {way} over 100 Mbit/s measured {got[way]:.1f} Mbit/s"
    assert got["INTRA"] >= 3 * max(got["N2N1"], got["N1N2"]), f"intra-node loopback limited: {got}"
    got = measure("--intra", "200mbit")
    print("intra 200mbit:", got)
    assert 140 <= got["INTRA"] <= 260, f"intra-node over --intra 200mbit measured {got['INTRA']:.1f} Mbit/s"


def _why_no_launcher(tool):
    if WHY_NOT:
        return WHY_NOT
    if shutil.which(tool, path=_env()["PATH"]) is None:
        return f"'{tool}' not on PATH (source scripts/env.sh after scripts/setup.sh)"
    try:
        import horovod.torch  # noqa: F401
    except Exception as e:  # pragma: no cover - depends on the build
        return f"horovod.torch not importable: {e}"
    return None


RANKS_WORKER = '''
import json, socket, horovod.torch as hvd, torch
hvd.init()
s = hvd.allreduce(torch.full((1000,), float(hvd.rank() + 1)), op=hvd.Sum)
print("RESULT " + json.dumps(dict(rank=hvd.rank(), local_rank=hvd.local_rank(), cross_rank=hvd.cross_rank(),
      size=hvd.size(), local_size=hvd.local_size(), cross_size=hvd.cross_size(), host=socket.gethostname(),
      sum=float(s[0]))), flush=True)
'''


def _check_ranks(stdout):
    # every rank's flat JSON object; the launcher may forward two ranks' lines joined on one
    res = sorted((json.loads(m) for m in re.findall(r"RESULT (\{[^{}]*\})", stdout)), key=lambda d: d["rank"])
    assert [(d["rank"], d["local_rank"], d["cross_rank"]) for d in res] == \
        [(0, 0, 0), (1, 1, 0), (2, 0, 1), (3, 1, 1)], stdout
    assert all((d["size"], d["local_size"], d["cross_size"], d["sum"]) == (4, 2, 2, 10.0) for d in res)
    if shutil.which("unshare") and shutil.which("hostname"):
        assert [d["host"] for d in res] == ["node1", "node1", "node2", "node2"], "ranks 2, 3 run on node2 via ssh"


@pytest.mark.skipif(_why_no_launcher("horovodrun") is not None, reason=_why_no_launcher("horovodrun") or "")
def test_multinode_horovodrun_gloo_2x2(tmp_path):
    """The real multi-host launch line: horovodrun -H $SHAPED_CLUSTER_HOSTS --gloo (ssh check, interface
    discovery through the ssh stand-in, then 2 nodes x 2 local ranks)."""
    worker = tmp_path / "ranks.py"
    worker.write_text(RANKS_WORKER)
    r = _run_testbed(["--nodes", "2", "--ranks-per-node", "2", "--inter", "100mbit", "--name", "tbtest", "--",
                      "bash", "-c", f"timeout 200 horovodrun -np $SHAPED_CLUSTER_NP -H $SHAPED_CLUSTER_HOSTS --gloo "
                      f"--disable-cache --start-timeout 150 {sys.executable} {worker}"], timeout=240)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    _check_ranks(r.stdout)


@pytest.mark.skipif(_why_no_launcher("mpirun") is not None, reason=_why_no_launcher("mpirun") or "")
def test_multinode_mpirun_2x2(tmp_path):
    """mpirun -H $SHAPED_CLUSTER_HOSTS: OpenMPI starts orted on node2 through OMPI_MCA_plm_rsh_agent=<ssh stand-in>."""
    worker = tmp_path / "ranks.py"
    worker.write_text(RANKS_WORKER)
    r = _run_testbed(["--nodes", "2", "--ranks-per-node", "2", "--inter", "100mbit", "--name", "tbtest", "--",
                      "bash", "-c", f"timeout 200 mpirun -np $SHAPED_CLUSTER_NP -H $SHAPED_CLUSTER_HOSTS "
                      f"{sys.executable} {worker}"], timeout=240)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    _check_ranks(r.stdout)
