#!/usr/bin/env python
"""Where a rank's step goes on a CPU testbed: its wall clock against the CPU time of its training
thread and of its other threads (Horovod's background loop, Gloo's), per method, in one job.

    python benchmarks/cpu_share.py                        # 2 and 4 ranks unshaped, 2 ranks at 300mbit

Per world one job builds the step without exchange, plain Horovod and hvd_ext's methods, and runs
them in turns (``--rounds`` rounds of ``--steps`` steps, as ``overhead.py``). Per turn each rank
reads ``time.perf_counter`` (wall), ``time.process_time`` (all its threads) and
``time.thread_time`` (the training thread); reported: the ranks' mean of the median per step.

What it shows: where a node runs as many ranks as cores and waits spin, a rank is on a core for its
whole step (process CPU = wall), so the CPU its communication threads use adds to the step instead
of overlapping with backward; the planner (``hvd_ext/plan/model.py``) overlaps link time with
backward. Writes benchmarks/results/cpu_share.{json,md}.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

METHODS = ("compute", "horovod", "none", "powersgd:warmup=0", "qsgd:bits=8,exchange=twophase",
           "topk:ratio=0.01,exchange=twophase")


def timed_turns(runs, step, rounds: int, steps: int, sync) -> dict:
    """{method: [(wall, process cpu, thread cpu) seconds per step, one per round]}."""
    out = {k: [] for k in runs}
    for r in range(rounds):
        for k, run in runs.items():
            sync(f"cpu_share.{r}.{k}")
            w0, p0, t0 = time.perf_counter(), time.process_time(), time.thread_time()
            for _ in range(steps):
                step(run)
            out[k].append(((time.perf_counter() - w0) / steps, (time.process_time() - p0) / steps,
                           (time.thread_time() - t0) / steps))
    return out


def worker(args) -> None:
    import horovod.torch as hvd
    import torch

    import common

    hvd.init()
    torch.set_num_threads(1)
    step = common.main_cnn_step(args.batch)
    runs = {m: common.main_cnn_run(m, args.channels) for m in METHODS}
    for run in runs.values():
        for _ in range(args.warmup):
            step(run)
    turns = timed_turns(runs, step, args.rounds, args.steps,
                        lambda name: hvd.allreduce(torch.zeros(1), name=name))
    rows = []
    for m, t in turns.items():
        med = [statistics.median(v[i] for v in t) for i in range(3)]
        wall, proc, main = hvd.allreduce(torch.tensor(med, dtype=torch.float64), op=hvd.Average,
                                         name=f"cpu_share.t.{m}").tolist()
        rows.append({"method": m, "wall_ms": wall * 1e3, "process_cpu_ms": proc * 1e3, "main_thread_cpu_ms": main * 1e3})
    if hvd.rank() == 0:
        Path(args.worker_out).write_text(json.dumps({"ranks": hvd.size(), "rows": rows}, indent=1))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--also", nargs="*", default=["2:300mbit"], help="more worlds, RANKS:RATE")
    import common

    common.add_world_options(ap, out="cpu_share", steps=16, rounds=4, ranks=[2, 4], rates=["unshaped"])
    args = ap.parse_args(argv)
    if args.worker:
        return worker(args)
    common.refuse_if_loaded(args)
    machine, load = common.machine_info(), common.loadavg()
    worlds = list(common.flat_worlds(args.ranks, args.rates, args.shaper))
    for extra in args.also:
        n, rate = extra.split(":")
        worlds += list(common.flat_worlds([int(n)], [rate], args.shaper))
    results = []
    for n, rate, launch in worlds:
        res = common.run_worker(__file__, "cpu_share_logs", f"np{n}_{rate}", launch, common.worker_args(args),
                                f"{n} ranks, {rate}")
        if res is not None:
            res.update(rate=rate, loadavg_end=common.loadavg())
            results.append(res)
    common.save_results(args.out, common.results_doc("cpu_share.py", argv, machine, load, results), render)


def render(doc) -> str:
    lines = ["# Where a rank's step goes: wall clock against CPU time", "",
             f"`{doc['command']}`; load at start {doc['loadavg_start']} on this 2-core machine. One job per "
             "world, methods in turns; the ranks' mean of the median per step. Other threads: Horovod's "
             "background loop and Gloo's (process CPU minus the training thread's).", "",
             "| world | method | wall ms | process CPU ms | training thread ms | other threads ms | CPU / wall |",
             "|---|---|---|---|---|---|---|"]
    for res in doc["results"]:
        for r in res["rows"]:
            other = r["process_cpu_ms"] - r["main_thread_cpu_ms"]
            lines.append(f"| {res['ranks']} ranks, {res['rate']} | `{r['method']}` | {r['wall_ms']:.1f} | "
                         f"{r['process_cpu_ms']:.1f} | {r['main_thread_cpu_ms']:.1f} | {other:.1f} | "
                         f"{r['process_cpu_ms'] / r['wall_ms']:.2f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
