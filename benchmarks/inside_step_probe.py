#!/usr/bin/env python
"""How a collective's cost right after a training step spreads, where ranks share cores: every try of
the calibration's in-step probe (``hvd_ext.plan.calibration._measure_busy_latency``'s loop), for
hvd_ext's allreduce and Horovod's own, in ``--runs`` runs of ``--tries`` in one job.

    python benchmarks/inside_step_probe.py [--ranks 4] [--runs 4] [--tries 10] [--out NAME]
                                           [--rate 1gbit] [--after-calibration]

One ``horovodrun --gloo`` job of ``--ranks`` ranks in a namespace on this machine's cores, unshaped
or its loopback at ``--rate`` on the line shaper (``common.SHAPERS``); with ``--after-calibration``
the job first calibrates itself as ``plan_check.py``'s does (``hvd_ext.plan.calibration.measure``).
Each try: the main job's CNN step without exchange on every rank, then one small allreduce, timed
on rank 0. Reported: each run's median and its tries, in the order they ran, and the median of all
tries pooled. Writes benchmarks/results/inside_step_probe.{json,md} (``--out NAME``: NAME.{json,md}).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def worker(args) -> None:
    import horovod.torch as hvd
    import torch

    import common
    from hvd_ext.exchange.core import Exchange
    from hvd_ext.exchange.transport import HorovodTransport
    from hvd_ext.plan import calibration as measure

    hvd.init()
    torch.set_num_threads(1)
    step = common.main_cnn_step(64)
    floor = common.main_cnn_run("compute", 128)
    for _ in range(3):
        step(floor)
    if args.after_calibration:
        measure.measure(methods=["qsgd:bits=8,exchange=twophase", "topk:ratio=0.01,exchange=twophase",
                                 "powersgd:warmup=0"], step=lambda: step(floor), steps=8)
    job = measure._Job(Exchange(), torch.device("cpu"))
    jobs = {"hvd_ext": job, "horovod": measure._Job(job.ex, torch.device("cpu"), HorovodTransport(wait="spin"))}
    tries = {name: [] for name in jobs}
    for r in range(args.runs):
        for name, j in jobs.items():
            run = j.small_collectives(f"probe.{r}.{name}")
            tries[name].append(measure._tries(run["allreduce"], args.tries, before=lambda: step(floor)))
    if hvd.rank() == 0:
        Path(args.worker_out).write_text(json.dumps({"ranks": hvd.size(), "rate": args.rate or "unshaped",
                                                     "after_calibration": args.after_calibration,
                                                     "tries_s": tries}))


def render(doc) -> str:
    res = doc["results"][0]
    lines = ["# A collective right after a step, where ranks share cores", "",
             f"`{doc['command']}`; load at start {doc['loadavg_start']}; {res['ranks']} ranks on this machine's "
             f"cores, {res.get('rate', 'unshaped')}"
             f"{', after the calibration' if res.get('after_calibration') else ''}. Milliseconds, rank 0's tries "
             "(module doc).", "",
             "| allreduce | run | median | tries |", "|---|---|---|---|"]
    for name, runs in res["tries_s"].items():
        for i, times in enumerate(runs):
            lines.append(f"| {name} | {i} | {statistics.median(times) * 1e3:.1f} | "
                         f"{', '.join(f'{t * 1e3:.1f}' for t in times)} |")
        pooled = [t for times in runs for t in times]
        lines.append(f"| {name} | pooled | {statistics.median(pooled) * 1e3:.1f} | "
                     f"{min(pooled) * 1e3:.1f} to {max(pooled) * 1e3:.1f} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    import common

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_one_job_options(ap, ranks=4)
    ap.add_argument("--runs", type=int, default=4)
    ap.add_argument("--tries", type=int, default=10)
    ap.add_argument("--out", default="inside_step_probe")
    ap.add_argument("--rate", default=None, help="the loopback's rate on the line shaper (default: unshaped)")
    ap.add_argument("--after-calibration", action="store_true")
    args = ap.parse_args(argv)
    if args.worker:
        return worker(args)
    passed = ["--runs", str(args.runs), "--tries", str(args.tries)] + (["--rate", args.rate] if args.rate else []) \
        + (["--after-calibration"] if args.after_calibration else [])
    common.one_job_benchmark(__file__, args.out, argv, args, passed, render, rate=args.rate)


if __name__ == "__main__":
    main()
