"""scripts/gpu-check's own logic, on the emulated GPU (``--dry-run``): every step runs and reports."""
from __future__ import annotations

import json
import subprocess
import sys

from conftest import ROOT


def test_gpu_check_dry_run(tmp_path):
    cmd = [sys.executable, str(ROOT / "scripts" / "gpu-check"), "--dry-run", "--out", str(tmp_path),
           "--codecs", "none;topk:ratio=0.01,mode=sampled;qsgd:bits=8"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=str(ROOT))
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    rep = json.loads((tmp_path / "gpu_check.json").read_text())
    assert rep["dry_run"] and set(rep["steps"]) == {"kernels", "syncs", "kernel_speed", "step_speed"}
    assert all(v.startswith("ran") for v in rep["steps"].values()), rep["steps"]
    syncs = rep["syncs"]
    assert {r["spec"] for r in syncs} == {"none", "topk:ratio=0.01,mode=sampled", "qsgd:bits=8"}
    assert all(r["ok"] for r in syncs), [r for r in syncs if not r.get("ok")]
    assert {r["route"] for r in syncs} >= {"allreduce", "allgather", "sparse_rs", "twophase", "node:sparse_rs"}
    sizes = rep["kernel_speed"]["sizes"]
    assert [s["size"] for s in sizes] == ["1K", "16K", "64K"]
    ops = {r["op"].split()[0] for s in sizes for r in s["rows"]}
    assert ops >= {"select", "quantize_pack", "unpack_dequant_acc", "pack_bits", "unpack_bits", "sign_pack",
                   "majority_vote", "sparse_scatter_add", "residual_update", "ewma_update"}
    assert all(r["ms_per_step"] > 0 for r in rep["step_speed"])
    assert "syncs/step" in proc.stdout and "of copy" in proc.stdout
