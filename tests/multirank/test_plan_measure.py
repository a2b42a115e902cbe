"""``python -m hvd_ext.plan --measure`` under a real launcher: the calibration file it writes, read
back by the planner's command line."""
import json
import subprocess
import sys

from conftest import ROOT, _env


def _horovodrun() -> str:
    """The project's horovodrun where the setup made one, else the one on the PATH."""
    venv = ROOT / ".venv" / "bin" / "horovodrun"
    return str(venv) if venv.exists() else "horovodrun"


def _model_file(path, layers: str, step: str):
    """A ``--model-file`` at ``path``: ``model()`` returns ``torch.nn.Sequential(layers)``, ``step(m)``
    runs ``step`` (one statement) on it."""
    path.write_text(f"import torch\n\ndef model():\n    return torch.nn.Sequential({layers})\n\n"
                    f"def step(m):\n    {step}\n")
    return path


def test_measure_writes_a_calibration_the_planner_reads(tmp_path):
    out = tmp_path / "calib.json"
    cmd = [_horovodrun(), "-np", "2", "--gloo", sys.executable, "-m", "hvd_ext.plan", "--measure",
           "--methods", "qsgd:bits=8", "--out", str(out)]
    # hvd_ext's ranks wait by sleeping (as on a node with more ranks than cores): every hvd_ext
    # collective goes through the sleeping wait, and Horovod's own allreduce is timed apart
    env = {**_env(), "HVD_EXT_WAIT": "sleep"}
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=str(ROOT))
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    cal = json.loads(out.read_text())
    assert cal["ranks"] == 2 and cal["nodes"] == 1 and cal["device"] == "cpu"
    assert cal["links"]["flat"]["bandwidth"] > 1e6 and cal["links"]["flat"]["lat"] > 0
    assert set(cal["links"]["flat"]["lat_by_kind"]) == {"allreduce", "allgather", "alltoall"}
    assert cal["links"]["horovod"]["bandwidth"] > 1e6 and set(cal["links"]["horovod"]["lat_by_kind"]) == {"allreduce"}
    assert cal["links"]["horovod_fp16"]["bandwidth"] > 1e5 and cal["links"]["horovod_fp16"]["lat"] > 0
    assert cal["codec"]["qsgd:bits=8"] > 1e6 and "fp16" in cal["codec"]  # auto's candidates too
    # each codec's flat routes: a bucket's host work beyond the codec's passes (per bucket, tensor,
    # element); the pipeline's own work per bucket is more than nothing
    assert set(cal["route_overhead_s"]["qsgd:bits=8"]) == {"allgather", "twophase"}
    assert set(cal["route_overhead_s"]["fp16"]) == {"allreduce"}
    assert all(len(v) == 3 for r in cal["route_overhead_s"].values() for v in r.values())
    assert any(v[0] > 0 for v in cal["route_overhead_s"]["qsgd:bits=8"].values())
    p = subprocess.run([sys.executable, "-m", "hvd_ext.plan", "--params", "2e6", "--compute-ms", "5",
                        "--calibration", str(out), "--methods", "qsgd:bits=8"],
                       capture_output=True, text=True, timeout=120, env=_env(), cwd=str(ROOT))
    assert p.returncode == 0, p.stderr
    bw = cal["links"]["intra"]["bandwidth"] * 8 / 1e9
    assert f"intra {bw:.3g} Gbit/s" in p.stdout and "| qsgd:bits=8 | twophase |" in p.stdout


def test_measure_with_a_model_file_times_its_step(tmp_path):
    """``--model-file``: the step's compute time and each collective's cost inside a step, which the
    planner then prices with (no --compute-ms needed)."""
    out = tmp_path / "calib.json"
    net = _model_file(tmp_path / "net.py", "torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10)",
                      "m(torch.randn(64, 256, device=next(m.parameters()).device)).square().mean().backward()")
    cmd = [_horovodrun(), "-np", "2", "--gloo", sys.executable, "-m", "hvd_ext.plan", "--measure", "--model-file",
           str(net), "--methods", "qsgd:bits=8", "--out", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=_env(), cwd=str(ROOT))
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    cal = json.loads(out.read_text())
    assert 0 < cal["compute_s"] < 1.0
    assert set(cal["links"]["flat"]["busy_lat_by_kind"]) == {"allreduce", "allgather", "alltoall"}
    p = subprocess.run([sys.executable, "-m", "hvd_ext.plan", "--model-file", str(net), "--calibration", str(out),
                        "--methods", "qsgd:bits=8"], capture_output=True, text=True, timeout=120, env=_env(),
                       cwd=str(ROOT))
    assert p.returncode == 0, p.stderr
    assert f"compute {cal['compute_s'] * 1e3:.1f} ms/step" in p.stdout


def test_measure_where_one_rank_alone_waits_by_sleeping(tmp_path):
    """A rank's wait mode is its own (``HVD_EXT_WAIT``, its cores): where rank 1 sleeps and rank 0
    spins, both ranks still time Horovod's own allreduce, inside the step too, and the job finishes
    (the ranks run the same collectives)."""
    out = tmp_path / "calib.json"
    net = _model_file(tmp_path / "net.py", "torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10)",
                      "m(torch.randn(16, 64)).square().mean().backward()")
    plan = f"{sys.executable} -m hvd_ext.plan --measure --model-file {net} --methods qsgd:bits=8 --out {out}"
    wait = 'if [ "$HOROVOD_RANK" = 1 ]; then export HVD_EXT_WAIT=sleep; else export HVD_EXT_WAIT=spin; fi'
    cmd = [_horovodrun(), "-np", "2", "--gloo", "sh", "-c", f"{wait}; exec {plan}"]
    env = {k: v for k, v in _env().items() if k != "HVD_EXT_WAIT"}
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env, cwd=str(ROOT))
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    horovod = json.loads(out.read_text())["links"]["horovod"]
    assert set(horovod["busy_lat_by_kind"]) == {"allreduce"} and horovod["busy_lat_by_kind"]["allreduce"] > 0


def test_horovod_fuses_the_buckets_allreduces(tmp_path):
    """The planner prices hvd_ext's buckets as Horovod runs them, fused when they are ready together
    (``hvd_ext.plan.model.fused_groups``): Horovod's timeline shows them fused."""
    from conftest import launch

    from helpers.checks import assert_checks

    results = launch("bucket_fusion.py", tmp_path / "timeline.json", np=2, timeout=180)
    assert_checks(results)
    assert 0 < results[0]["fused"] <= results[0]["tensors"]
