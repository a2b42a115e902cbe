#!/usr/bin/env python
"""Speed-proportional local steps (``adaptive:balance=1``) against ``none`` with a slow rank, over seeds.

    python benchmarks/balance.py                                  # both straggler workloads, seeds 0-2
    python benchmarks/balance.py --workloads mnist1d-slow --seeds 0 1 2 3 4

For each workload (hvd_ext/examples/workloads.py; rank 1 is 2x slower) and seed, every method runs
once through benchmarks/workload_train.py on 2 ranks, unshaped loopback, the methods of one seed back
to back so that this machine's drift hits them alike. Every method gets the same budget of samples
over the ranks; a balanced rank takes steps in proportion to its speed. Reported per seed: time to
the workload's target (rank 0's evaluations at its epoch ends) and its ratio to ``none`` of the same
seed, the final accuracy, and the fast rank's share of the steps. Compared: FedNova's normalised
average of the balanced ranks' models (``balance=1``, the default) and the plain one
(``normalise=0``), the unbalanced ``adaptive`` and ``local:period=8``.

Writes benchmarks/results/balance.{json,md}.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Dict, List, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402
from common import ROOT  # noqa: E402

METHODS = [  # (label, workload_train.py arguments)
    ("none", ["--compression", "none"]),
    ("local:period=8", ["--sync", "local:period=8"]),
    ("adaptive", ["--sync", "adaptive:min=1,max=32"]),
    ("adaptive:balance=1", ["--sync", "adaptive:min=1,max=32,balance=1"]),   # normalised (FedNova), the default
    ("adaptive:balance=1,normalise=0", ["--sync", "adaptive:min=1,max=32,balance=1,normalise=0"]),
]


def time_to_target(res: Dict) -> Optional[float]:
    return next((h["train_time_s"] for h in res["history"] if h["metric"] >= res["target"]), None)


def run_one(workload: str, seed: int, label: str, args: List[str], logs: Path, timeout: float) -> Dict:
    js = logs / f"{workload}__{common.slug(label)}__s{seed}.json"
    js.unlink(missing_ok=True)
    cmd = common.hvd_launcher(2, "gloo") + [common.PY, str(ROOT / "benchmarks" / "workload_train.py"),
                                            "--workload", workload, "--seed", str(seed), *args, "--json", str(js)]
    res = common.run_job(cmd, js.with_suffix(".log"), timeout)
    row = {"workload": workload, "seed": seed, "method": label, "load_before": common.loadavg()}
    if res["rc"] != 0 or not js.exists():
        return {**row, "status": "failed", "reason": res["tail"][-300:]}
    r = json.loads(js.read_text())
    steps = r["steps_per_rank"]
    return {**row, "status": "ok", "time_to_target_s": time_to_target(r), "final": r["final_metric"],
            "train_time_s": r["train_time_s"], "steps_per_rank": steps, "fast_share": steps[0] / sum(steps),
            "bytes_ratio_vs_dense": r["bytes_ratio_vs_dense"], "target": r["target"]}


def summarise(rows: List[Dict]) -> List[Dict]:
    """Per workload and method: the ratio to ``none`` of the same seed, and how often the target was reached."""
    out = []
    for wl in dict.fromkeys(r["workload"] for r in rows):
        base = {r["seed"]: r for r in rows if r["workload"] == wl and r["method"] == "none"}
        for label, _ in METHODS:
            mine = [r for r in rows if r["workload"] == wl and r["method"] == label and r["status"] == "ok"]
            ratios = [r["time_to_target_s"] / base[r["seed"]]["time_to_target_s"] for r in mine
                      if r["time_to_target_s"] and base.get(r["seed"], {}).get("time_to_target_s")]
            out.append({"workload": wl, "method": label, "runs": len(mine),
                        "reached": sum(r["time_to_target_s"] is not None for r in mine),
                        "ratio_median": statistics.median(ratios) if ratios else None,
                        "ratio_max": max(ratios) if ratios else None,
                        "final_min": min((r["final"] for r in mine), default=None),
                        "final_median": statistics.median([r["final"] for r in mine]) if mine else None})
    return out


def render(doc: Dict) -> str:
    m = doc["machine"]
    L = ["# Speed-proportional local steps with a 2x slower rank (`adaptive:balance=1`)", "",
         f"`{doc['command']}` · {m['date_utc']} · commit {m.get('git_commit')}{' (dirty)' if m.get('git_dirty') else ''}"
         f" · load {m['loadavg_start'][0]:.1f} at the start on {m['cpus']} cores (the job's own 2 ranks load it "
         "further while it runs)", "",
         "Same budget of samples for every method; time to target from rank 0's evaluations at its epoch ends. "
         "Ratio: time to target over `none`'s in the same seed (methods of a seed run back to back).", "",
         "| workload | method | reached | ratio to `none` (median, worst) | final (median, worst) |",
         "|---|---|---|---|---|"]
    for s in doc["summary"]:
        ratio = ("—" if s["ratio_median"] is None else f"{s['ratio_median']:.2f}×, {s['ratio_max']:.2f}×")
        final = ("—" if s["final_median"] is None else f"{100 * s['final_median']:.2f}%, {100 * s['final_min']:.2f}%")
        L.append(f"| `{s['workload']}` | `{s['method']}` | {s['reached']}/{s['runs']} | {ratio} | {final} |")
    L += ["", "Every run:", "", "| workload | seed | method | time to target | final | train time | fast rank's "
          "share of steps | bytes vs dense |", "|---|---|---|---|---|---|---|---|"]
    for r in doc["results"]:
        if r["status"] != "ok":
            L.append(f"| `{r['workload']}` | {r['seed']} | `{r['method']}` | failed | | | | |")
            continue
        t = "not reached" if r["time_to_target_s"] is None else f"{r['time_to_target_s']:.1f} s"
        L.append(f"| `{r['workload']}` | {r['seed']} | `{r['method']}` | {t} | {100 * r['final']:.2f}% | "
                 f"{r['train_time_s']:.1f} s | {r['fast_share']:.2f} | {r['bytes_ratio_vs_dense']:.3f} |")
    return "\n".join(L) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workloads", nargs="+", default=["mnist1d-slow", "mnist1d-noniid-slow"])
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per job")
    common.add_load_option(p)
    a = p.parse_args(argv)
    common.refuse_if_loaded(a)
    machine = common.machine_info()
    logs = common.RESULTS / "balance_logs"
    rows = []
    for wl in a.workloads:
        for seed in a.seeds:
            for label, args in METHODS:
                rows.append(run_one(wl, seed, label, args, logs, a.timeout))
                r = rows[-1]
                print(f"{wl:20s} seed {seed} {label:32s} " + (f"to target {r['time_to_target_s']}  final "
                      f"{r['final']:.4f}  fast share {r['fast_share']:.2f}" if r["status"] == "ok" else "FAILED"),
                      flush=True)
    doc = common.results_doc("balance.py", argv, machine, machine["loadavg_start"], rows)
    doc["title"] = "Speed-proportional local steps with a slow rank, over seeds (balance.py)"
    doc["summary"] = summarise(rows)
    common.save_results("balance", doc, render)
    return 0


if __name__ == "__main__":
    sys.exit(main())
