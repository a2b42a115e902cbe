"""The README's main command (scripts/main.sh), shortened to one epoch: both runs, the summary."""
from __future__ import annotations

import json
import os
import subprocess

import pytest

from conftest import ROOT


def test_main_sh_one_epoch_prints_summary():
    env = dict(os.environ, EPOCHS="1")
    try:
        p = subprocess.run(["bash", str(ROOT / "scripts" / "main.sh"), "--no-progress"], capture_output=True,
                           text=True, timeout=600, env=env, cwd=str(ROOT), start_new_session=True)
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        pytest.fail(f"scripts/main.sh hung for 600 s\n{out[-4000:]}")
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-4000:]
    assert "== network:" in out and "main job summary" in out and "hvd_ext / Horovod" in out
    if os.geteuid() == 0 and subprocess.run(["which", "tc"], capture_output=True).returncode == 0:
        assert "shaped to 300mbit" in out
    else:
        assert "unshaped" in out
    plain = json.loads((ROOT / "runs" / "main" / "plain.json").read_text())
    ext = json.loads((ROOT / "runs" / "main" / "hvd_ext.json").read_text())
    assert plain["compression"].startswith("horovod:") and ext["compression"] == "auto"
    assert ext["auto"] and len(ext["auto"]["choice"]) == len(ext["routes"]) >= 1
    assert 0.1 < ext["test_acc"] <= 1.0 and 0.1 < plain["test_acc"] <= 1.0
    # auto never sends more than dense fp32 (it can always choose none)
    assert ext["bytes_sent_per_step"] <= 1.05 * plain["bytes_sent_per_step"]
