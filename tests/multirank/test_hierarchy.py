"""Node-aware exchange on real Horovod ranks spread over two network namespaces
(scripts/shaped-cluster, horovodrun --gloo -H node1:2,node2:2); skipped without root and iproute2."""
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from conftest import ROOT, WORKERS, read_results
from helpers.checks import assert_checks


# ---- real Horovod ranks on two nodes (network namespaces) ------------------------------------------
def _why_no_testbed():
    if os.geteuid() != 0:
        return "not root: the multi-node testbed needs network namespaces (CAP_NET_ADMIN)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"'{tool}' (iproute2) not installed: no multi-node testbed"
    if shutil.which("horovodrun", path=str(Path(sys.executable).parent) + os.pathsep + os.environ.get("PATH", "")) \
            is None:
        return "horovodrun not on PATH (source scripts/env.sh)"
    return None


WHY_NOT = _why_no_testbed()


def _testbed(mode, timeout=280):
    env = dict(os.environ)
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("OMP_NUM_THREADS", "1")
    worker = WORKERS / "hierarchy_exchange.py"
    cmd = [str(ROOT / "scripts" / "shaped-cluster"), "--nodes", "2", "--ranks-per-node", "2", "--inter", "300mbit",
           "--name", "hiertest", "--", "bash", "-c",
           f"timeout {timeout - 40} horovodrun -np $SHAPED_CLUSTER_NP -H $SHAPED_CLUSTER_HOSTS --gloo "
           f"--disable-cache --start-timeout 120 {sys.executable} {worker} {mode}"]
    with tempfile.TemporaryDirectory(prefix="hvdx-results-") as results_dir:
        env["HVDX_TEST_RESULTS_DIR"] = results_dir  # workers/common.emit writes each RESULT there
        p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.send_signal(signal.SIGTERM)  # shaped-cluster removes its namespaces
            out, err = p.communicate(timeout=30)
            pytest.fail(f"testbed run timed out after {timeout}s\n{out[-3000:]}\n{err[-3000:]}")
        assert p.returncode == 0, out[-4000:] + err[-4000:]
        res = read_results(results_dir)
    res.sort(key=lambda r: r["rank"])
    assert len(res) == 4, out[-4000:]
    return res


SPECS_2x2 = ["none", "qsgd:bits=8", "topk:ratio=0.02", "qsgd:bits=8,route=twophase",
             "topk:ratio=0.02,route=twophase"]


@pytest.mark.skipif(WHY_NOT is not None, reason=WHY_NOT or "")
def test_testbed_2x2_node_aware_equals_simulated():
    """horovodrun --gloo -H node1:2,node2:2, plain hvd.init(): node-aware routes (node groups over the
    global alltoall), bit for bit the simulated 2 x 2 world's results, every rank the same parameters,
    the codec's error as flat, fewer bytes across nodes than inside them (checked on each rank)."""
    res = _testbed("alltoall")
    assert_checks(res)
    assert [(r["local_rank"], r["cross_rank"]) for r in res] == [(0, 0), (1, 0), (0, 1), (1, 1)]
    for r in res:  # every spec ran, with its named checks
        for spec in SPECS_2x2:
            assert spec in r and any(n.startswith(spec + ":") for n in r["checks"]), spec


@pytest.mark.skipif(WHY_NOT is not None, reason=WHY_NOT or "")
def test_testbed_2x2_measured_links_choose_the_route():
    """The node links are measured once per job (two optimizers, one probe), the same on every rank:
    the inter-node link near the shaped 300 Mbit/s (37.5 MB/s through a node's NIC); each optimizer's
    route is the cost model's pick with those links, and the simulated replay with the same links
    takes the same route and gives the same bits (checked on each rank). The intra-node link is only
    checked to be a positive, finite fit: with 4 ranks on 2 cores it is CPU-bound and measured 32-133
    MB/s, once below the inter-node link (a fresh-clone CI run: 32 against 46 MB/s)."""
    res = _testbed("links")
    assert_checks(res)
    links = [r[spec]["node_links"] for r in res for spec in ("qsgd:bits=8", "topk:ratio=0.01")]
    print("measured node links:", links[0])
    assert all({k: x[k] for k in ("intra", "inter")} == {k: links[0][k] for k in ("intra", "inter")}
               for x in links), links
    # the shaping is this test's (--inter 300mbit): checked here, on rank 0's links (the same on every rank).
    # The shaper's 256 KB bucket lets a probe's first 256 KB through at once, so the probe can read above the
    # rate (57.3 MB/s once); the unshaped link read 552 MB/s
    assert 0.4 * 37.5 <= links[0]["inter"]["MB_per_s"] <= 2.0 * 37.5, links[0]
    for r in res:  # both optimizers and the links were checked on every rank
        for sec in ("links: ", "qsgd:bits=8: ", "topk:ratio=0.01: "):
            assert any(n.startswith(sec) for n in r["checks"]), sec
    # hierarchy=auto measured (hvd_ext.route_trial), where the measured links leave the model unsure:
    # the trial decides on real Horovod ranks, every rank the same numbers, choice and routes
    trials = [r["trial"] for r in res]
    print("hierarchy trial:", trials[0]["report"])
    if trials[0]["planned"]:
        rep = trials[0]["report"]
        for r, t in zip(res, trials):
            assert t["report"] == rep
            assert [n for n in r["checks"] if n.startswith("trial:")], "the trial's checks did not run"
    else:  # the model was sure (predictions more than 3x apart): no trial on any rank
        assert not any(t["planned"] for t in trials)


@pytest.mark.skipif(WHY_NOT is not None, reason=WHY_NOT or "")
def test_testbed_2x2_declared_process_sets():
    """HVD_EXT_NODE_GROUPS=process_sets with hvd.init(process_sets=hvd_ext.exchange.node_process_sets()):
    the declared process sets carry the node groups, same results (checked on each rank)."""
    res = _testbed("declared")
    assert_checks(res)
    for r in res:
        assert any(n.startswith("qsgd:bits=8: routes are ['node:allgather']") for n in r["checks"])
