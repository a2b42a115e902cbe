#!/usr/bin/env python
"""Convergence benchmark: epochs each method needs to reach a target MNIST-1D accuracy.

    python benchmarks/convergence.py                 # every recipe below (~15 min on a quiet 2-core machine)
    python benchmarks/convergence.py --only topk dgc # recipes whose method starts with these names
    python benchmarks/convergence.py --workload resnet            # one workload, every method (see WORKLOAD_METHODS)
    python benchmarks/convergence.py --workload mnist1d-noniid-slow --only local adaptive event

Without ``--workload``: the MNIST-1D recipes below (main job, epochs to target).
With ``--workload NAME`` (hvd_ext/examples/workloads.py: lm, resnet, mnist1d,
mnist1d-noniid, mnist1d-slow, mnist1d-noniid-slow): each method is one run of
benchmarks/workload_train.py with the workload's defaults (2 ranks, unshaped
loopback), reporting time and epochs to the workload's target, the final metric
and its difference to ``none`` (hvd_ext, no compression) and to plain Horovod;
writes benchmarks/results/workload_NAME.{json,md,png} and the cross-workload summary
benchmarks/results/convergence_workloads.{json,md} (``--summary`` rewrites only that).
Every workload job runs under ``nice -n 10`` (the machine may be shared); do not wrap
this script in nice again (nested nice ends at 19 and starves the jobs).

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


# (method label, workload_train.py arguments, launcher); sync strategies only on workloads with
# non-IID shards or a slow rank
WORKLOAD_METHODS = [
    ("horovod", ["--plain-horovod"], "gloo"),
    ("none", ["--compression", "none"], "gloo"),
    ("topk:ratio=0.01", ["--compression", "topk:ratio=0.01"], "gloo"),
    ("sig:ratio=0.01", ["--compression", "sig:ratio=0.01"], "gloo"),
    ("topk:ratio=0.01,feedback=ewma", ["--compression", "topk:ratio=0.01,feedback=ewma"], "gloo"),
    ("qsgd:bits=8", ["--compression", "qsgd:bits=8"], "gloo"),
    ("qdist:bits=3", ["--compression", "qdist:bits=3"], "gloo"),
    ("powersgd:rank=2", ["--compression", "powersgd:rank=2"], "gloo"),
]
SYNC_METHODS = [
    ("local:period=8", ["--sync", "local:period=8"], "gloo"),
    ("adaptive:min=1,max=32", ["--sync", "adaptive:min=1,max=32"], "gloo"),
    # technique 6 with local steps in proportion to speed: the fast rank does not wait
    ("adaptive:min=1,max=32,balance=1", ["--sync", "adaptive:min=1,max=32,balance=1"], "gloo"),
    ("event", ["--sync", "event"], "mpi"),
    ("event:staleness=none", ["--sync", "event:staleness=none"], "mpi"),  # technique 2's ablation
]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", default=None,
                   help="run the workload benchmark for this workload instead of the MNIST-1D recipes")
    p.add_argument("--extra", default="",
                   help="with --workload: more workload_train.py arguments for every method, one string "
                        "(e.g. --extra='--epochs 3')")
    p.add_argument("--only", nargs="*", default=None, help="run recipes whose label starts with one of these")
    p.add_argument("--tag", default=None,
                   help="with --workload: write workload_NAME_TAG.{json,md,png}, a variant (e.g. --ranks 4) "
                        "kept apart from the workload's main file and summary")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "convergence"))
    p.add_argument("--timeout", type=float, default=1200.0, help="seconds per job")
    p.add_argument("--reuse", action="store_true",
                   help="use a recipe's result JSON left in the logs folder by an earlier run instead of rerunning it")
    p.add_argument("--summary", action="store_true",
                   help="only rewrite benchmarks/results/convergence_workloads.{json,md} from the workload JSONs")
    common.add_load_option(p)
    a = p.parse_args(argv)
    common.refuse_if_loaded(a)
    a.machine = common.machine_info()  # with the load at the start, before our own ranks add to it
    if a.summary:
        sys.path.insert(0, str(ROOT))
        write_summary()
        return 0
    if a.workload:
        return run_workload(a)
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
    doc = {"machine": a.machine, "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "ranks": a.ranks,
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


# ---- workloads -------------------------------------------------------------------------------
def run_workload(a) -> int:
    import shlex

    sys.path.insert(0, str(ROOT))
    from hvd_ext.examples.workloads import get_workload

    w = get_workload(a.workload)
    # sync strategies by default where ranks differ (skew, a straggler); elsewhere when --only names them
    heterogeneous = w.skew is not None or w.slow_factor > 1
    methods = WORKLOAD_METHODS + (SYNC_METHODS if heterogeneous or a.only else [])
    methods = [m for m in methods if not a.only or any(m[0].startswith(o) for o in a.only)]
    if not methods:
        raise SystemExit(f"--only {a.only} matches no method of workload {w.name}")
    out = common.RESULTS / (f"workload_{common.slug(w.name)}" + (f"_{common.slug(a.tag)}" if a.tag else ""))
    work = common.RESULTS / "workload_logs"
    work.mkdir(parents=True, exist_ok=True)
    extra = shlex.split(a.extra)
    rows, meta = [], None
    for label, args, launcher in methods:
        tag = f"{out.name[len('workload_'):]}__{common.slug(label)}"
        js = work / f"{tag}.json"
        reuse = a.reuse and js.exists()
        if not reuse:
            js.unlink(missing_ok=True)
        prefix = (["mpirun", "-np", str(a.ranks), "--bind-to", "none"] if launcher == "mpi"
                  else common.hvd_launcher(a.ranks, launcher))
        targs = ["--workload", w.name, *args, *extra]
        cmd = ["nice", "-n", "10"] + prefix + [common.PY, str(ROOT / "benchmarks" / "workload_train.py"), *targs,
                                               "--json", str(js)]
        t0 = time.time()
        res = {"rc": 0, "tail": ""} if reuse else common.run_job(cmd, work / f"{tag}.log", a.timeout)
        row = {"method": label, "launcher": launcher, "args": targs, "wall_s": time.time() - t0,
               "command": ("mpirun -np %d" if launcher == "mpi" else "horovodrun -np %d --gloo") % a.ranks
               + " python benchmarks/workload_train.py " + " ".join(targs)}
        if res["rc"] != 0 or not js.exists():
            row.update(status="failed", reason=" | ".join(res["tail"].splitlines()[-4:]))
            print(f"{w.name:20s} {label:24s} FAILED: {row['reason'][:300]}", flush=True)
        else:
            r = json.loads(js.read_text())
            hist = r["history"]
            hit = next((h for h in hist if w.reached(h["metric"])), None)
            row.update(status="ok", final=r["final_metric"], train_time_s=r["train_time_s"],
                       time_to_target_s=hit["train_time_s"] if hit else None,
                       epochs_to_target=(hit["epoch"] if hit else None),
                       target_after_finish=bool(hit and hit.get("final")), epochs=r["epochs"],
                       curve=[[round(h["train_time_s"], 2), h["metric"]] for h in hist],
                       bytes_ratio_vs_dense=r["bytes_ratio_vs_dense"], bytes_sent_per_step=r["bytes_sent_per_step"],
                       exchanges=r["exchanges"], buffer_spread_per_epoch=r["buffer_spread_per_epoch"],
                       final_buffer_spread=r["final_buffer_spread"], final_param_spread=r["final_param_spread"],
                       period_history_len=len(r.get("period_history") or []),
                       final_period=((r.get("period_history") or [[None, None, None]])[-1][2]),
                       trigger_reasons=r.get("trigger_reasons"))
            meta = {k: r[k] for k in ("description", "metric", "target", "epochs", "steps", "batch", "lr", "optimizer",
                                      "skew", "shard_label_histograms", "slow_rank", "slow_factor", "params",
                                      "batchnorm", "corpus", "ranks")}
            print(f"{w.name:20s} {label:24s} final {common.fmt_metric(w.metric, row['final'])}  to target "
                  f"{_fmt_t(row['time_to_target_s'])} (epoch {row['epochs_to_target']})  train {row['train_time_s']:.1f}s"
                  f"  bytes {row['bytes_ratio_vs_dense']:.4f} of dense", flush=True)
        rows.append(row)
    if a.only and out.with_suffix(".json").exists():  # a partial run updates its rows of the last one
        prev = json.loads(out.with_suffix(".json").read_text())
        old = {r["method"]: r for r in prev["rows"]}
        old.update({r["method"]: r for r in rows})
        order = [m[0] for m in WORKLOAD_METHODS + SYNC_METHODS]
        rows = [old[m] for m in order if m in old]
        meta_prev = prev.get("workload_info", {})
    else:
        meta_prev = {}
    info = meta or meta_prev
    doc = {"title": f"Convergence on workload `{w.name}`", "workload": w.name, "workload_info": info,
           "machine": a.machine, "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "ranks": a.ranks,
           "command": f"python benchmarks/convergence.py --workload {w.name}"
           + (f" --ranks {a.ranks}" if a.ranks != 2 else "") + (f" --tag {a.tag}" if a.tag else "")
           + (f" --extra='{a.extra}'" if a.extra else ""),
           "rows": rows}
    compare_to_baselines(doc, w)
    png = out.with_suffix(".png")
    if plot(doc, w, png):
        doc["plots"] = [png.name]
    common.write_json(out.with_suffix(".json"), doc)
    out.with_suffix(".md").write_text(workload_markdown(doc, w))
    print(f"wrote {out.with_suffix('.json')}, {out.with_suffix('.md')}" + (f", {png}" if doc.get("plots") else ""))
    write_summary()
    return 0 if all(r["status"] == "ok" for r in rows) else 1


def write_summary() -> None:
    """benchmarks/results/convergence_workloads.{json,md}: one line per workload (baselines, fastest
    method to target) and the sync-strategy comparison on every workload that has them."""
    from hvd_ext.examples.workloads import WORKLOADS, get_workload

    docs = []
    for name in WORKLOADS:
        f = common.RESULTS / f"workload_{common.slug(name)}.json"
        if f.exists():
            docs.append(json.loads(f.read_text()))
    if not docs:
        return
    L = ["One row per workload (details in the workload sections below): final quality of plain Horovod and "
         "hvd_ext without compression, and the method that reached the target first.", "",
         "| workload | metric | target | `horovod` final / to target | `none` final / to target | "
         "fastest to target (method, time, final) | methods not reaching target |", "|---|---|---|---|---|---|---|"]
    summary = []
    for d in docs:
        w = get_workload(d["workload"])
        by = {r["method"]: r for r in d["rows"] if r["status"] == "ok"}
        hit = [r for r in by.values() if r.get("time_to_target_s") is not None]
        best = min(hit, key=lambda r: r["time_to_target_s"]) if hit else None
        miss = [r["method"] for r in d["rows"] if r["status"] != "ok" or r.get("time_to_target_s") is None]
        cell = lambda r: "—" if r is None else f"{common.fmt_metric(w.metric, r['final'])} / {_fmt_t(r['time_to_target_s'])}"  # noqa: E731
        L.append(f"| `{w.name}` | {w.metric} | {common.fmt_metric(w.metric, w.target)} | {cell(by.get('horovod'))} | "
                 f"{cell(by.get('none'))} | " + ("—" if best is None else
                                                f"`{best['method']}`, {best['time_to_target_s']:.1f}s, "
                                                f"{common.fmt_metric(w.metric, best['final'])}")
                 + f" | {', '.join(f'`{m}`' for m in miss) or 'none'} |")
        summary.append({"workload": w.name, "best": best and best["method"], "not_reaching": miss})
        loc = by.get("local:period=8")
        if loc is not None:
            for tech in ("adaptive:min=1,max=32", "adaptive:min=1,max=32,balance=1", "event"):
                r = by.get(tech)
                if r is None:
                    continue
                lt, tt = loc.get("time_to_target_s"), r.get("time_to_target_s")
                if tt is not None and (lt is None or tt < lt):
                    verdict = "wins" if lt is None else f"wins ({lt / tt:.2f}x faster to target)"
                elif tt is None and lt is None:
                    verdict = "neither reaches the target"
                elif tt is None:
                    verdict = "loses (does not reach the target; local SGD does)"
                else:
                    verdict = f"loses ({lt / tt:.2f}x of local SGD's speed to target)"
                summary[-1].setdefault("vs_local", {})[tech] = verdict
    L += ["", "Sync strategies against local SGD (`local:period=8`) in time to target:", "",
          "| workload | technique | time to target | local:period=8 | epochs to target (technique / local) | "
          "final vs local | verdict (time) |", "|---|---|---|---|---|---|---|"]
    for d, srow in zip(docs, summary):
        w = get_workload(d["workload"])
        by = {r["method"]: r for r in d["rows"] if r["status"] == "ok"}
        for tech, verdict in (srow.get("vs_local") or {}).items():
            r, loc = by[tech], by["local:period=8"]
            diff = (r["final"] - loc["final"]) * (1 if w.higher_is_better else -1)
            eps = f"{r['epochs_to_target'] or '—'} / {loc['epochs_to_target'] or '—'}"
            L.append(f"| `{w.name}` | `{tech}` | {_fmt_t(r['time_to_target_s'])} | {_fmt_t(loc['time_to_target_s'])} "
                     f"| {eps} | " + (f"{100 * diff:+.2f} pt" if w.metric == "acc" else f"{diff:+.3f}")
                     + f" | {verdict} |")
    loads = [(d["workload"], (d.get("machine") or {}).get("loadavg_start")) for d in docs]
    L += ["", "Load average (1/5/15 min) when each workload's last run was assembled: "
          + "; ".join(f"`{n}` {' / '.join(f'{x:.1f}' for x in la)}" for n, la in loads if la)
          + ". On a 2-core machine a load far above 2 means the seconds measure CPU contention as much as the "
            "method; epochs to target and final quality do not depend on it."]
    out = common.RESULTS / "convergence_workloads"
    common.write_json(out.with_suffix(".json"), {"title": "Convergence on various workloads: summary",
                                                 "command": "python benchmarks/convergence.py --workload NAME "
                                                            "(each workload)", "rows": summary,
                                                 "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")})
    out.with_suffix(".md").write_text("\n".join(L) + "\n")


def _fmt_t(t):
    return "not reached" if t is None else f"{t:.1f}s"


def compare_to_baselines(doc, w) -> None:
    """Per row: final metric minus none's and horovod's (sign: positive = better), time to target
    relative to horovod's and to local:period=8's (when those reached it)."""
    by = {r["method"]: r for r in doc["rows"] if r["status"] == "ok"}
    sign = 1.0 if w.higher_is_better else -1.0
    for r in doc["rows"]:
        if r["status"] != "ok":
            continue
        for base in ("none", "horovod"):
            b = by.get(base)
            r[f"better_than_{base}"] = None if b is None else sign * (r["final"] - b["final"])
        for base in ("horovod", "local:period=8"):
            b = by.get(base)
            key = "speedup_to_target_vs_" + common.slug(base)
            if b and b.get("time_to_target_s") and r.get("time_to_target_s"):
                r[key] = b["time_to_target_s"] / r["time_to_target_s"]
            else:
                r[key] = None


def workload_markdown(doc, w) -> str:
    info = doc.get("workload_info") or {}
    m = w.metric
    unit = "test accuracy" if m == "acc" else "held-out loss, nats/byte (lower is better)"
    tgt = common.fmt_metric(m, w.target)
    L = [f"Workload `{w.name}`: {info.get('description', w.description)}; {doc['ranks']} ranks, "
         f"{info.get('epochs')} epochs x {info.get('steps', 0) // max(info.get('epochs') or 1, 1)} steps, batch "
         f"{info.get('batch')} per rank, {info.get('optimizer')} lr {info.get('lr')} (one-cycle), unshaped loopback; "
         f"metric: {unit}; target {tgt}.", ""]
    if info.get("skew") is not None:
        L.append(f"Non-IID: label skew {info['skew']} (each class's home rank holds that fraction of it); "
                 f"label histograms per rank: {info.get('shard_label_histograms')}.")
    if info.get("slow_rank") is not None:
        slow = info["slow_rank"] if isinstance(info["slow_rank"], list) else [info["slow_rank"]]
        L.append(f"Straggler{'s' if len(slow) > 1 else ''}: rank{'s' if len(slow) > 1 else ''} "
                 f"{' and '.join(map(str, slow))} take{'' if len(slow) > 1 else 's'} {info['slow_factor']}x as "
                 "long per step "
                 f"(sleeps (f-1) x its measured forward+backward time).")
    if info.get("corpus"):
        c = info["corpus"]
        L.append(f"Corpus: {c['files']} standard-library modules `{c['first']}`..`{c['last']}` from `{c['source']}`, "
                 f"{c['bytes']} bytes (sha256 `{c['sha256'][:16]}...`), last {c['heldout_bytes']} bytes held out.")
    L += ["", f"| method | final {m} | vs `none` | vs `horovod` | time to {tgt} | epochs to {tgt} | "
              "speed-up to target vs horovod | vs local:period=8 | train time | bytes vs dense | exchanges/rank |",
          "|---|---|---|---|---|---|---|---|---|---|---|"]
    d = (lambda v: "—" if v is None else f"{100 * v:+.2f} pt") if m == "acc" else         (lambda v: "—" if v is None else f"{v:+.3f}")
    x = lambda v: "—" if v is None else f"{v:.2f}x"  # noqa: E731
    for r in doc["rows"]:
        if r["status"] != "ok":
            L.append(f"| `{r['method']}` | failed: {r.get('reason', '')[:80]} |  |  |  |  |  |  |  |  |  |")
            continue
        ep = "—" if r["epochs_to_target"] is None else (f"{r['epochs_to_target']}" +
                                                       (" (after finish)" if r.get("target_after_finish") else ""))
        L.append(f"| `{r['method']}` | {common.fmt_metric(m, r['final'])} | {d(r.get('better_than_none'))} | "
                 f"{d(r.get('better_than_horovod'))} | {_fmt_t(r['time_to_target_s'])} | {ep} | "
                 f"{x(r.get('speedup_to_target_vs_horovod'))} | {x(r.get('speedup_to_target_vs_local_period=8'))} | "
                 f"{r['train_time_s']:.1f}s | {r['bytes_ratio_vs_dense']:.4f} | {r['exchanges']:.0f} |")
    bn = [r for r in doc["rows"] if r["status"] == "ok" and r.get("buffer_spread_per_epoch")]
    if bn:
        L += ["", "BatchNorm running statistics: relative spread across ranks at each epoch end before averaging "
                  "(max |b_rank - b_mean| / max |b_mean|), and after the run's final averaging:", "",
              "| method | spread per epoch | final spread | final param spread |", "|---|---|---|---|"]
        for r in bn:
            L.append(f"| `{r['method']}` | {', '.join(f'{v:.3g}' for v in r['buffer_spread_per_epoch'])} | "
                     f"{r['final_buffer_spread']:.1e} | {r['final_param_spread']:.1e} |")
    L += ["", f"Per-epoch {m} (cumulative training seconds); the last point is after `finish()` "
              "(all ranks identical):", "",
          "| method | " + " | ".join(f"ep {i + 1}" for i in range(info.get("epochs") or 0)) + " | final |",
          "|---|" + "---|" * ((info.get("epochs") or 0) + 1)]
    for r in doc["rows"]:
        if r["status"] == "ok":
            L.append(f"| `{r['method']}` | " + " | ".join(f"{common.fmt_metric(m, v)} @ {t:.0f}s" for t, v in r["curve"])
                     + " |")
    for p in doc.get("plots", []):
        L += ["", f"![{Path(p).stem}](results/{p})"]
    L += ["", "Time to target: cumulative training seconds (evaluation excluded) at the first epoch end whose "
              "metric meets the target, on rank 0's clock; `event` evaluates the parameter server's z at rank 0's "
              "epoch ends. Command per row: "
              "`horovodrun -np 2 --gloo python benchmarks/workload_train.py --workload NAME <method args>` "
              "(`mpirun -np 2` for event); all rows: " f"`{doc['command']}`.", ""]
    return "\n".join(L)


def plot(doc, w, png: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as e:  # noqa: BLE001
        print(f"no plot: matplotlib unavailable ({e})")
        return False
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for r in doc["rows"]:
        if r["status"] != "ok":
            continue
        t = [c[0] for c in r["curve"]]
        v = [100 * c[1] if w.metric == "acc" else c[1] for c in r["curve"]]
        ls = "--" if r["method"] in ("horovod", "none") else "-"
        ax.plot(t, v, marker="o", ms=3, label=r["method"], ls=ls)
        ax2.plot(range(1, len(v)), v[:-1], marker="o", ms=3, label=r["method"], ls=ls)  # epoch ends
    for a_ in (ax, ax2):
        a_.axhline(100 * w.target if w.metric == "acc" else w.target, color="gray", lw=0.8, ls=":")
        a_.set_ylabel("test accuracy %" if w.metric == "acc" else "held-out loss (nats/byte)")
        a_.grid(alpha=0.3)
    ax.set_xlabel("training seconds (rank 0 clock; last point after finish())")
    ax2.set_xlabel("epoch")
    ax.set_title(f"{w.name}: {doc['ranks']} ranks, vs time")
    ax2.set_title(f"{w.name}: vs epoch")
    ax2.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return True


if __name__ == "__main__":
    sys.exit(main())
