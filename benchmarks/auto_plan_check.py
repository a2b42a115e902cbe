#!/usr/bin/env python
"""``compression="auto"`` in a real job against the planner's prediction of it, from one calibration.

    python benchmarks/auto_plan_check.py --ranks 2 4 --rates 100mbit 1gbit unshaped --nodes2x2 300mbit

For each world (as ``plan_check.py``: one ``horovodrun --gloo`` job in a shaped namespace; ``--nodes2x2
RATE``: 2 nodes x 2 ranks, the links between the nodes at RATE):

1. ``hvd_ext.plan.calibration.measure`` calibrates the job (the links, each collective's cost right
   after a step, the codec speeds of auto's candidates and of ``FIXED``, the main job's CNN step) and rank 0 writes
   the file that ``HVD_EXT_CALIBRATION`` then names on every rank;
2. a job with ``compression="auto:accuracy=relaxed,trial=0"`` runs to its first decision: its pick
   per bucket, codec and route. ``relaxed``: the accuracy guard is off, as the planner assumes it
   admits every candidate; ``trial=0``: the model's choice, not a measured trial's;
3. ``hvd_ext.plan.plan``, fed the same file, predicts that pick per bucket (``Plan.row("auto").picks``);
   and for each fixed codec of ``FIXED``, a job past its dense warm-up gives each bucket's route,
   against the route of the planner's fastest row for that bucket;
4. ``auto`` (its decision kept), Horovod fp32 and fp16 take ``--rounds`` turns of ``--steps`` steps,
   each step time against the planner's row.

By design the two differ in one input: ``auto`` times its candidates' codecs on the job's own
buckets and reads their payload bytes, where the planner takes the file's codec speeds and its byte
model. Writes benchmarks/results/auto_plan_check.{json,md}.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

AUTO = "auto:accuracy=relaxed,trial=0"
# fixed codecs of the planner's validation, their routes the model's (no flat/node-aware trial)
FIXED = ("qsgd:bits=8,hierarchy_trial=0", "topk:ratio=0.01,hierarchy_trial=0")
ROWS = {"horovod": "horovod", "horovod fp16": "horovod fp16", AUTO: "auto"}  # job -> the planner's row


def worker(args) -> None:
    import horovod.torch as hvd
    import torch

    import common
    from hvd_ext.exchange import calibration
    from hvd_ext.plan import plan
    from hvd_ext.plan.calibration import measure

    hvd.init()
    torch.set_num_threads(1)
    step = common.main_cnn_step(args.batch)
    floor = common.main_cnn_run("compute", args.channels)
    for _ in range(3):
        step(floor)
    cal = measure(FIXED, step=lambda: step(floor), steps=args.steps)
    path = Path(tempfile.gettempdir()) / f"auto_plan_check.{os.getpid()}.json"  # per rank: ranks may be hosts
    path.write_text(json.dumps(cal))
    os.environ[calibration.ENV] = str(path)
    runs = {m: common.main_cnn_run(m, args.channels) for m in ROWS}
    for run in runs.values():
        hvd.broadcast_parameters(run[0].state_dict(), root_rank=0)
    stats = runs[AUTO][1].stats.extra

    def picks() -> list:  # auto's codec and route per bucket (its report, the optimizer's stats)
        return [f"{spec} ({route})" for spec, route in zip(stats["auto"]["choice"], stats["routes"])]

    step(runs[AUTO])
    while not stats["auto"]["decisions"]:  # to the first decision (its warm-up)
        step(runs[AUTO])
    picked, decision = picks(), stats["auto"]["last"]
    model = runs["horovod"][0]
    p = plan(model, compute_s=cal["compute_s"], cluster=None, nodes=cal["nodes"], gpus_per_node=cal["local"],
             device="cpu", methods=[], calibration=cal, breakeven_search=False)
    fixed = {spec: fixed_routes(spec, args, step, cal) for spec in FIXED}
    for run in runs.values():
        for _ in range(args.warmup):
            step(run)
    times = common.time_in_turns(runs, step, args.rounds, args.steps,
                                 lambda name: hvd.allreduce(torch.zeros(1), name=f"auto_plan_check.{name}"))
    rows = []
    for m, label in ROWS.items():
        t = hvd.allreduce(torch.tensor(statistics.median(times[m]), dtype=torch.float64), op=hvd.Average,
                          name=f"auto_plan_check.t.{m}").item()
        predicted = p.row(label).step_s
        rows.append({"method": m, "measured_step_ms": t * 1e3, "predicted_step_ms": predicted * 1e3,
                     "step_ratio": predicted / t})
    path.unlink(missing_ok=True)
    if hvd.rank() == 0:
        Path(args.worker_out).write_text(json.dumps({
            "ranks": hvd.size(), "calibration": cal, "rows": rows, "auto_picked": picked,
            "plan_picked": p.row("auto").picks, "auto_decision": decision, "auto_picked_at_end": picks(),
            "fixed": fixed}, indent=1, default=str))


def fixed_routes(spec: str, args, step, cal: dict) -> dict:
    """A job with the fixed codec ``spec`` past its dense warm-up: its route per bucket, and per bucket
    the route of the planner's fastest row for ``spec`` from the same file."""
    import common
    from hvd_ext.plan import plan

    run = common.main_cnn_run(spec, args.channels)
    pipe = run[1]._pipeline
    while pipe.step <= pipe.warmup:
        step(run)
    p = plan(run[0], compute_s=cal["compute_s"], cluster=None, nodes=cal["nodes"], gpus_per_node=cal["local"],
             device="cpu", methods=[spec], calibration=cal, breakeven_search=False)
    rows = [r for r in p.rows if r.spec == spec]
    planned = [min(rows, key=lambda r: r.buckets[b].seconds).route for b in range(len(rows[0].buckets))]
    return {"job": list(pipe.routes), "plan": planned}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes2x2", nargs="*", default=[], help="also 2 nodes x 2 ranks at these inter-node rates")
    import common

    common.add_world_options(ap, out="auto_plan_check", steps=10, rounds=3, ranks=[2, 4],
                             rates=["100mbit", "1gbit", "unshaped"], shaper="line")
    args = ap.parse_args(argv)
    if args.worker:
        return worker(args)
    common.refuse_if_loaded(args)
    machine = common.machine_info()
    load = common.loadavg()
    results = common.run_worlds(__file__, "auto_plan_check_logs", args, lambda res: (
        f"auto picked {res['auto_picked']}, the planner {res['plan_picked']} "
        f"({sum(a == b for a, b in zip(res['auto_picked'], res['plan_picked']))} of {len(res['plan_picked'])} "
        "buckets alike); fixed codecs' routes: " + "; ".join(
            f"{spec}: {f['job']} against {f['plan']}" for spec, f in res["fixed"].items())))
    common.save_results(args.out, common.results_doc("auto_plan_check.py", argv, machine, load, results), render)


def render(doc) -> str:
    lines = ["# `auto` in the job against the planner's prediction of it", "",
             f"`{doc['command']}`; load at start {doc['loadavg_start']}. The main job's CNN (MNIST-1D, batch "
             f"64 per rank); `{AUTO}` with `HVD_EXT_CALIBRATION` naming the calibration the same job "
             "measured, and `hvd_ext.plan` fed that file (see the module doc).", "",
             "| ranks | link | bucket | auto picked | the planner predicted | alike |", "|---|---|---|---|---|---|"]
    alike = total = 0
    for res in doc["results"]:
        for i, (a, b) in enumerate(zip(res["auto_picked"], res["plan_picked"])):
            alike, total = alike + (a == b), total + 1
            lines.append(f"| {res['ranks']} | {res['rate']} | {i} | `{a}` | `{b}` | {'yes' if a == b else 'no'} |")
    kept = sum(res.get("auto_picked_at_end") == res["auto_picked"] for res in doc["results"])
    lines += ["", f"Alike on {alike} of {total} buckets.", ""] + fixed_table(doc) + [
              "",
              f"Step time, auto and Horovod, measured in turns (auto's pick at the end of the turns was its first "
              f"decision's in {kept} of {len(doc['results'])} worlds); predicted: the planner's rows, `auto`'s "
              "with the planner's picks:", "",
              "| ranks | link | method | measured ms/step | predicted | pred/meas |", "|---|---|---|---|---|---|"]
    for res in doc["results"]:
        for row in res["rows"]:
            lines.append(f"| {res['ranks']} | {res['rate']} | `{row['method']}` | {row['measured_step_ms']:.2f} | "
                         f"{row['predicted_step_ms']:.2f} | {row['step_ratio']:.2f} |")
    return "\n".join(lines) + "\n"


def fixed_table(doc) -> list:
    """The fixed codecs' routes in the job against the planner's fastest row per bucket."""
    lines = ["A fixed codec (`hierarchy_trial=0`: the model's routes) with the same file: its route per bucket in "
             "the job, past the dense warm-up, and the route of the planner's fastest row for that bucket.", "",
             "| ranks | link | codec | job's routes | planner's fastest | alike |", "|---|---|---|---|---|---|"]
    alike = total = 0
    for res in doc["results"]:
        for spec, f in res.get("fixed", {}).items():
            same = sum(a == b for a, b in zip(f["job"], f["plan"]))
            alike, total = alike + same, total + len(f["plan"])
            lines.append(f"| {res['ranks']} | {res['rate']} | `{spec}` | {', '.join(f['job'])} | "
                         f"{', '.join(f['plan'])} | {same} of {len(f['plan'])} |")
    return lines + ["", f"Alike on {alike} of {total} buckets."] if total else []


if __name__ == "__main__":
    main()
