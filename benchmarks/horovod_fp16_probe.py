#!/usr/bin/env python
"""What Horovod's fp16 compression costs on a CPU, alone and inside a training step.

    python benchmarks/horovod_fp16_probe.py [--ranks 2] [--rounds 5] [--steps 10]

One ``horovodrun --gloo`` job of ``--ranks`` ranks in an unshaped namespace. On a CPU Horovod sums
float16 in scalar code, whose speed depends on the values (float16 subnormals take its slow path).
Measured, on the main job's CNN (MNIST-1D, batch 64):

* its gradient's entries that are float16 subnormals, and those that underflow to zero, once cast;
* alone: Horovod's allreduce of the gradient's tensors (each its own, as its optimizer sends them;
  ``Average``), float32 and float16, ``--steps`` tries in each of ``--rounds`` rounds, the median;
* in training: the step of Horovod's ``DistributedOptimizer`` without compression, with
  ``Compression.fp16``, and without any exchange, in turns (``--rounds`` rounds of ``--steps``), the
  median of the rounds' means;
* what the calibration's float16 link probe sees against the step's: the float16 allreduce of one
  tensor (as Horovod's fusion sends the step's gradient), per element, of the gradient at its own
  size and repeated to the probe's size (``hvd_ext.plan.calibration.LARGE``), and of the probe's
  values (``gradient_like``) at both sizes.

The ranks' mean of each figure. Writes benchmarks/results/horovod_fp16_probe.{json,md}.
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

class _Keep:
    """An optimizer that leaves the gradient as backward left it."""

    def zero_grad(self) -> None:
        pass

    def step(self) -> None:
        pass


def gradient_of(model, step) -> list:
    """The gradient tensors of one step of ``model`` (the step's batch, no update)."""
    step((model, _Keep()))
    return [p.grad.detach().clone() for p in model.parameters()]


def allreduce_alone(grads, dtype, tries: int, name: str) -> list:
    import horovod.torch as hvd

    times = []
    for t in range(tries):
        xs = [g.to(dtype) for g in grads]
        hvd.allreduce(xs[0].new_zeros(1).float(), name=f"{name}.sync.{t}")
        t0 = time.perf_counter()
        handles = [hvd.allreduce_async_(x, name=f"{name}.{i}", op=hvd.Average) for i, x in enumerate(xs)]
        for h in handles:
            hvd.synchronize(h)
        times.append(time.perf_counter() - t0)
    return times


def fused_per_element(flat, args) -> dict:
    """Seconds per element of one float16 allreduce of the gradient ``flat`` and of the calibration's
    values, each at the gradient's size and at the calibration's large probe's (the median of
    ``--rounds`` x ``--steps`` tries)."""
    import torch

    from hvd_ext.plan.calibration import LARGE, gradient_like

    out = {}
    for n, size in ((flat.numel(), "own"), (LARGE, "probe")):
        for values in ("gradient", "gradient_like"):
            x = flat.repeat(-(-n // flat.numel()))[:n] if values == "gradient" else gradient_like(n, "cpu")
            tries = allreduce_alone([x], torch.float16, args.rounds * args.steps, f"probe.{values}.{size}")
            out[f"fp16_{values}_{size}_s_per_element"] = statistics.median(tries) / n
    return out


def worker(args) -> None:
    import horovod.torch as hvd
    import torch

    import common

    hvd.init()
    torch.set_num_threads(1)
    step = common.main_cnn_step(64)
    runs = {m: common.main_cnn_run(m, 128) for m in ("compute", "horovod", "horovod fp16")}
    for run in runs.values():
        for _ in range(3):
            step(run)
    grads = gradient_of(common.main_cnn_run("compute", 128)[0], step)
    flat = torch.cat([g.flatten() for g in grads])
    flat16 = flat.half()
    subnormal = ((flat16 != 0) & (flat16.abs() < torch.finfo(torch.float16).tiny)).float().mean().item()
    zero = ((flat16 == 0) & (flat != 0)).float().mean().item()
    alone = {"float32": [], "float16": []}
    for r in range(args.rounds):
        for key, dtype in (("float32", torch.float32), ("float16", torch.float16)):
            alone[key] += allreduce_alone(grads, dtype, args.steps, f"probe.{r}.{key}")
    per_element = fused_per_element(flat, args)
    turns = common.time_in_turns(runs, step, args.rounds, args.steps,
                                 lambda name: hvd.allreduce(torch.zeros(1), name=f"probe.{name}"))
    figures = [subnormal, zero, *(statistics.median(alone[k]) for k in alone),
               *(statistics.median(turns[m]) for m in runs), *per_element.values()]
    mean = hvd.allreduce(torch.tensor(figures, dtype=torch.float64), op=hvd.Average, name="probe.mean").tolist()
    if hvd.rank() == 0:
        names = ["subnormal", "underflow", "alone_float32_s", "alone_float16_s",
                 *(f"step_{m.replace(' ', '_')}_s" for m in runs), *per_element]
        Path(args.worker_out).write_text(json.dumps({"ranks": hvd.size(), **dict(zip(names, mean)),
                                                     "params": sum(g.numel() for g in grads)}))


def render(doc) -> str:
    lines = ["# Horovod's fp16 compression on a CPU, alone and in a step", "",
             f"`{doc['command']}`; load at start {doc['loadavg_start']}; unshaped, this machine's cores; "
             "the ranks' mean (module doc).", "",
             "| ranks | params | float16 subnormal | underflow to 0 | allreduce alone: fp32 ms | fp16 ms | fp16 - fp32 "
             "| step: no exchange ms | Horovod fp32 ms | fp16 ms | fp16 - fp32 |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in doc["results"]:
        a32, a16 = r["alone_float32_s"] * 1e3, r["alone_float16_s"] * 1e3
        s0, s32, s16 = r["step_compute_s"] * 1e3, r["step_horovod_s"] * 1e3, r["step_horovod_fp16_s"] * 1e3
        lines.append(f"| {r['ranks']} | {r['params']} | {r['subnormal']:.1%} | {r['underflow']:.1%} | {a32:.2f} | "
                     f"{a16:.2f} | {a16 - a32:+.2f} | {s0:.2f} | {s32:.2f} | {s16:.2f} | {s16 - s32:+.2f} |")
    lines += ["", "One float16 allreduce, ns per element: the gradient (repeated to the probe's size) and the "
              "calibration's values (`gradient_like`), at the gradient's size and at the calibration's probe's.", "",
              "| ranks | gradient, own size | gradient, probe size | gradient_like, own size "
              "| gradient_like, probe size |",
              "|---|---|---|---|---|"]
    for r in doc["results"]:
        if "fp16_gradient_own_s_per_element" in r:
            cells = [r[f"fp16_{v}_{s}_s_per_element"] * 1e9
                     for v in ("gradient", "gradient_like") for s in ("own", "probe")]
            lines.append(f"| {r['ranks']} | " + " | ".join(f"{c:.1f}" for c in cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    import common

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_one_job_options(ap, ranks=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=10)
    args = ap.parse_args(argv)
    if args.worker:
        return worker(args)
    passed = ["--rounds", str(args.rounds), "--steps", str(args.steps)]
    common.one_job_benchmark(__file__, "horovod_fp16_probe", argv, args, passed, render)


if __name__ == "__main__":
    main()
