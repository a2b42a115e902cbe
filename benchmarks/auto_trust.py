#!/usr/bin/env python
"""Can ``compression="auto"`` be trusted in a loop it was not tuned on? Against Horovod, Horovod fp16 and
the fixed codecs, quiet and under load.

    python benchmarks/auto_trust.py                                  # every loop, rate and seed (hours)
    python benchmarks/auto_trust.py --loops cnn-sgd --rates unshaped 300mbit --seeds 0 1 2 3
    python benchmarks/auto_trust.py --loops cnn-sgd --rates unshaped --seeds 0 1 --load hog
    python benchmarks/auto_trust.py --summarize                      # rebuild the table from the runs

Every job is ``benchmarks/user_loop.py`` (a plain Horovod loop: constant learning rate, Horovod's
broadcast recipe; loops ``cnn-sgd``, ``cnn-adam``, ``resnet``, ``lm``), 2 ranks under ``horovodrun
--gloo`` in a namespace of ``scripts/shaped-cluster`` (``unshaped``, or loopback shaped to the rate).
For each loop, rate, load and seed the methods run one after the other, their order rotated by the
seed, so every ratio comes from neighbouring jobs on one machine.

``--load hog`` starts one busy process per core before each job and stops it after (in a
``finally``; each hog also ends by itself after ``--timeout`` seconds). The load average is recorded
with every job.

Per loop, rate and load the table gives, over the seeds: ms/step, final metric (mean and range),
time to target (Horovod's final metric, within 0.5 point / 0.02 nats per byte) and auto's choices;
then the issue's ratios: auto's metric against ``none``'s, its step against the faster of Horovod
and Horovod fp16, against the fastest fixed codec whose accuracy is within 0.5 point of ``none``,
and its time to target against Horovod's. Writes OUT.json (every run) and OUT.md.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import common  # noqa: E402

METHODS = ["horovod", "horovod:fp16", "none", "fp16", "qsgd:bits=8", "topk:ratio=0.03", "auto"]
LOOPS = ["cnn-sgd", "cnn-adam", "resnet", "lm"]
FIXED = ["none", "fp16", "qsgd:bits=8", "topk:ratio=0.03"]
ACC_SLACK = {"acc": 0.005, "loss": 0.02}  # the "within 0.5 point" / "0.02 nats per byte"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--loops", nargs="+", default=LOOPS, choices=LOOPS)
    p.add_argument("--rates", nargs="+", default=["unshaped", "300mbit"])
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2, 3])
    p.add_argument("--load", nargs="+", default=["quiet"], choices=["quiet", "hog"])
    p.add_argument("--methods", nargs="+", default=METHODS)
    p.add_argument("--epochs", type=int, default=None, help="default: each loop's")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per job")
    p.add_argument("--out", default=str(common.RESULTS / "auto_trust"))
    p.add_argument("--summarize", action="store_true")
    common.add_load_option(p)
    return p.parse_args(argv)


def start_hog(seconds: float) -> List[subprocess.Popen]:
    """One busy process per core, each ending by itself after ``seconds``."""
    code = f"import time\nend = time.time() + {seconds}\nwhile time.time() < end: pass\n"
    return [subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.DEVNULL)
            for _ in range(os.cpu_count() or 1)]


def stop_hog(procs: List[subprocess.Popen]) -> None:
    for p in procs:
        p.kill()
    for p in procs:
        p.wait()


def run_one(loop: str, method: str, rate: str, load: str, seed: int, a, logs: Path) -> Dict:
    tag = common.slug(f"{loop}_{rate}_{load}_s{seed}_{method}")
    js = logs / f"{tag}.json"
    cmd = common.shaped_prefix(rate) + common.hvd_launcher(2) + [
        common.PY, str(HERE / "user_loop.py"), "--loop", loop, "--method", method, "--seed", str(seed),
        "--json", str(js)] + (["--epochs", str(a.epochs)] if a.epochs else [])
    hog = start_hog(a.timeout) if load == "hog" else []
    try:
        time.sleep(0.5 if hog else 0.0)
        load_before = common.loadavg()
        r = common.run_job(cmd, logs / f"{tag}.log", a.timeout)
    finally:
        stop_hog(hog)
    row = {"loop": loop, "method": method, "rate": rate, "load": load, "seed": seed, "rc": r["rc"],
           "wall_s": r["wall_s"], "loadavg": load_before}
    if r["rc"] == 0 and js.exists():
        row.update(json.loads(js.read_text()))
    else:
        row["error"] = r["tail"]
    return row


def time_to(history: List[Dict], target: float, metric: str) -> Optional[float]:
    for h in history:
        if (h["metric"] >= target) if metric == "acc" else (h["metric"] <= target):
            return h["train_s"]
    return None


def summarize(runs: List[Dict]) -> Dict:
    """Per (loop, rate, load): per-method means over seeds, and the issue's ratios."""
    groups: Dict[tuple, List[Dict]] = {}
    for r in runs:
        groups.setdefault((r["loop"], r["rate"], r["load"]), []).append(r)
    out = []
    for (loop, rate, load), rs in sorted(groups.items()):
        ok = [r for r in rs if "final" in r]
        if not ok:
            continue
        metric = ok[0]["metric"]
        slack = ACC_SLACK[metric]
        better = (lambda x, y: x >= y) if metric == "acc" else (lambda x, y: x <= y)
        hvd_final = [r["final"] for r in ok if r["method"] == "horovod"]
        target = None
        if hvd_final:
            ref = statistics.mean(hvd_final)
            target = ref - slack if metric == "acc" else ref + slack
        methods: Dict[str, Dict] = {}
        for m in dict.fromkeys(r["method"] for r in rs):
            mr = [r for r in ok if r["method"] == m]
            failed = len([r for r in rs if r["method"] == m]) - len(mr)
            if not mr:
                methods[m] = {"failed": failed}
                continue
            tts = [time_to(r["history"], target, metric) for r in mr] if target is not None else []
            methods[m] = {
                "seeds": [r["seed"] for r in mr], "failed": failed,
                "ms_per_step": statistics.mean(r["ms_per_step"] for r in mr),
                "final": statistics.mean(r["final"] for r in mr),
                "final_min": min(r["final"] for r in mr), "final_max": max(r["final"] for r in mr),
                "reached": sum(t is not None for t in tts),
                "time_to_target_s": statistics.mean(t for t in tts if t is not None) if any(
                    t is not None for t in tts) else None,
                "bytes_per_step": statistics.mean(r["bytes_sent_per_step"] for r in mr)
                if all(r.get("bytes_sent_per_step") is not None for r in mr) else None,
                "loadavg": [r["loadavg"][0] for r in mr if r.get("loadavg")],
                "auto_choices": [r["auto"]["choice"] for r in mr if r.get("auto")],
            }
        ratios: Dict[str, Optional[float]] = {}
        a, none = methods.get("auto", {}), methods.get("none", {})
        if "final" in a and "final" in none:
            ratios["auto_minus_none"] = a["final"] - none["final"]
        hv = [methods[m]["ms_per_step"] for m in ("horovod", "horovod:fp16") if "ms_per_step" in methods.get(m, {})]
        if "ms_per_step" in a and hv:
            ratios["auto_step_vs_best_horovod"] = a["ms_per_step"] / min(hv)
        if "final" in none:
            eligible = [m for m in FIXED if "final" in methods.get(m, {})
                        and better(methods[m]["final"] + (slack if metric == "acc" else -slack), none["final"])]
            if eligible and "ms_per_step" in a:
                fastest = min(eligible, key=lambda m: methods[m]["ms_per_step"])
                ratios["fastest_accurate_fixed"] = fastest
                ratios["auto_step_vs_fastest_accurate_fixed"] = a["ms_per_step"] / methods[fastest]["ms_per_step"]
        h = methods.get("horovod", {})
        if a.get("time_to_target_s") and h.get("time_to_target_s"):
            ratios["auto_time_to_target_vs_horovod"] = a["time_to_target_s"] / h["time_to_target_s"]
        out.append({"loop": loop, "rate": rate, "load": load, "metric": metric, "target": target,
                    "methods": methods, "ratios": ratios})
    return {"groups": out}


def markdown(summary: Dict, machine: Dict) -> str:
    lines = ["# auto in loops it was not tuned on (`benchmarks/auto_trust.py`)", "",
             f"Machine: {machine.get('cpus')} cores, {machine.get('cpu', '?')}, torch {machine.get('torch')}, "
             f"horovod {machine.get('horovod')}, commit {machine.get('git_commit')}"
             f"{' (dirty)' if machine.get('git_dirty') else ''}, {machine.get('date_utc')}.", ""]
    for g in summary["groups"]:
        unit = "acc %" if g["metric"] == "acc" else "nats/byte"
        scale = 100.0 if g["metric"] == "acc" else 1.0
        tgt = "—" if g["target"] is None else f"{g['target'] * scale:.2f}"
        lines += [f"## {g['loop']}, {g['rate']}, {g['load']} (target {tgt} {unit})", "",
                  f"| method | seeds | ms/step | final {unit} (min–max) | reached target | time to target s | "
                  "bytes/step | load avg | auto's choices |", "|---|---|---|---|---|---|---|---|---|"]
        for m, s in g["methods"].items():
            if "final" not in s:
                lines.append(f"| {m} | failed {s['failed']} | | | | | | | |")
                continue
            la = s["loadavg"]
            choices = "; ".join(sorted({"+".join(dict.fromkeys(c)) for c in s["auto_choices"]}))
            lines.append(
                f"| {m} | {len(s['seeds'])} | {s['ms_per_step']:.1f} | {s['final'] * scale:.2f} "
                f"({s['final_min'] * scale:.2f}–{s['final_max'] * scale:.2f}) | {s['reached']}/{len(s['seeds'])} | "
                f"{common.fmt(s['time_to_target_s'])} | {common.fmt_bytes(s['bytes_per_step'])} | "
                f"{(f'{min(la):.1f}–{max(la):.1f}' if la else '—')} | {choices} |")
        r = g["ratios"]
        parts = []
        if "auto_minus_none" in r:
            parts.append(f"auto − none: {r['auto_minus_none'] * scale:+.2f} {unit}")
        if "auto_step_vs_best_horovod" in r:
            parts.append(f"auto step / best of Horovod, Horovod fp16: {r['auto_step_vs_best_horovod']:.2f}")
        if "auto_step_vs_fastest_accurate_fixed" in r:
            parts.append(f"auto step / fastest accurate fixed ({r['fastest_accurate_fixed']}): "
                         f"{r['auto_step_vs_fastest_accurate_fixed']:.2f}")
        if "auto_time_to_target_vs_horovod" in r:
            parts.append(f"auto time to target / Horovod's: {r['auto_time_to_target_vs_horovod']:.2f}")
        lines += ["", "; ".join(parts) + ".", ""]
    return "\n".join(lines) + "\n"


def main(argv=None):
    a = parse_args(argv)
    common.refuse_if_loaded(a)
    out = Path(a.out)
    logs = out.parent / (out.name + "_logs")
    runs_file = out.with_suffix(".json")
    old = json.loads(runs_file.read_text()) if runs_file.exists() else {}
    runs: List[Dict] = old.get("runs", [])
    machine = old.get("machine") or common.machine_info()
    if not a.summarize:
        why = common.check_testbed()
        if why:
            sys.exit(f"auto_trust: {why}")
        machine = common.machine_info()
        for loop in a.loops:
            for rate in a.rates:
                for load in a.load:
                    for seed in a.seeds:
                        k = seed % len(a.methods)
                        for m in a.methods[k:] + a.methods[:k]:
                            row = run_one(loop, m, rate, load, seed, a, logs)
                            runs = [r for r in runs if (r["loop"], r["method"], r["rate"], r["load"], r["seed"])
                                    != (loop, m, rate, load, seed)] + [row]
                            common.write_json(runs_file, {"machine": machine, "commands": old.get("commands", []),
                                                          "runs": runs})
                            print(f"{loop} {rate} {load} s{seed} {m}: "
                                  + (f"{row['final']:.4f} {row['ms_per_step']:.1f} ms/step "
                                     f"load {row['loadavg'][0]:.1f}" if "final" in row else "FAILED"), flush=True)
    commands = old.get("commands", [])
    if not a.summarize:  # the invocations whose runs the file holds (later ones replace earlier runs)
        commands = commands + ["python benchmarks/auto_trust.py " + " ".join(sys.argv[1:])]
    summary = summarize(runs)
    common.write_json(runs_file, {"title": "compression=auto in loops it was not tuned on", "machine": machine,
                                  "command": "; ".join(commands), "commands": commands,
                                  "summary": summary, "runs": runs})
    out.with_suffix(".md").write_text(markdown(summary, machine))
    print(out.with_suffix(".md").read_text())


if __name__ == "__main__":
    main()
