#!/usr/bin/env python
"""Convergence benchmark: epochs each method needs to reach a target MNIST-1D accuracy.

    python benchmarks/convergence.py                 # every recipe below (~15 min on a quiet 2-core machine)
    python benchmarks/convergence.py --only topk dgc # recipes whose method starts with these names

Each recipe is one run of the main job (scripts/train.py, 2 ranks, unshaped
loopback: this measures accuracy, not speed) with the stated flags. The
one-cycle schedule depends on the total epoch count, so "epochs to target" is
the first epoch end at or above the target *within a run of the stated length*.
Recipes that differ from the defaults (more epochs, lower learning rate) are
the ones we found to reach the target; the table says so.

Writes benchmarks/results/convergence.{json,md}.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402
from common import ROOT  # noqa: E402

# (method label, train.py arguments, launcher, target accuracy, issue)
RECIPES = [
    ("horovod", ["--plain-horovod"], "gloo", 0.94, 2),
    ("none", ["--compression", "none"], "gloo", 0.94, 2),
    ("fp16", ["--compression", "fp16"], "gloo", 0.94, 2),
    ("topk:ratio=0.01", ["--compression", "topk:ratio=0.01", "--epochs", "24"], "gloo", 0.94, 3),
    ("topk:ratio=0.01,scope=model", ["--compression", "topk:ratio=0.01,scope=model"], "gloo", 0.94, 3),
    ("dgc:ratio=0.01,warmup_steps=250", ["--compression", "dgc:ratio=0.01,warmup_steps=250", "--epochs", "16"],
     "gloo", 0.94, 3),
    ("sig:ratio=0.01", ["--compression", "sig:ratio=0.01"], "gloo", 0.94, 3),
    ("topk:ratio=0.01,scope=model,feedback=ewma",
     ["--compression", "topk:ratio=0.01,scope=model,feedback=ewma"], "gloo", 0.94, 3),
    ("topk:ratio=0.01,feedback=ewma", ["--compression", "topk:ratio=0.01,feedback=ewma", "--epochs", "24"],
     "gloo", 0.94, 3),
    ("qdist:bits=3", ["--compression", "qdist:bits=3"], "gloo", 0.93, 4),
    ("qsgd:bits=8", ["--compression", "qsgd:bits=8"], "gloo", 0.93, 4),
    ("powersgd:rank=2", ["--compression", "powersgd:rank=2", "--epochs", "16"], "gloo", 0.93, 4),
    ("efsignsgd:bucket=32", ["--compression", "efsignsgd:bucket=32", "--lr", "0.05", "--epochs", "24"],
     "gloo", 0.93, 4),
    ("onebit:bucket=32", ["--compression", "onebit:bucket=32", "--lr", "0.05", "--epochs", "24"], "gloo", 0.93, 4),
    ("local:period=8", ["--sync", "local:period=8"], "gloo", 0.93, 5),
    ("adaptive:min=1,max=32", ["--sync", "adaptive:min=1,max=32"], "gloo", 0.93, 5),
    ("event", ["--sync", "event"], "mpi", 0.93, 5),
]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", nargs="*", default=None, help="run recipes whose label starts with one of these")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "convergence"))
    p.add_argument("--timeout", type=float, default=1200.0, help="seconds per job")
    p.add_argument("--reuse", action="store_true",
                   help="use a recipe's result JSON left in the logs folder by an earlier run instead of rerunning it")
    a = p.parse_args(argv)
    out = Path(a.out)
    work = out.parent / (out.name + "_logs")
    work.mkdir(parents=True, exist_ok=True)
    recipes = [r for r in RECIPES if not a.only or any(r[0].startswith(o) for o in a.only)]
    if not recipes:
        p.error(f"--only {a.only} matches no recipe; recipes: {', '.join(r[0] for r in RECIPES)}")
    rows = []
    for label, args, launcher, target, issue in recipes:
        js = work / f"{common.slug(label)}.json"
        reuse = a.reuse and js.exists()
        if not reuse:
            js.unlink(missing_ok=True)
        # unshaped: MPI jobs keep OpenMPI's default transports (shared memory on one node)
        prefix = (["mpirun", "-np", str(a.ranks), "--bind-to", "none"] if launcher == "mpi"
                  else common.hvd_launcher(a.ranks, launcher))
        cmd = prefix + [common.PY, str(ROOT / "scripts" / "train.py"), *args, "--no-progress", "--json", str(js)]
        t0 = time.time()
        res = {"rc": 0, "tail": ""} if reuse else common.run_job(cmd, work / f"{common.slug(label)}.log", a.timeout)
        row = {"method": label, "issue": issue, "args": args, "launcher": launcher, "target": target,
               "wall_s": time.time() - t0, "command": "horovodrun -np %d %spython scripts/train.py %s" % (
                   a.ranks, "--mpi " if launcher == "mpi" else "", " ".join(args))}
        if res["rc"] != 0 or not js.exists():
            row["status"] = "failed"
            row["reason"] = " | ".join(res["tail"].splitlines()[-4:])
        else:
            r = json.loads(js.read_text())
            hist = r["history"]
            reached = next((h["epoch"] for h in hist if h["test_acc"] >= target), None)
            row.update(status="ok", epochs=r["epochs"], final_acc=r["test_acc"],
                       best_acc=max(h["test_acc"] for h in hist), epochs_to_target=reached,
                       acc_per_epoch=[round(h["test_acc"], 4) for h in hist],
                       bytes_sent_per_step=r["bytes_sent_per_step"], bytes_ratio_vs_dense=r["bytes_ratio_vs_dense"],
                       exchanges=r.get("exchanges"), steps=r["steps"], ms_per_step=r["ms_per_step"])
        rows.append(row)
        if row["status"] == "ok":
            print(f"{label:45s} final {100 * row['final_acc']:.2f}%  target {100 * target:.0f}% at epoch "
                  f"{row['epochs_to_target']} of {row['epochs']}  bytes {row['bytes_ratio_vs_dense']:.4f} of dense  "
                  f"exchanges {row['exchanges']}", flush=True)
        else:
            print(f"{label:45s} FAILED: {row['reason'][:200]}", flush=True)
    if a.only and out.with_suffix(".json").exists():  # a partial run updates its rows of the last full one
        old = {r["method"]: r for r in json.loads(out.with_suffix(".json").read_text())["rows"]}
        old.update({r["method"]: r for r in rows})
        rows = [old[r[0]] for r in RECIPES if r[0] in old]
    doc = {"machine": common.machine_info(), "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "ranks": a.ranks,
           "rows": rows}
    common.write_json(out.with_suffix(".json"), doc)
    out.with_suffix(".md").write_text(markdown(doc))
    print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.md')}")
    return 0 if all(r["status"] == "ok" for r in rows) else 1


def markdown(doc) -> str:
    L = [f"### Convergence on MNIST-1D ({doc['ranks']} ranks, unshaped; {doc['date']})", "",
         "| issue | method | run | target | epochs to target | final acc | bytes vs dense fp32 | exchanges |",
         "|---|---|---|---|---|---|---|---|"]
    for r in doc["rows"]:
        if r["status"] != "ok":
            L.append(f"| {r['issue']} | `{r['method']}` | `{' '.join(r['args'])}` | {100 * r['target']:.0f}% | "
                     f"failed | | | |")
            continue
        reached = r["epochs_to_target"] if r["epochs_to_target"] is not None else "not reached"
        L.append(f"| {r['issue']} | `{r['method']}` | `{' '.join(r['args'])}` | {100 * r['target']:.0f}% | "
                 f"{reached} of {r['epochs']} | {100 * r['final_acc']:.2f}% | {r['bytes_ratio_vs_dense']:.4f} | "
                 f"{r['exchanges']:.0f} |")
    L += ["", "Command per row: `horovodrun -np 2 [--mpi] python scripts/train.py <run>`; "
          "all rows: `python benchmarks/convergence.py`.", ""]
    return "\n".join(L)


if __name__ == "__main__":
    sys.exit(main())
