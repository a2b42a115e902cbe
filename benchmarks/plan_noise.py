#!/usr/bin/env python
"""How far the testbed moves a measured step from run to run: the floor under the planner's check.

    python benchmarks/plan_noise.py                      # every saved plan_check run of the 65 rows
    python benchmarks/plan_noise.py --last 5             # the bias table over the 5 newest runs

``plan_check.py`` scores one run: predicted / measured step within its target (``WITHIN``) for each
row (a world and a method). A run's measured steps also move on their own, with the machine. This
script reads the saved runs (``benchmarks/results/plan_check[_n8][_<commit>].json``: a run is its
2- and 4-rank file and its 8-rank file, on the line shaper, with the same rows as the newest) and
reports, with no new measurement:

1. per row, its measured step over the runs (least, median, most) -- Horovod's rows run no hvd_ext
   code, so their spread is the testbed's alone;
2. per run, the rows within +-25% for the planner, and for an **oracle** that predicts every row at
   its median over all the runs (in-sample, so it flatters the oracle): the most any fixed
   prediction could reach in that run;
3. per row, the planner's predicted / measured over the newest ``--last`` runs and its median: a
   row whose median is off by more than the target is a bias of the model, not noise.

Writes benchmarks/results/plan_noise.{json,md}.
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path
from typing import Dict, List, Tuple

import common
from plan_check import WITHIN
Row = Tuple[int, str, str]  # (ranks, link, method)
RUN_FILE = re.compile(r"^plan_check(_n8)?(?:_([0-9a-f]{7,40}))?$")  # a run's files, renamed after its commit


def within(q: float) -> bool:
    return WITHIN[0] <= q <= WITHIN[1]


def load_runs(paths: List[Path]) -> List[dict]:
    """The complete runs among ``paths``, newest first: per run (named by its files' commit suffix,
    none for the latest), its rows ``{(ranks, link, method): (measured ms, predicted / measured)}``
    from its files on the line shaper. Runs without the newest's rows, or timed at the same moment
    as another (a copy), are left out, each said on stderr."""
    by_run: Dict[str, dict] = {}
    for path in paths:
        m = RUN_FILE.match(path.stem)
        if path.suffix != ".json" or m is None:
            raise SystemExit(f"plan_noise: {path} is not a saved plan_check run; accepted: "
                             "plan_check[_n8][_<commit>].json")
        doc = json.loads(path.read_text())
        if any(r.get("shaper") != "line" for r in doc.get("results", [{}])):
            print(f"plan_noise: left out {path.name}: not on the line shaper", file=sys.stderr)
            continue
        machine = doc.get("machine", {})
        run = by_run.setdefault(m.group(2) or "latest", {"commit": m.group(2) or "latest", "dates": set(),
                                                         "files": [], "rows": {}})
        run["dates"].add(machine.get("date_utc", ""))
        run["files"].append(f"{path.name} ({machine.get('git_commit', '?')})")
        for res in doc["results"]:
            for row in res["rows"]:
                run["rows"][(res["ranks"], res["rate"], row["method"])] = (row["measured_step_ms"], row["step_ratio"])
    runs = sorted(by_run.values(), key=lambda r: max(r["dates"]), reverse=True)
    kept: List[dict] = []
    for run in runs:
        why = ("not the newest complete run's rows" if kept and set(run["rows"]) != set(kept[0]["rows"])
               else "the same files as a run kept" if any(run["dates"] & k["dates"] for k in kept)
               else "")
        if not kept and len(run["files"]) < 2:
            why = "a 2/4-rank or an 8-rank file missing"
        if why:
            print(f"plan_noise: left out run {run['commit']} ({', '.join(run['files'])}): {why}", file=sys.stderr)
        else:
            kept.append(run)
    return kept


def analyse(runs: List[dict], last: int) -> dict:
    """The three reports of the module doc over ``runs`` (newest first)."""
    keys = sorted(runs[0]["rows"], key=lambda k: (k[0], str(k[1]), k[2]))
    median = {k: statistics.median(r["rows"][k][0] for r in runs) for k in keys}
    per_run = [{"commit": r["commit"], "files": r["files"],
                "planner_within": sum(within(r["rows"][k][1]) for k in keys),
                "oracle_within": sum(within(median[k] / r["rows"][k][0]) for k in keys),
                "oracle_within_horovod": sum(within(median[k] / r["rows"][k][0]) for k in keys
                                             if k[2].startswith("horovod"))} for r in runs]
    horovod_rows = sum(k[2].startswith("horovod") for k in keys)
    recent = runs[:last]
    per_row = []
    for k in keys:
        steps = [r["rows"][k][0] for r in runs]
        ratios = [r["rows"][k][1] for r in recent]
        per_row.append({"ranks": k[0], "link": k[1], "method": k[2], "least_ms": min(steps),
                        "median_ms": median[k], "most_ms": max(steps),
                        "oracle_within": sum(within(median[k] / s) for s in steps),
                        "ratios": ratios, "median_ratio": statistics.median(ratios)})
    return {"rows": len(keys), "horovod_rows": horovod_rows, "runs": per_run, "per_row": per_row,
            "last": len(recent)}


def render(doc) -> str:
    res = doc["results"][0]
    n, runs = res["rows"], res["runs"]
    lines = ["# How far the testbed moves the planner's check", "",
             f"`{doc['command']}`: no new measurement; {len(runs)} saved `plan_check.py` runs of {n} rows each "
             "(module doc of `benchmarks/plan_noise.py`).", "",
             "Per run: rows within +-25% for the planner, and for an oracle that predicts every row at its "
             "median measured step over all these runs (in-sample).", "",
             f"| run | files (commit) | planner | oracle | oracle, Horovod's {res['horovod_rows']} rows |",
             "|---|---|---|---|---|"]
    for r in runs:
        lines.append(f"| {r['commit']} | {', '.join(r['files'])} | {r['planner_within']} | {r['oracle_within']} | "
                     f"{r['oracle_within_horovod']} |")
    every = sum(r["oracle_within"] == n for r in runs)
    lines += ["", f"The oracle has all {n} rows within in {every} of {len(runs)} runs; the planner in "
              f"{sum(r['planner_within'] == n for r in runs)}.", "",
              f"Per row: measured ms/step over the {len(runs)} runs, the runs within 25% of its median, and "
              f"the planner's predicted / measured in the newest {res['last']} (newest first) with their median "
              "(`<<` where the median is off by more than 25%).", "",
              "| ranks | link | method | least | median | most | most / least | runs within 25% of the median "
              "| planner | median |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in res["per_row"]:
        flag = "" if within(r["median_ratio"]) else " <<"
        lines.append(f"| {r['ranks']} | {r['link']} | `{r['method']}` | {r['least_ms']:.1f} | {r['median_ms']:.1f} "
                     f"| {r['most_ms']:.1f} | {r['most_ms'] / r['least_ms']:.2f} | {r['oracle_within']} of "
                     f"{len(runs)} | {' '.join(f'{q:.2f}' for q in r['ratios'])} | {r['median_ratio']:.2f}{flag} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("files", nargs="*", type=Path, help="saved plan_check runs (default: all in benchmarks/results)")
    ap.add_argument("--last", type=int, default=5, help="runs in the per-row bias table (newest first)")
    ap.add_argument("--out", default="plan_noise")
    args = ap.parse_args(argv)
    if args.last < 1:
        raise SystemExit(f"--last must be 1 or more, got {args.last}")
    runs = load_runs(args.files or [p for p in sorted(common.RESULTS.glob("plan_check*.json"))
                                    if RUN_FILE.match(p.stem)])
    if len(runs) < 2:
        raise SystemExit("plan_noise: needs two or more complete plan_check runs (a commit's 2/4-rank and "
                         f"8-rank files, line shaper); found {len(runs)}")
    doc = common.results_doc("plan_noise.py", argv if argv is not None else sys.argv[1:], common.machine_info(),
                             None, [analyse(runs, args.last)])
    common.save_results(args.out, doc, render)


if __name__ == "__main__":
    main()
