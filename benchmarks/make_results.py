#!/usr/bin/env python
"""Generate benchmarks/RESULTS.md from the benchmark JSON files (never edit RESULTS.md by hand).

    python benchmarks/make_results.py                       # reads benchmarks/results/*.json
    python benchmarks/make_results.py --extra other.json    # also append another benchmark's JSON

Sections: how to reproduce (the exact commands recorded in the JSON), the
machine, the training comparison (compare.json, then compare_quick.json),
throughput (synthetic.json, synthetic_quick.json), and "Other benchmarks":
every other ``*.json`` in the results folder plus ``--extra`` files, e.g.
bench_kernels.json. To add a benchmark there, write ``NAME.json`` (and, if you
like, ``NAME.md`` with its table) into benchmarks/results/ and rerun this
script. For such a file the section shows, in this order of preference: the
sibling ``NAME.md``; the JSON's ``"markdown"`` string; a table of its ``"rows"``
(list of flat dicts); else the JSON itself. Optional keys used when present:
``title``, ``command``, ``date``/``date_utc``, ``machine``, ``note``.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402

HERE = Path(__file__).resolve().parent
OWN = {"compare.json", "compare_quick.json", "synthetic.json", "synthetic_quick.json"}


def rel(path: Path, start: Path) -> str:
    return os.path.relpath(path, start).replace(os.sep, "/")


def load(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        print(f"make_results: skipping {path}: {e}", file=sys.stderr)
        return None


def machine_lines(m: dict) -> list:
    keys = [("date_utc", "date"), ("host", "host"), ("cpu", "CPU"), ("cpus", "CPU cores"), ("mem_gib", "memory GiB"),
            ("kernel", "kernel"), ("python", "python"), ("torch", "torch"), ("horovod", "horovod"),
            ("git_commit", "git commit"), ("git_dirty", "uncommitted changes"),
            ("loadavg_start", "load average at start"), ("loadavg_end", "load average at end")]
    out = ["| | |", "|---|---|"]
    for k, label in keys:
        if k in m and m[k] is not None:
            v = m[k]
            if isinstance(v, list):
                v = " / ".join(f"{x:.2f}" for x in v)
            out.append(f"| {label} | {v} |")
    return out


def load_warning(m: dict) -> list:
    la = [x for x in (m.get("loadavg_start"), m.get("loadavg_end")) if x]
    cpus = m.get("cpus") or 1
    if la and max(x[0] for x in la) > cpus:
        return ["", f"> Note: the 1-minute load average exceeded the {cpus} CPU cores during this run "
                    f"({', '.join(f'{x[0]:.1f}' for x in la)}): timings are noisy; rerun on a quiet machine."]
    return []


def section_compare(doc, path: Path, out_dir: Path) -> list:
    import compare

    cfg = doc["config"]
    lines = [f"### {'Quick' if cfg.get('quick') else 'Full'} run — `{path.name}`", "",
             f"Command: `{doc.get('command', '?')}`  ", f"Date: {doc['machine'].get('date_utc', '?')}; "
             f"model {cfg.get('model')}, data {cfg.get('data')}, {cfg['ranks']} ranks, batch {cfg['batch_per_rank']} "
             f"per rank, lr {cfg['lr']} (one-cycle), {cfg['epochs']} epochs; loopback tbf {cfg['rate']} "
             f"(latency {cfg['tbf_latency']}, burst {cfg.get('tbf_burst')})"
             + (f"; rank {cfg['slow_rank']} {cfg['slow_factor']}x slower" if cfg.get("slow_rank") is not None else "")
             + ("" if not doc.get("partial") else " — **partial run (interrupted)**"), ""]
    lines += compare.markdown(doc).splitlines()
    lines += load_warning(doc["machine"])
    for p in doc.get("plots", []):
        f = path.parent / Path(p).name  # plots sit next to their JSON
        if f.exists():
            lines += ["", f"![{f.stem}]({rel(f, out_dir)})"]
    notes = doc.get("notes")
    if notes:
        lines += ["", "Definitions: " + "; ".join(notes) + "."]
    return lines + [""]


def section_synthetic(doc, path: Path) -> list:
    import synthetic

    lines = [f"### {'Quick' if 'quick' in path.stem else 'Full'} run — `{path.name}`", "",
             f"Command: `{doc.get('command', '?')}`  ", f"Date: {doc['machine'].get('date_utc', '?')}", ""]
    lines += synthetic.markdown(doc).splitlines()
    lines += load_warning(doc["machine"])
    return lines + [""]


def section_other(doc, path: Path) -> list:
    title = (doc.get("title") or doc.get("benchmark") or path.stem) if isinstance(doc, dict) else path.stem
    lines = [f"### {title} — `{path.name}`", ""]
    if isinstance(doc, dict):
        if doc.get("command"):
            lines.append(f"Command: `{doc['command']}`  ")
        date = doc.get("date") or doc.get("date_utc") or (doc.get("machine") or {}).get("date_utc")
        if date:
            lines.append(f"Date: {date}  ")
        for k in ("device", "device_name", "torch"):
            if doc.get(k):
                lines.append(f"{k}: {doc[k]}  ")
        if doc.get("note"):
            lines.append(f"Note: {doc['note']}  ")
        lines.append("")
    md = path.with_suffix(".md")
    if md.exists():
        lines += md.read_text().rstrip().splitlines()
    elif isinstance(doc, dict) and isinstance(doc.get("markdown"), str):
        lines += doc["markdown"].rstrip().splitlines()
    elif isinstance(doc, dict) and isinstance(doc.get("rows"), list) and doc["rows"] \
            and all(isinstance(r, dict) for r in doc["rows"]):
        keys = list(dict.fromkeys(k for r in doc["rows"] for k in r if not isinstance(r[k], (dict, list))))
        lines += ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
        for r in doc["rows"]:
            lines.append("| " + " | ".join(_cell(r.get(k)) for k in keys) + " |")
    else:
        text = json.dumps(doc, indent=1)
        if len(text) > 4000:
            text = text[:4000] + "\n... (truncated)"
        lines += ["```json", text, "```"]
    return lines + [""]


def _cell(v) -> str:
    if v is None:
        return "—"
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def build(results: Path, out: Path, extra) -> str:
    files = sorted(p for p in results.glob("*.json") if p.is_file()) if results.exists() else []
    by_name = {p.name: p for p in files}
    docs = {p.name: load(p) for p in files}
    out_dir = out.parent
    now = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    used = [n for n in ("compare.json", "compare_quick.json", "synthetic.json", "synthetic_quick.json")
            if docs.get(n)]
    # convergence on the workloads beyond MNIST-1D: the summary, then one file per workload
    workloads = [p for p in files if (p.name == "convergence_workloads.json" or p.name.startswith("workload_"))
                 and docs.get(p.name) is not None]
    workloads.sort(key=lambda p: (p.name != "convergence_workloads.json", p.name))
    others = [p for p in files if p.name not in OWN and p not in workloads and docs.get(p.name) is not None] + \
             [Path(e).resolve() for e in extra]
    L = ["# hvd_ext benchmark results", "",
         f"Generated by `python benchmarks/make_results.py` on {now} from "
         + (", ".join(f"`{rel(by_name[n], out_dir)}`" for n in used) or "no benchmark JSON yet")
         + (", " + ", ".join(f"`{rel(p, out_dir)}`" for p in workloads + others) if workloads + others else "")
         + ". Do not edit by hand: rerun the benchmarks, then this script.", ""]

    L += ["## How to reproduce", "",
          "On a quiet machine (root; iproute2 for the shaped namespace):", "", "```bash",
          "source .venv/bin/activate && source scripts/env.sh",
          "python benchmarks/compare.py            # training comparison, ~15-20 min on 2 cores",
          "python benchmarks/synthetic.py          # throughput, ~12 min on 2 cores",
          "python benchmarks/make_results.py       # this file", "```", ""]
    cmds = [(n, docs[n].get("command")) for n in used if docs[n].get("command")]
    if cmds:
        L += ["Commands that produced the figures below:", ""] + [f"- `{c}` → `{n}`" for n, c in cmds] + [""]

    L += ["## Machine", ""]
    seen = set()
    for n in used:
        m = docs[n].get("machine", {})
        key = (m.get("host"), m.get("cpu"), m.get("torch"), m.get("horovod"))
        if key in seen:
            L.append(f"`{n}`: same machine, {m.get('date_utc', '?')}.")
            L.append("")
            continue
        seen.add(key)
        L += [f"`{n}`:", ""] + machine_lines(m) + [""]
    L += ["The shaped network: a network namespace per job whose loopback has one `tc tbf` qdisc "
          "(`scripts/shaped-cluster`), shared by all ranks, so the configured rate is the aggregate link. "
          "Horovod runs with the Gloo controller (TCP over loopback), DDP with gloo; MPI jobs are forced onto TCP "
          "over `lo` (shared memory would bypass the shaper). `netem` is not available here, so no propagation "
          "delay is added; tbf `latency` is only the queue bound.", ""]

    L += ["## Training comparison (MNIST-1D CNN, shaped loopback)", ""]
    got = False
    for n in ("compare.json", "compare_quick.json"):
        if docs.get(n):
            L += section_compare(docs[n], by_name[n], out_dir)
            got = True
    if not got:
        L += ["No results yet: run `python benchmarks/compare.py`.", ""]

    L += ["## Throughput (synthetic data, SyntheticNet 10.7M parameters)", ""]
    got = False
    for n in ("synthetic.json", "synthetic_quick.json"):
        if docs.get(n):
            L += section_synthetic(docs[n], by_name[n])
            got = True
    if not got:
        L += ["No results yet: run `python benchmarks/synthetic.py`.", ""]

    if workloads:
        L += ["## Convergence on various workloads", "",
              "`python benchmarks/convergence.py --workload NAME` (workloads in `hvd_ext/examples/workloads.py`): "
              "time and epochs to a target and final quality per method, against `none` and plain Horovod.", ""]
        for p in workloads:
            L += section_other(docs[p.name], p)

    L += ["## Other benchmarks", "",
          "Every other JSON in `benchmarks/results/` (and `--extra` files) is appended here; see the docstring of "
          "`benchmarks/make_results.py` for the format.", ""]
    for p in others:
        d = docs.get(p.name) if p.parent == results.resolve() else load(p)
        if d is not None:
            L += section_other(d, p)
    if not others:
        L += ["(none yet)", ""]
    return "\n".join(L).rstrip() + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--results", default=str(common.RESULTS), help="folder with the benchmark JSON files")
    ap.add_argument("--out", default=str(HERE / "RESULTS.md"))
    ap.add_argument("--extra", nargs="*", default=[], help="more benchmark JSON files for 'Other benchmarks'")
    a = ap.parse_args(argv)
    out = Path(a.out).resolve()
    text = build(Path(a.results).resolve(), out, a.extra)
    out.write_text(text)
    print(f"wrote {out} ({len(text.splitlines())} lines)")


if __name__ == "__main__":
    main()
