#!/usr/bin/env python
"""Every compressor at its *default* options inside a plain user training loop.

The loop is what a new user writes: the main job's 1-D CNN on MNIST-1D
(``hvd_ext.examples.mnist1d``), 2 ranks, batch 64 per rank, constant learning
rate, no weight decay, no schedule, and the user's own optimizer wrapped by
``hvd_ext.DistributedOptimizer(opt, compression=SPEC)``:

* ``sgd``:  ``torch.optim.SGD(lr=0.05, momentum=0.9)``
* ``adam``: ``torch.optim.Adam(lr=1e-3)``
* ``adamw``: ``torch.optim.AdamW(lr=1e-3)`` (weight decay 0.01, torch's default)

For each (optimizer, spec) it records the test accuracy after every epoch and
prints a table against ``none`` (same optimizer): final accuracy, the gap, and
the first epoch at which the run came within 1 point of ``none``'s final
accuracy. Results are merged into ``benchmarks/results/defaults_check.json``
(keyed by optimizer, spec and epochs), so partial runs accumulate.

    python benchmarks/defaults_check.py                          # every compressor, sgd and adam
    python benchmarks/defaults_check.py --optims sgd --epochs 24 --spec dgc --spec powersgd

Started without Horovod's environment it relaunches itself with
``horovodrun -np 2 --gloo`` (``--np`` to change). All runs of one invocation
share one Horovod job, one after the other.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

DEFAULT_JSON = ROOT / "benchmarks" / "results" / "defaults_check.json"
LR = {"sgd": 0.05, "adam": 1e-3, "adamw": 1e-3}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--spec", action="append", default=None,
                   help="compressor spec (repeatable); default: every registered compressor at defaults")
    p.add_argument("--optims", default="sgd,adam", help="comma list of sgd, adam, adamw")
    p.add_argument("--epochs", type=int, default=8, help="epochs per compressed run")
    p.add_argument("--none-epochs", type=int, default=8, help="epochs of the reference run with none")
    p.add_argument("--no-reference", action="store_true",
                   help="do not run none; compare with the none rows already in the JSON")
    p.add_argument("--batch", type=int, default=64, help="samples per rank per step")
    p.add_argument("--channels", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--np", type=int, default=2, help="ranks when relaunching under horovodrun")
    p.add_argument("--json", default=str(DEFAULT_JSON))
    p.add_argument("--sgd-momentum", type=float, default=0.9, help="momentum of the sgd optimizer")
    p.add_argument("--lr-scale", type=float, default=1.0, help="multiply every optimizer's learning rate")
    p.add_argument("--table", action="store_true", help="only print the table of the JSON file")
    p.add_argument("--md", action="store_true", help="with --table: as markdown")
    p.add_argument("--merge", nargs="+", default=None, metavar="JSON",
                   help="only merge the runs of these JSON files (later ones win per optimizer, spec and "
                        "epochs) into --json, then print the table")
    p.add_argument("--max-seconds", type=float, default=0,
                   help="stop a run early when one epoch takes longer than this (0 = never)")
    return p.parse_args(argv)


def relaunch(argv):
    exe = shutil.which("horovodrun", path=str(Path(sys.executable).parent) + os.pathsep + os.environ["PATH"])
    args = parse_args(argv)
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [exe, "-np", str(args.np), "--gloo", sys.executable, str(Path(__file__).resolve()), *argv]
    return subprocess.call(cmd, env=env)


def make_optimizer(kind, params, args):
    import torch

    if kind == "sgd":
        return torch.optim.SGD(params, lr=LR["sgd"] * args.lr_scale, momentum=args.sgd_momentum)
    if kind == "adam":
        return torch.optim.Adam(params, lr=LR["adam"] * args.lr_scale)
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=LR["adamw"] * args.lr_scale)
    raise ValueError(f"unknown optimizer {kind!r}; accepted: sgd, adam, adamw")


def train_one(hvd, data, kind, spec, epochs, args):
    import torch
    import torch.nn.functional as F

    import hvd_ext
    from hvd_ext.examples.mnist1d import MNIST1DCNN, accuracy

    x_train, y_train, x_test, y_test = data
    rank, size = hvd.rank(), hvd.size()
    torch.manual_seed(args.seed)
    model = MNIST1DCNN(args.channels)
    opt = make_optimizer(kind, model.parameters(), args)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt = hvd_ext.DistributedOptimizer(opt, named_parameters=model.named_parameters(), compression=spec)
    msgs = sorted({str(w.message) for w in caught})
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    steps = len(x_train) // (args.batch * size)
    gen = torch.Generator().manual_seed(args.seed)
    hist, losses = [], []
    t0 = time.perf_counter()
    for epoch in range(epochs):
        te = time.perf_counter()
        perm = torch.randperm(len(x_train), generator=gen)
        tot = 0.0
        for i in range(steps):
            idx = perm[(i * size + rank) * args.batch:(i * size + rank + 1) * args.batch]
            opt.zero_grad()
            loss = F.cross_entropy(model(x_train[idx]), y_train[idx])
            loss.backward()
            opt.step()
            tot += float(loss.detach())
        acc = accuracy(model, x_test, y_test)
        hist.append(round(acc, 4))
        losses.append(round(tot / steps, 4))
        if args.max_seconds and time.perf_counter() - te > args.max_seconds:
            break
    comp = opt.compression
    if args.sgd_momentum != 0.9 and kind == "sgd":
        kind = f"sgd(m={args.sgd_momentum})"
    if args.lr_scale != 1.0:
        kind = f"{kind}(lr x{args.lr_scale})"
    return {"optimizer": kind, "lr": LR[kind.split("(")[0]] * args.lr_scale, "spec": spec, "resolved": comp.spec(), "epochs": len(hist),
            "steps_per_epoch": steps, "test_acc": hist[-1], "acc_history": hist, "loss_history": losses,
            "warnings": msgs, "seconds": round(time.perf_counter() - t0, 1)}


def main(argv):
    args = parse_args(argv)
    import horovod.torch as hvd
    import torch

    import hvd_ext
    from hvd_ext.examples.mnist1d import load_mnist1d

    hvd.init()
    torch.set_num_threads(args.threads)
    if hvd.rank() == 0:
        load_mnist1d()
    hvd.barrier()
    data = load_mnist1d()
    specs = args.spec or [n for n in hvd_ext.list_compressors() if n != "none"]
    optims = [o for o in args.optims.split(",") if o]
    path = Path(args.json)
    old = json.loads(path.read_text()) if path.exists() else {"runs": []}
    rows = []
    for kind in optims:
        todo = ([] if args.no_reference else [("none", args.none_epochs)]) + [(s, args.epochs) for s in specs]
        for spec, epochs in todo:
            r = train_one(hvd, data, kind, spec, epochs, args)
            rows.append(r)
            if hvd.rank() == 0:
                print(f"RUN {kind:5s} {spec:40s} ep={r['epochs']:2d} acc={100 * r['test_acc']:.2f} "
                      f"hist={[round(100 * a, 1) for a in r['acc_history']]} {r['seconds']}s "
                      + (f"warn={r['warnings']}" if r["warnings"] else ""), flush=True)
                r["channels"] = args.channels  # the model's width: part of a run's key
                merged = [o for o in old["runs"] if (o["optimizer"], o["spec"], o["epochs"], o.get("channels", 64)) !=
                          (r["optimizer"], r["spec"], r["epochs"], r["channels"])] + [r]
                old = {"runs": merged, "setup": {
                    "model": f"hvd_ext.examples.mnist1d.MNIST1DCNN({args.channels})", "ranks": hvd.size(),
                    "batch_per_rank": args.batch, "lr": LR, "schedule": "constant", "weight_decay": 0,
                    "sgd_momentum": args.sgd_momentum, "seed": args.seed}}
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(json.dumps(old, indent=1))
    if hvd.rank() == 0:
        print_table(old["runs"])


def print_table(runs, md=False):
    """One row per run against ``none`` with the same optimizer, by the criterion "reaches within
    1 point of none's accuracy within 3x none's epochs": the reference is none's final accuracy
    after its own (fewest) epochs; a row passes when some epoch up to 3x those epochs is within 1
    point of it. Also shown: the final accuracy and the mean of the last three epochs (constant
    learning rate: the last epochs scatter by about a point). ``md``: a markdown table."""
    ref, same = {}, {}
    for r in sorted(runs, key=lambda r: -r["epochs"]):
        if r["spec"] == "none":
            ref[r["optimizer"]] = r  # the shortest none run of each optimizer
            same[(r["optimizer"], r["epochs"])] = r
    last3 = lambda r: sum(r["acc_history"][-3:]) / len(r["acc_history"][-3:])  # noqa: E731
    head = ["optimizer", "spec (defaults)", "epochs", "final %", "last3 %", "none %", "gap (final)",
            "within 1 pt at epoch", "pass", "none same epochs %", "gap (last3, same epochs)"]
    rows = []
    for r in sorted(runs, key=lambda r: (r["optimizer"], r["spec"] != "none", r["spec"], r["epochs"])):
        n = ref.get(r["optimizer"])
        nacc = n["test_acc"] if n else float("nan")
        limit = 3 * n["epochs"] if n else 0
        first = next((i + 1 for i, a in enumerate(r["acc_history"]) if a >= nacc - 0.01), None)
        s_ = same.get((r["optimizer"], r["epochs"]))
        rows.append([r["optimizer"], r["spec"], str(r["epochs"]), f"{100 * r['test_acc']:.2f}",
                     f"{100 * last3(r):.2f}", f"{100 * nacc:.2f}", f"{100 * (r['test_acc'] - nacc):+.2f}",
                     str(first or "-"), "yes" if first and first <= limit else "NO",
                     f"{100 * s_['test_acc']:.2f}" if s_ else "-",
                     f"{100 * (last3(r) - last3(s_)):+.2f}" if s_ else "-"])
    if md:
        print("Every compressor at its default options in a plain user loop: the main job's 1-D CNN "
              "(`MNIST1DCNN(64)`) on MNIST-1D, 2 ranks, batch 64 per rank, constant learning rate, the "
              "user's optimizer wrapped by `hvd_ext.DistributedOptimizer(opt, compression=SPEC)`: SGD "
              "(lr 0.05, momentum 0.9) and Adam (lr 1e-3). A row passes when some epoch up to 3x `none`'s "
              "epochs is within 1 point of `none`'s final accuracy. `python benchmarks/defaults_check.py "
              "--table --md` prints this table from `defaults_check.json`.\n")
        print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
        for row in rows:
            print("| " + " | ".join(f"`{c}`" if i == 1 else c for i, c in enumerate(row)) + " |")
        return
    widths = [9, 32, 6, 8, 8, 7, 11, 20, 4, 18, 24]
    print("\n" + " ".join(h.rjust(w) if i > 1 else h.ljust(w) for i, (h, w) in enumerate(zip(head, widths))))
    for row in rows:
        print(" ".join(c.rjust(w) if i > 1 else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))))


if __name__ == "__main__":
    if "--merge" in sys.argv[1:]:
        a = parse_args(sys.argv[1:])
        out = Path(a.json)
        merged = json.loads(out.read_text()) if out.exists() else {"runs": []}
        for f in a.merge:
            doc = json.loads(Path(f).read_text())
            keys = {(r["optimizer"], r["spec"], r["epochs"]) for r in doc["runs"]}
            merged["runs"] = [r for r in merged["runs"] if (r["optimizer"], r["spec"], r["epochs"]) not in keys]
            merged["runs"] += doc["runs"]
            merged["setup"] = doc.get("setup", merged.get("setup"))
        out.write_text(json.dumps(merged, indent=1))
        print_table(merged["runs"])
        sys.exit(0)
    if "--table" in sys.argv[1:]:
        print_table(json.loads(Path(parse_args(sys.argv[1:]).json).read_text())["runs"], md="--md" in sys.argv[1:])
        sys.exit(0)
    if "HOROVOD_RANK" not in os.environ and "OMPI_COMM_WORLD_RANK" not in os.environ:
        sys.exit(relaunch(sys.argv[1:]))
    main(sys.argv[1:])
