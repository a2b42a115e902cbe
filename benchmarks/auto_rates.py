"""compression="auto" against the fixed candidates at several link rates (README, "compression=\"auto\"").

    python benchmarks/auto_rates.py                       # 4 rates x 7 methods x 8 epochs, ~15 min
    python benchmarks/auto_rates.py --rates 300mbit --seeds 0 1 2
    python benchmarks/auto_rates.py --summarize           # rebuild the table from the JSON files
    python benchmarks/auto_rates.py --engine ddp --rates unshaped 300mbit --seeds 1 2 3 --no-horovod

For every rate (and seed) it runs ``benchmarks/compare.py --no-baselines --methods horovod none
auto <fixed candidates> --epochs E --rate R --seed S`` (one job after the other, so the ratios come
from one run on one machine) into ``OUT_<rate>[_s<seed>].json``, then writes ``OUT.md`` / ``OUT.json``:
per rate, auto's step time and accuracy against the best fixed candidate by step time and by time to
the target accuracy, and its accuracy against ``none``'s. With several seeds, step times are the
mean over seeds and accuracies the mean and the range (one seed's final accuracy after 8 epochs
moves by 1-2 points, and a seed can diverge for ``none`` itself).

``--engine ddp``: the same on PyTorch DDP -- ``ddp+auto`` (hvd_ext's hook) against DDP's own
``ddp`` (allreduce, the reference in ``none``'s place) and ``ddp:fp16`` by default, held to 1.05x the
faster (1.10x on Horovod; docs/recipes.md, PyTorch DDP).
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
FIXED = ["none", "fp16", "qsgd:bits=8", "topk:ratio=0.03", "topk:ratio=0.01"]
# per engine: auto's method, the uncompressed reference, the fixed methods by default, the step-time bar
ENGINES = {"horovod": ("auto", "none", FIXED, 1.10), "ddp": ("ddp+auto", "ddp", ["ddp", "ddp:fp16"], 1.05)}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rates", nargs="+", default=["100mbit", "300mbit", "1gbit", "unshaped"])
    p.add_argument("--seeds", nargs="+", type=int, default=[0])
    p.add_argument("--epochs", type=int, default=8)
    p.add_argument("--engine", choices=sorted(ENGINES), default="horovod",
                   help="horovod: auto vs hvd_ext's fixed codecs; ddp: hvd_ext's auto hook vs DDP's own hooks")
    p.add_argument("--fixed", nargs="+", default=None, help="fixed methods auto is compared with")
    p.add_argument("--out", default=None, help="default benchmarks/results/auto_rates (auto_rates_ddp with --engine ddp)")
    p.add_argument("--summarize", action="store_true", help="only rebuild OUT.md/OUT.json from the runs' JSON")
    p.add_argument("--no-horovod", action="store_true", help="leave plain Horovod out (accuracy studies)")
    a = p.parse_args(argv)
    a.auto, a.ref, fixed, a.bar = ENGINES[a.engine]
    a.fixed = a.fixed or fixed
    a.out = a.out or str(HERE / "results" / ("auto_rates" + ("_ddp" if a.engine == "ddp" else "")))
    return a


def run_file(out: str, rate: str, seed: int, seeds) -> Path:
    return Path(f"{out}_{rate}" + (f"_s{seed}" if len(seeds) > 1 else "") + ".json")


def _fmt_rate(rate: str) -> str:
    r = rate.lower()
    if r.endswith("gbit"):
        return f"{r[:-4]} Gbit/s"
    if r.endswith("mbit"):
        return f"{r[:-4]} Mbit/s"
    return r


def summarize(a) -> dict:
    rows, notes = [], []
    for rate in a.rates:
        per = {}  # method -> lists over seeds
        loads = []
        for seed in a.seeds:
            f = run_file(a.out, rate, seed, a.seeds)
            if not f.exists():
                notes.append(f"missing: {f.name}")
                continue
            d = json.load(open(f))
            for m in d["methods"]:
                r = m.get("result")
                if m.get("status") != "ok" or not r:
                    continue
                x = per.setdefault(m["method"], {"ms": [], "acc": [], "tt": [], "auto": []})
                x["ms"].append(r["ms_per_step"])
                x["acc"].append(100 * r["test_acc"])
                x["tt"].append(m.get("time_to_target_s"))
                for rep in ([r["auto"]] if isinstance(r.get("auto"), dict) else r.get("auto") or []):
                    x["auto"].append(f"{','.join(rep['choice'])} ({rep['decisions']})")  # DDP: one per DDP bucket
                loads += [v[0] for v in (m.get("loadavg_before"), m.get("loadavg_after")) if v]
        if a.auto not in per or a.ref not in per:
            continue
        mean = lambda v: statistics.mean(v)  # noqa: E731
        fixed = [f for f in a.fixed if f in per]
        best_ms = min(fixed, key=lambda f: mean(per[f]["ms"]))
        reached = [f for f in fixed if all(t is not None for t in per[f]["tt"])]
        best_tt = min(reached, key=lambda f: mean(per[f]["tt"])) if reached else None
        auto, ref = per[a.auto], per[a.ref]
        auto_tt = mean(auto["tt"]) if all(t is not None for t in auto["tt"]) else None
        row = {
            "rate": rate, "seeds": len(auto["ms"]),
            "horovod_ms": mean(per["horovod"]["ms"]) if "horovod" in per else None,
            "none_ms": mean(ref["ms"]), "none_acc": mean(ref["acc"]),
            "none_acc_range": [min(ref["acc"]), max(ref["acc"])],
            "auto_ms": mean(auto["ms"]), "auto_acc": mean(auto["acc"]),
            "auto_acc_range": [min(auto["acc"]), max(auto["acc"])], "auto_choice": auto["auto"],
            "best_ms_method": best_ms, "best_ms": mean(per[best_ms]["ms"]),
            "best_tt_method": best_tt, "best_tt": mean(per[best_tt]["tt"]) if best_tt else None,
            "auto_tt": auto_tt,
            "fixed": {f: {"ms": mean(per[f]["ms"]), "acc": mean(per[f]["acc"])} for f in fixed},
            "loadavg_1min": [min(loads), max(loads)] if loads else None,
        }
        row["auto_vs_best_ms"] = row["auto_ms"] / row["best_ms"]
        row["auto_vs_none_ms"] = row["auto_ms"] / row["none_ms"]
        row["auto_vs_best_tt"] = auto_tt / row["best_tt"] if auto_tt and row["best_tt"] else None
        row["acc_vs_none"] = row["auto_acc"] - row["none_acc"]
        rows.append(row)
    return {"rows": rows, "notes": notes}


def markdown(a, s: dict, command: str, when: str) -> str:
    seeds = f"seeds {', '.join(map(str, a.seeds))} (means; accuracy ranges in brackets)" if len(a.seeds) > 1 \
        else f"seed {a.seeds[0]}"
    au, ref = f"`{a.auto}`", f"`{a.ref}`"
    engine = " on PyTorch DDP (hvd_ext's hook against DDP's own)" if a.engine == "ddp" else ""
    lines = [f"`compression=\"auto\"`{engine} against fixed methods at {len(s['rows'])} link rates. MNIST-1D CNN, "
             f"2 ranks, {a.epochs} epochs, target 93%, {seeds}. {when}.", "",
             "Command (each rate runs `benchmarks/compare.py --no-baselines` with these methods, one job after the "
             "other, each seed starting the list one method later; per-rate tables in `auto_rates_<rate>.md`):",
             "", "```", command, "```", "",
             f"\"Best fixed\" is the best of {', '.join('`' + f + '`' for f in a.fixed)}. `horovod` is plain "
             "`hvd.DistributedOptimizer` (fp32 allreduce). auto's codec: its final choice (number of decisions).", "",
             f"| rate | horovod ms/step | {ref} ms/step · acc | {au} ms/step · acc | auto's codec | best fixed by "
             f"ms/step | best fixed by time to 93% | auto / best (ms/step · t→93%) | ≤{a.bar:.2f}× | auto / {ref} "
             f"ms/step | auto acc − {ref} acc |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in s["rows"]:
        rng = lambda v: f" [{v[0]:.2f}-{v[1]:.2f}]" if len(a.seeds) > 1 else ""  # noqa: E731
        tt = f"{r['auto_vs_best_tt']:.2f}×" if r["auto_vs_best_tt"] else "—"
        best_tt = f"{r['best_tt_method']} {r['best_tt']:.1f} s" if r["best_tt_method"] else "none reached"
        holds = "holds" if r["auto_vs_best_ms"] <= a.bar else "**miss**"
        acc = f"{r['acc_vs_none']:+.2f}" + ("" if r["acc_vs_none"] >= -0.5 else " (**miss**)")
        hvd_ms = f"{r['horovod_ms']:.1f}" if r["horovod_ms"] else "—"
        lines.append(f"| {_fmt_rate(r['rate'])} | {hvd_ms} | {r['none_ms']:.1f} · {r['none_acc']:.2f}%"
                     f"{rng(r['none_acc_range'])} | {r['auto_ms']:.1f} · {r['auto_acc']:.2f}%{rng(r['auto_acc_range'])} "
                     f"| {'; '.join(r['auto_choice'])} | {r['best_ms_method']} {r['best_ms']:.1f} | {best_tt} "
                     f"| {r['auto_vs_best_ms']:.2f}× · {tt} | {holds} | {r['auto_vs_none_ms']:.2f}× | {acc} |")
    lines += ["", "Fixed candidates, ms/step · final accuracy:", "",
              "| rate | " + " | ".join(f"`{f}`" for f in a.fixed) + " |", "|---|" + "---|" * len(a.fixed)]
    for r in s["rows"]:
        lines.append(f"| {_fmt_rate(r['rate'])} | " + " | ".join(
            f"{r['fixed'][f]['ms']:.1f} · {r['fixed'][f]['acc']:.2f}%" if f in r["fixed"] else "—" for f in a.fixed) + " |")
    if s["notes"]:
        lines += ["", "Notes: " + "; ".join(s["notes"])]
    return "\n".join(lines) + "\n"


def main(argv=None):
    a = parse_args(argv)
    methods = ([] if a.no_horovod else ["horovod"]) + [a.auto] + a.fixed
    t0 = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    if not a.summarize:
        for rate in a.rates:
            for k, seed in enumerate(a.seeds):
                out = str(run_file(a.out, rate, seed, a.seeds))[:-len(".json")]
                # the jobs run one after the other: each seed starts the list one method later, so
                # that no method always runs first (this machine's speed drifts between jobs)
                order = methods[k % len(methods):] + methods[:k % len(methods)]
                cmd = [sys.executable, str(HERE / "compare.py"), "--no-baselines", "--methods", *order,
                       "--epochs", str(a.epochs), "--rate", rate, "--seed", str(seed), "--out", out]
                print("+", " ".join(cmd), flush=True)
                subprocess.run(cmd, check=True)
    t1 = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    s = summarize(a)
    command = "python benchmarks/auto_rates.py " + " ".join(
        (["--rates", *a.rates] if a.rates != parse_args([]).rates else []) +
        (["--seeds", *map(str, a.seeds)] if a.seeds != [0] else []) +
        (["--epochs", str(a.epochs)] if a.epochs != 8 else []) + (["--engine", a.engine] if a.engine != "horovod" else []) +
        (["--fixed", *a.fixed] if a.fixed != ENGINES[a.engine][2] else []) + (["--no-horovod"] if a.no_horovod else []) +
        (["--out", a.out] if a.out != parse_args(["--engine", a.engine]).out else []))
    when = f"One 2-core VM, {t0} - {t1}" if not a.summarize else "Rebuilt from the runs' JSON"
    md = markdown(a, s, command.strip(), when)
    Path(a.out + ".md").write_text(md)
    with open(a.out + ".json", "w") as f:
        json.dump({"title": "compression=\"auto\" vs fixed methods at several link rates", "markdown": md,
                   "command": command.strip(), **s}, f, indent=1)
    print(md)


if __name__ == "__main__":
    main()
