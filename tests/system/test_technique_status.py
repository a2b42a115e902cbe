"""docs/techniques.md's status table is made from the workload results (benchmarks/technique_status.py)."""
from __future__ import annotations

import json
import sys

from conftest import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))

import technique_status as ts  # noqa: E402


def _row(method, t, final=0.95, status="ok", bytes_=0.5):
    return {"method": method, "status": status, "time_to_target_s": t, "final": final,
            "bytes_ratio_vs_dense": bytes_}


def _doc(rows, load=1.0):
    return {"workload": "mnist1d-slow", "workload_info": {"metric": "acc", "target": 0.93},
            "machine": {"loadavg_start": [load, load, load], "cpus": 2, "git_commit": "abc1234"},
            "date": "2026-12-05", "rows": rows}


def test_verdicts_against_the_fastest_baseline():
    doc = _doc([_row("horovod", 10.0), _row("none", 8.0), _row("local:period=8", 12.0),
                _row("event", 6.0), _row("adaptive:min=1,max=32", 8.5), _row("qdist:bits=3", 9.0),
                _row("sig:ratio=0.01", None, final=0.9), _row("event:staleness=none", 5.0)])
    c = ts.cells_for(doc)
    assert c[1].startswith("**win** 0.75×") and "`none` 8.0 s" in c[1]  # the fastest baseline is none
    assert c[6].startswith("**tie**")           # 8.5 / 8.0 within 10%
    assert c[5].startswith("**loss** 1.12×")    # 9.0 / 8.0
    assert c[3].startswith("**loss**: target not reached") and "90.00%" in c[3]
    assert c[2].startswith("**loss**") and "`event:staleness=none`" in c[2]  # judged against its ablation
    assert c[4] == "not run"


def test_a_technique_alone_at_the_target_wins_and_a_missing_ablation_is_said():
    c = ts.cells_for(_doc([_row("none", None, final=0.8), _row("event", 7.0)]))
    assert c[1].startswith("**win**: 7.0 s, only it reaches the target")
    assert c[2] == "no ablation run"


def test_update_rewrites_only_between_the_markers(tmp_path):
    (tmp_path / "workload_mnist1d-slow.json").write_text(json.dumps(_doc([_row("none", 8.0), _row("event", 6.0)],
                                                                          load=9.0)))
    doc = tmp_path / "techniques.md"
    doc.write_text(f"before\n{ts.BEGIN}\nstale table\n{ts.END}\nafter\n")
    assert ts.update(tmp_path, doc)
    text = doc.read_text()
    assert text.startswith("before\n") and text.endswith(f"{ts.END}\nafter\n") and "stale table" not in text
    assert "**win** 0.75×" in text and "loaded machine, load 9.0 on 2 cores" in text
    assert "IID: not run" in text  # a workload without a results file is said, not left blank
    rows = [l for l in text.splitlines() if l.startswith("| ") and l[2].isdigit()]
    assert len(rows) == len(ts.TECHNIQUES)
    assert all(l.count(" | ") == rows[0].count(" | ") for l in rows)  # no stray pipe splits a cell


def test_without_markers_nothing_is_written(tmp_path):
    doc = tmp_path / "techniques.md"
    doc.write_text("no markers\n")
    assert not ts.update(tmp_path, doc)
    assert doc.read_text() == "no markers\n"


def test_the_project_doc_has_the_markers():
    text = ts.DOC.read_text()
    assert ts.BEGIN in text and ts.END in text
