#!/usr/bin/env python
"""Per-step overhead of hvd_ext's gradient path against plain Horovod, in one job.

    horovodrun -np 2 --gloo python benchmarks/overhead.py                       # main-job CNN
    horovodrun -np 2 --gloo python benchmarks/overhead.py --model synthetic     # 10.7M parameters
    horovodrun -np 2 --gloo python benchmarks/overhead.py --profile none        # cProfile one method (rank 0)
    horovodrun -np 2 --gloo python benchmarks/overhead.py --methods auto auto-choice --warmup 150
                                                   # auto's steady state against the fixed codec it chose

Each method (``horovod`` = ``hvd.DistributedOptimizer``; ``compute`` = the same
step with no exchange, the floor; anything else is an hvd_ext spec) gets its own model and optimizer, and the methods take turns:
``--rounds`` rounds of ``--steps`` timed steps each, so machine noise hits every
method alike. ``host ms`` (``host_code_ms`` in the JSON) is hvd_ext's own host work per step
(the pipeline's coding and route work, ``stats.compress_s``), steadier than the step time on a shared
machine; on a CPU it holds no waits, on a GPU its one read per step waits for the device, and with the
pipeline's worker thread it is that thread's time. ``auto-choice`` is the fixed codec ``auto`` chose (the same on every bucket), built
after the ``--warmup`` steps in which auto decided. Reported: median ms/step over rounds and the ratio to
``horovod`` measured in the same job. Use ``--json`` to keep the figures.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402


def build(model_name: str, channels: int):
    if model_name == "synthetic":
        from models import SyntheticNet
        return SyntheticNet(), (lambda b: torch.randn(b, 3, 32, 32)), 10
    from hvd_ext.examples.mnist1d import MNIST1DCNN
    return MNIST1DCNN(channels), (lambda b: torch.randn(b, 40)), 10


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--methods", nargs="+", default=["horovod", "none", "fp16", "bf16"])
    p.add_argument("--model", choices=["cnn", "synthetic"], default="cnn")
    p.add_argument("--channels", type=int, default=128, help="CNN width (128: about 0.7M parameters)")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per method first (auto decides in them)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--bucket-bytes", type=int, default=None, help="hvd_ext bucket size (default: the optimizer's)")
    p.add_argument("--profile", default=None, help="cProfile this method on rank 0 and print the top entries")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)

    import horovod.torch as hvd
    import hvd_ext
    hvd.init()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    runs = {}

    def make(m):
        model, make_x, classes = build(args.model, args.channels)
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        if m == "horovod":
            opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
        elif m == "compute":  # the floor: the same step with no exchange at all
            pass
        else:
            kw = {"bucket_bytes": args.bucket_bytes} if args.bucket_bytes else {}
            opt = hvd_ext.DistributedOptimizer(opt, named_parameters=model.named_parameters(), compression=m, **kw)
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        x, y = make_x(args.batch), torch.randint(0, classes, (args.batch,))
        return model, opt, x, y

    def one_step(m):
        model, opt, x, y = runs[m]
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()

    for m in args.methods:
        if m != "auto-choice":
            runs[m] = make(m)
            for _ in range(args.warmup):  # first exchanges, allocations; auto's decisions
                one_step(m)
    if "auto-choice" in args.methods:  # the fixed codec auto chose, built once it has chosen
        choice = runs["auto"][1].stats.extra["auto"]["choice"]
        if len(set(choice)) != 1:
            raise SystemExit(f"auto-choice: auto chose different codecs per bucket ({choice}); no one fixed codec")
        if hvd.rank() == 0:
            print(f"auto-choice = {choice[0]}")
        runs["auto-choice"] = make(choice[0])
        for _ in range(args.warmup):
            one_step("auto-choice")
    n_params = sum(q.numel() for q in runs[args.methods[0]][0].parameters())
    times = {m: [] for m in args.methods}
    host = {m: [] for m in args.methods if hasattr(runs[m][1], "stats")}   # hvd_ext's methods
    prof = cProfile.Profile() if args.profile and hvd.rank() == 0 else None
    for r in range(args.rounds):
        for m in args.methods:
            hvd.allreduce(torch.zeros(1), name=f"overhead.barrier.{r}.{m}")
            if prof is not None and m == args.profile:
                prof.enable()
            c0 = runs[m][1].stats.compress_s if m in host else 0.0
            t0 = time.perf_counter()
            for _ in range(args.steps):
                one_step(m)
            dt = (time.perf_counter() - t0) / args.steps
            if m in host:
                host[m].append((runs[m][1].stats.compress_s - c0) / args.steps)
            if prof is not None and m == args.profile:
                prof.disable()
            times[m].append(dt)
    if hvd.rank() != 0:
        return
    ref = statistics.median(times["horovod"]) if "horovod" in times else None
    print(f"model {args.model} ({n_params / 1e6:.2f}M parameters), batch {args.batch}/rank, {hvd.size()} ranks, "
          f"{args.rounds} rounds x {args.steps} steps, {args.threads} thread(s)")
    print(f"{'method':<24}{'ms/step':>10}{'min':>10}{'vs horovod':>12}{'host ms':>10}")
    rows = []
    for m in args.methods:
        med = statistics.median(times[m])
        ratio = med / ref if ref else None
        code = statistics.median(host[m]) * 1e3 if m in host else None
        rows.append({"method": m, "ms_per_step": med * 1e3, "min_ms": min(times[m]) * 1e3, "vs_horovod": ratio,
                     "rounds_ms": [t * 1e3 for t in times[m]], "host_code_ms": code})
        print(f"{m:<24}{med * 1e3:>10.2f}{min(times[m]) * 1e3:>10.2f}{(f'{ratio:.3f}x' if ratio else '-'):>12}"
              f"{(f'{code:.2f}' if code is not None else '-'):>10}")
    for m in args.methods:  # what compression="auto" chose, and from what
        auto = getattr(runs[m][1], "stats", None)
        auto = auto.extra.get("auto") if auto is not None and hasattr(auto, "extra") else None
        if auto:
            last = auto.get("last") or {}
            print(f"{m}: codec per bucket {auto['choice']} after {auto['decisions']} decision(s); "
                  f"link {last.get('link')}; predicted ms per candidate {last.get('predicted_ms_per_candidate')}")
    if prof is not None:
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats(os.environ.get("PROF_SORT", "tottime")).print_stats(int(os.environ.get("PROF_N", "25")))
        print(s.getvalue())
    if args.json:
        Path(args.json).write_text(json.dumps({"model": args.model, "params": n_params, "size": hvd.size(),
                                               "batch": args.batch, "rows": rows,
                                               "command": "benchmarks/overhead.py " + " ".join(sys.argv[1:]),
                                               "loadavg_end": open("/proc/loadavg").read().split()[:3]},
                                              indent=1))


if __name__ == "__main__":
    main()
