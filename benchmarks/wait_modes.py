#!/usr/bin/env python
"""How hvd_ext's ranks wait, where ranks share cores: spin (Horovod's ``synchronize``) against
poll-and-sleep (``hvd_ext/exchange/waiting.py``), with plain Horovod in the same job.

    python benchmarks/wait_modes.py                     # 2 and 4 ranks unshaped, 2 nodes x 2 at 300mbit

Per world, one job builds every method twice, once with ``HVD_EXT_WAIT=spin`` and once with
``HVD_EXT_WAIT=sleep`` (the transport reads it when the optimizer is made), plus Horovod's own
optimizer, and runs them in turns (``--rounds`` rounds of ``--steps`` steps, as ``overhead.py``), so
this machine's drift hits them alike. Reported: median ms/step, and sleep / spin and method / plain
Horovod ratios. The model and batch are the main job's (MNIST-1D CNN, batch 64 per rank).

Writes benchmarks/results/wait_modes.{json,md}.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

METHODS = ("none", "powersgd:warmup=0", "qsgd:bits=8,exchange=twophase", "topk:ratio=0.01,exchange=twophase")
WAITS = ("spin", "sleep")


def worker(args) -> None:
    import horovod.torch as hvd
    import torch

    import common

    hvd.init()
    torch.set_num_threads(1)
    step = common.main_cnn_step(args.batch)

    def make(method, wait):
        os.environ["HVD_EXT_WAIT"] = wait  # read when the optimizer's transport is made
        # across nodes, the route the model picks from the start (no flat / node-aware trial)
        spec = method + ((":" if ":" not in method else ",") + "hierarchy_trial=0" if hvd.cross_size() > 1 else "")
        return common.main_cnn_run(method, args.channels, spec)

    runs = {("horovod", "spin"): make("horovod", "spin")}
    runs.update({(m, w): make(m, w) for m in METHODS for w in WAITS})
    for run in runs.values():
        for _ in range(args.warmup):
            step(run)
    times = common.time_in_turns(runs, step, args.rounds, args.steps,
                                 lambda name: hvd.allreduce(torch.zeros(1), name=f"wait_modes.{name}"))
    med = {k: hvd.allreduce(torch.tensor(statistics.median(v), dtype=torch.float64), op=hvd.Average,
                            name=f"wait_modes.t.{k}").item() for k, v in times.items()}
    if hvd.rank() == 0:
        rows = [{"method": m, "wait": w, "step_ms": t * 1e3} for (m, w), t in med.items()]
        Path(args.worker_out).write_text(json.dumps({"ranks": hvd.size(), "rows": rows}, indent=1))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes2x2", nargs="*", default=["300mbit"])
    import common

    common.add_world_options(ap, out="wait_modes", steps=8, rounds=3, ranks=[2, 4], rates=["unshaped"])
    args = ap.parse_args(argv)
    if args.worker:
        return worker(args)
    common.refuse_if_loaded(args)
    machine, load = common.machine_info(), common.loadavg()
    results = []

    def world(label, stem, launch):
        res = common.run_worker(__file__, "wait_modes_logs", stem, launch, common.worker_args(args), label)
        if res is not None:
            res.update(world=label, loadavg_end=common.loadavg())
            results.append(res)

    for n, rate, launch in common.flat_worlds(args.ranks, args.rates, args.shaper):
        world(f"{n} ranks, {rate}", f"np{n}_{rate}", launch)
    for rate in args.nodes2x2:
        world(f"2 nodes x 2, inter {rate}", f"2x2_{rate}", common.two_nodes_launcher(rate, shaper=args.shaper))
    common.save_results(args.out, common.results_doc("wait_modes.py", argv, machine, load, results), render)


def render(doc) -> str:
    lines = ["# Spin or sleep while waiting for a collective", "",
             f"`{doc['command']}`; load at start {doc['loadavg_start']} on this 2-core machine. One job per "
             "world, methods in turns; median ms/step (the ranks' mean). `auto` chooses `sleep` where a node "
             "runs more ranks than cores (4 ranks here); the 2 nodes x 2 testbed shares this machine's 2 "
             "cores, which its ranks cannot see, so `auto` spins there.", "",
             "| world | method | spin ms | sleep ms | sleep / spin | spin / Horovod | sleep / Horovod |",
             "|---|---|---|---|---|---|---|"]
    for res in doc["results"]:
        t = {(r["method"], r["wait"]): r["step_ms"] for r in res["rows"]}
        hv = t[("horovod", "spin")]
        lines.append(f"| {res['world']} | plain Horovod | {hv:.1f} | - | - | 1.00 | - |")
        for m in METHODS:
            a, b = t[(m, "spin")], t[(m, "sleep")]
            lines.append(f"| {res['world']} | `{m}` | {a:.1f} | {b:.1f} | {b / a:.2f} | {a / hv:.2f} | {b / hv:.2f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
