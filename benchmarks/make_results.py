#!/usr/bin/env python
"""Generate benchmarks/RESULTS.md from the benchmark results (never edit RESULTS.md by hand).

    python benchmarks/make_results.py                       # reads benchmarks/results/*.json
    python benchmarks/make_results.py --extra other.json    # also summarize another benchmark's JSON

It also rewrites the technique status table of docs/techniques.md (``technique_status.py``).

RESULTS.md is the index: one summary table per benchmark, and under it one line per run
that links the run's own detail file (``NAME.md`` next to ``NAME.json`` in
benchmarks/results/, or the JSON itself) with its command, date, commit and the
machine's load. Everything else -- per-epoch curves, per-seed tables, plots, routes,
all variants -- stays in those detail files.

Which files make which section:

* ``compare.json`` / ``compare_quick.json``: the training comparison (its main table);
* other ``compare.py`` runs (``"benchmark": "compare"``): one merged table, one row per
  run and method -- except the per-seed runs of an ``auto_rates.py`` summary
  (``PREFIX.json`` with ``"rows"``, its runs ``PREFIX_<rate>[_s<seed>].json``), which
  appear through that summary's table only;
* ``auto_trust.json``, ``convergence.json``, ``convergence_workloads.json`` (+ ``workload_*``),
  ``defaults_check.json`` / ``thesis_sparsity.json``, ``synthetic*.json`` / ``overlap_synthetic.json``,
  ``overhead_*.json``, ``throughput.json``, ``quant_error.json``, ``scale.json``, ``bench_kernels.json``:
  a summary built for each;
* anything else (and ``--extra`` files): the first table of ``NAME.md``, else of the JSON's
  ``"markdown"``, else a table of its ``"rows"`` (list of flat dicts), capped at 25 rows.
  Optional keys used when present: ``title``, ``command``, ``date``/``date_utc``, ``machine``.

To add a benchmark, write ``NAME.json`` (and ``NAME.md`` with its tables, first the
summary) into benchmarks/results/ and rerun this script. A run superseded by a newer
run of the same benchmark is deleted (git keeps it), so the index stays short.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import re
import sys
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402

HERE = Path(__file__).resolve().parent
MAX_ROWS = 25  # generic summaries are cut here (the detail file has the rest)
NOT_RESULTS = {"throughput_baseline.json"}  # an input of throughput.py (its "before" column), not a run

Run = Tuple[Path, object]  # (json path, parsed document)


# ---- small helpers ---------------------------------------------------------------------------------------------

def rel(path: Path, start: Path) -> str:
    return os.path.relpath(path, start).replace(os.sep, "/")


def load(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        print(f"make_results: skipping {path}: {e}", file=sys.stderr)
        return None


def _cell(v) -> str:
    if v is None:
        return "—"
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v).replace("|", "\\|")


_PIPE = re.compile(r"(?<!\\)\|")


def md_tables(text: str) -> List[Dict]:
    """Every pipe table of a markdown text: {"caption": the last non-table line before it, "header", "rows"}."""
    out, caption, lines = [], "", text.splitlines()
    i = 0
    while i < len(lines):
        s = lines[i].strip()
        if s.startswith("|") and i + 1 < len(lines) and re.match(r"^\|?\s*:?-{3,}", lines[i + 1].strip()):
            split = lambda ln: [c.strip() for c in _PIPE.split(ln.strip().strip("|"))]  # noqa: E731
            header, rows = split(s), []
            i += 2
            while i < len(lines) and lines[i].strip().startswith("|"):
                rows.append(split(lines[i]))
                i += 1
            out.append({"caption": caption, "header": header, "rows": rows})
            continue
        if s:
            caption = s
        i += 1
    return out


def table(header: Sequence[str], rows: Sequence[Sequence], limit: Optional[int] = None, more: str = "") -> List[str]:
    rows = list(rows)
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    shown = rows if limit is None else rows[:limit]
    lines += ["| " + " | ".join(_cell(c) for c in r) + " |" for r in shown]
    if limit is not None and len(rows) > limit:
        lines.append(f"| … {len(rows) - limit} more rows{more} |" + " |" * (len(header) - 1))
    return lines


def columns(t: Dict, keep: Optional[Sequence[str]] = None, drop: Sequence[str] = ()) -> Tuple[List[str], List[List]]:
    """Select a parsed table's columns by name (``keep`` in that order; names not present are skipped)."""
    hdr = t["header"]
    idx = [hdr.index(k) for k in keep if k in hdr] if keep else [i for i, h in enumerate(hdr) if h not in drop]
    return [hdr[i] for i in idx], [[r[i] if i < len(r) else "" for i in idx] for r in t["rows"]]


def machine_of(doc) -> Dict:
    if not isinstance(doc, dict):
        return {}
    m = dict(doc.get("machine") or {})
    for k in ("date", "date_utc"):
        if doc.get(k) and "date_utc" not in m:
            m["date_utc"] = doc[k]
    return m


def load_text(m: Dict) -> str:
    """'load 1.1→2.4 on 2 cores' (1-minute load averages at start and end). The benchmark's own ranks load the
    machine too, so a run is marked busy only when it started above twice the core count."""
    start, end = m.get("loadavg_start"), m.get("loadavg_end")
    if not start and not end:
        return ""
    cpus = m.get("cpus")
    s = "load " + "→".join(f"{float(x[0]):.1f}" for x in (start, end) if x) + (f" on {cpus} cores" if cpus else "")
    if common.busy_load(m) is not None:
        s += " (**busy machine**: timings are noisy)"
    return s


def detail_path(path: Path) -> Path:
    md = path.with_suffix(".md")
    return md if md.exists() else path


def run_line(path: Path, doc, out_dir: Path, label: str = "Run", extra: Sequence[str] = (), show_load=True) -> str:
    """One line per run: link to its detail file, command, date, commit, load, extra links."""
    m = machine_of(doc)
    det = detail_path(path)
    parts = [f"{label}: [{det.name}]({rel(det, out_dir)})"]
    if det != path:
        parts[0] += f" ([json]({rel(path, out_dir)}))"
    cmd = doc.get("command") if isinstance(doc, dict) else None
    if isinstance(cmd, str) and cmd:
        cmd = cmd.replace(str(common.ROOT) + "/", "")
        parts.append(f"`{cmd if len(cmd) <= 160 else cmd[:157] + '...'}`")
    if m.get("date_utc"):
        parts.append(str(m["date_utc"])[:16].replace("T", " "))
    if m.get("git_commit"):
        parts.append(f"commit {m['git_commit']}" + (" (dirty)" if m.get("git_dirty") else ""))
    lt = load_text(m) if show_load else ""
    if lt:
        parts.append(lt)
    parts += list(extra)
    return "- " + " · ".join(parts)


def plot_links(path: Path, doc, out_dir: Path) -> List[str]:
    out = []
    for p in (doc.get("plots") or []) if isinstance(doc, dict) else []:
        f = path.parent / Path(p).name  # plots sit next to their JSON
        if f.exists():
            out.append(f"[{f.stem[len(path.stem) + 1:] or f.stem}]({rel(f, out_dir)})")
    return ["plots: " + ", ".join(out)] if out else []


def detail_text(path: Path, doc) -> str:
    """The run's own markdown: NAME.md, else the JSON's "markdown", else the benchmark's renderer."""
    md = path.with_suffix(".md")
    if md.exists():
        return md.read_text()
    if isinstance(doc, dict) and isinstance(doc.get("markdown"), str):
        return doc["markdown"]
    if isinstance(doc, dict) and doc.get("benchmark") == "compare":
        import compare
        return compare.markdown(doc)
    if isinstance(doc, dict) and doc.get("benchmark") == "synthetic":
        import synthetic
        return synthetic.markdown(doc)
    return ""


def is_compare(doc) -> bool:
    return isinstance(doc, dict) and doc.get("benchmark") == "compare" and isinstance(doc.get("methods"), list)


def is_auto_rates(path: Path, doc) -> bool:
    return isinstance(doc, dict) and isinstance(doc.get("rows"), list) and "auto_rates.py" in str(doc.get("command"))


# ---- sections --------------------------------------------------------------------------------------------------

def sec_compare_main(runs: List[Run], out_dir: Path) -> List[str]:
    L = []
    for path, doc in runs:
        cfg = doc["config"]
        L += [f"{cfg['ranks']} ranks, {cfg.get('model')}, {cfg.get('data')}, batch {cfg['batch_per_rank']} per rank, "
              f"lr {cfg['lr']} (one-cycle), {cfg['epochs']} epochs, loopback shaped to {cfg['rate']}"
              + (" (quick run)" if cfg.get("quick") else "") + "; ratios against plain `hvd.DistributedOptimizer` "
              "(`horovod`) in the same run.", ""]
        tabs = md_tables(detail_text(path, doc))
        if tabs:
            L += table(*columns(tabs[0], drop=("framework", "exchanges/epoch")))
        L += ["", run_line(path, doc, out_dir, extra=plot_links(path, doc, out_dir)), ""]
    return L


def sec_compare_ddp(runs: List[Run], out_dir: Path) -> List[str]:
    """``compare.py --ddp`` runs: every row, then hvd_ext on DDP against DDP's own hooks of the same run."""
    L = []
    for path, doc in runs:
        cfg = doc["config"]
        tabs = md_tables(detail_text(path, doc))
        if not tabs:
            continue
        L += [f"{cfg['ranks']} ranks, {cfg['epochs']} epochs, loopback {cfg['rate']}; DDP runs under torchrun "
              "(`scripts/train.py --engine ddp`), Horovod rows in the same run.", ""]
        L += table(*columns(tabs[0], drop=("exchanges/epoch",)))
        mine = next((t for t in tabs if t["header"] and t["header"][0] == "hvd_ext on DDP"), None)
        if mine is not None:
            L += ["", "hvd_ext on DDP against DDP's own hooks (the faster baseline where two are named):", ""]
            L += table(mine["header"], mine["rows"])
        L += ["", run_line(path, doc, out_dir, extra=plot_links(path, doc, out_dir)), ""]
    return L


def sec_compare_other(runs: List[Run], out_dir: Path) -> List[str]:
    keep = ["method", "final acc", "ms/step", "speed-up vs hvd", "bytes/step"]
    hdr, rows, links = None, [], []
    for path, doc in runs:
        tabs = md_tables(detail_text(path, doc))
        if not tabs:
            continue
        t = tabs[0]
        tt = next((h for h in t["header"] if h.startswith("time to ")), None)
        h, rs = columns(t, keep=keep + ([tt] if tt else []))
        if tt:
            h[-1] = "time to target (s)"
        hdr = hdr or ["run", "setting"] + h
        cfg = doc["config"]
        where = (f"{cfg['nodes']}x{cfg['ranks_per_node']} ranks, {cfg['rate']} between nodes" if cfg.get("nodes")
                 else f"{cfg['ranks']} ranks, {cfg['rate']}"
                 + (f", rank {cfg['slow_rank']} {cfg['slow_factor']:g}x slower" if cfg.get("slow_rank") is not None
                    else ""))
        where += f", {cfg['epochs']} epochs"
        rows += [[f"`{path.stem}`", where] + r for r in rs]
        links.append(run_line(path, doc, out_dir))
    if not rows:
        return []
    return ["Node-aware runs: the detail files also give each bucket's route and the route trial's measurements.",
            ""] + table(hdr, rows) + [""] + links + [""]


def sec_auto_rates(runs: List[Run], children: Dict[str, List[Run]], out_dir: Path) -> List[str]:
    """One table per column layout (the Horovod and the DDP summaries name their reference differently)."""
    tables: Dict[tuple, List[List]] = {}
    links = []
    for path, doc in runs:
        tabs = md_tables(detail_text(path, doc))
        if not tabs:
            continue
        seeds = sorted({(d.get("config") or {}).get("seed") for _, d in children.get(path.stem, [])} - {None})
        label = f"`{path.stem}`" + (f" (seeds {seeds[0]}-{seeds[-1]})" if len(seeds) > 1 else
                                    f" (seed {seeds[0]})" if seeds else "")
        h, rs = columns(tabs[0], drop=("≤1.10×", "≤1.05×"))
        tables.setdefault(tuple(["run"] + h), []).extend([label] + r for r in rs)
        kids = children.get(path.stem, [])
        extra = []
        if kids:
            extra.append("per-rate/seed runs: " + ", ".join(
                f"[{p.stem[len(path.stem) + 1:]}]({rel(detail_path(p), out_dir)})" for p, _ in kids))
        m = [machine_of(d) for _, d in kids]
        dates = sorted(x["date_utc"] for x in m if x.get("date_utc"))
        if dates:
            extra.append(f"{dates[0][:16]} – {dates[-1][:16]}")
        loads = [float(x["loadavg_start"][0]) for x in m if x.get("loadavg_start")]
        if loads:
            extra.append(f"load at start {min(loads):.1f}–{max(loads):.1f} on {m[0].get('cpus', '?')} cores")
        links.append(run_line(path, doc, out_dir, extra=extra))
    if not tables:
        return []
    out = ["MNIST-1D CNN, 2 ranks, 8 epochs, target 93%; each run: means over its seeds, accuracy range in brackets; "
           "\"best fixed\": the fastest fixed candidate of that run.", ""]
    for hdr, rows in tables.items():
        out += table(hdr, rows) + [""]
    return out + links + [""]


def sec_auto_trust(runs: List[Run], out_dir: Path) -> List[str]:
    L = []
    for path, doc in runs:
        groups = ((doc.get("summary") or {}).get("groups") or []) if isinstance(doc, dict) else []
        rows = []
        for g in groups:
            ms, r = g.get("methods", {}), g.get("ratios", {})
            acc = g.get("metric") == "acc"
            f = (lambda x: f"{100 * x:.2f}") if acc else (lambda x: f"{x:.3f}")  # noqa: E731
            a, n = ms.get("auto", {}), ms.get("none", {})
            step = lambda m: common.fmt(ms.get(m, {}).get("ms_per_step"), ".1f")  # noqa: E731
            choices = "; ".join(dict.fromkeys("+".join(dict.fromkeys(c)) for c in a.get("auto_choices", []) if c))
            rows.append([g["loop"], g["rate"], g["load"], len(a.get("seeds", [])), step("horovod"),
                         step("horovod:fp16"), step("auto"),
                         f"{f(a['final'])} / {f(n['final'])}" if "final" in a and "final" in n else "—",
                         common.fmt(r.get("auto_step_vs_best_horovod"), ".2f", "x"),
                         common.fmt(r.get("auto_step_vs_fastest_accurate_fixed"), ".2f", "x")
                         + (f" ({r['fastest_accurate_fixed']})" if r.get("fastest_accurate_fixed") else ""),
                         common.fmt(r.get("auto_time_to_target_vs_horovod"), ".2f", "x"), choices or "—"])
        if rows:
            L += ["Plain Horovod loops (`benchmarks/user_loop.py`), 2 ranks, constant learning rate; `quiet`: nothing "
                  "else running, `hog`: one busy process per core. Metric: test accuracy % (`lm`: held-out nats/byte, "
                  "lower is better). Ratios: auto's step against the faster of Horovod and Horovod fp16, against the "
                  "fastest fixed codec within 0.5 point of `none`, and auto's time to target against Horovod's.", ""]
            L += table(["loop", "rate", "load", "seeds", "horovod ms/step", "horovod:fp16 ms/step", "auto ms/step",
                        "auto / none final", "auto step / best Horovod", "auto step / fastest accurate fixed",
                        "auto time to target / Horovod", "auto's choices"], rows)
            L.append("")
        L += [run_line(path, doc, out_dir, extra=["per-job logs in `results/auto_trust_logs/`"], show_load=False), ""]
    return L


def sec_first_table(runs: List[Run], out_dir: Path, keep=None, drop=(), caption=None, limit=MAX_ROWS,
                    pick: Callable[[List[Dict]], Optional[Dict]] = None, lead: str = "") -> List[str]:
    """Generic: the first (or ``pick``ed) table of each run's detail markdown, or of its "rows"."""
    L = [lead, ""] if lead and runs else []
    for path, doc in runs:
        tabs = md_tables(detail_text(path, doc))
        t = (pick(tabs) if pick else tabs[0]) if tabs else None
        if t is None and isinstance(doc, dict) and isinstance(doc.get("rows"), list) and doc["rows"] \
                and all(isinstance(r, dict) for r in doc["rows"]):
            keys = list(dict.fromkeys(k for r in doc["rows"] for k in r if not isinstance(r[k], (dict, list))))
            t = {"caption": "", "header": keys, "rows": [[_cell(r.get(k)) for k in keys] for r in doc["rows"]]}
        if caption:
            L += [caption(path, doc, t) if callable(caption) else caption, ""]
        if t is not None:
            L += table(*columns(t, keep=keep, drop=drop), limit=limit, more=" in the detail file") + [""]
        L += [run_line(path, doc, out_dir, extra=plot_links(path, doc, out_dir)), ""]
    return L


def sec_defaults(runs: List[Run], out_dir: Path) -> List[str]:
    """defaults_check.py: one row per spec, SGD and Adam side by side; thesis_sparsity: its own small table."""
    L = []
    for path, doc in runs:
        tabs = md_tables(detail_text(path, doc))
        if not tabs:
            L += [run_line(path, doc, out_dir), ""]
            continue
        t = tabs[0]
        h = t["header"]
        need = ("optimizer", "spec (defaults)", "epochs", "final %", "within 1 pt at epoch", "pass")
        optims = list(dict.fromkeys(r[h.index("optimizer")] for r in t["rows"])) if "optimizer" in h else []
        if all(k in h for k in need) and len(optims) > 1:
            ix = {k: h.index(k) for k in need}
            cells: Dict[Tuple[str, str], Dict[str, str]] = {}
            for r in t["rows"]:
                key = (r[ix["spec (defaults)"]], r[ix["epochs"]])
                cells.setdefault(key, {})[r[ix["optimizer"]]] = (
                    f"{r[ix['final %']]} (ep {r[ix['within 1 pt at epoch']]}, {r[ix['pass']]})")
            rows = [[f"{spec} ({ep} epochs)"] + [c.get(o, "—") for o in optims] for (spec, ep), c in cells.items()]
            L += ["Final accuracy % of each compressor at its defaults in a plain loop (in brackets: the first epoch "
                  "within 1 point of `none`'s 8-epoch accuracy, and whether that came within 3x `none`'s epochs).", ""]
            L += table(["spec"] + optims, rows) + [""]
        else:
            if path.stem == "thesis_sparsity":
                L += ["Thesis techniques 3 (`sig`) and 4 (`ewma`) at ratio 0.001, SGD momentum 0.9, same loop:", ""]
            L += table(*columns(t, keep=need), limit=MAX_ROWS, more=" in the detail file") + [""]
        L += [run_line(path, doc, out_dir), ""]
    return L


def sec_overhead(runs: List[Run], out_dir: Path) -> List[str]:
    methods, rows, links = [], [], []
    for path, doc in runs:
        if not isinstance(doc, dict) or not isinstance(doc.get("rows"), list):
            continue
        got = {}
        for r in doc["rows"]:
            m = r.get("method")
            methods.append(m)
            v = r.get("vs_horovod")
            got[m] = f"{r['ms_per_step']:.1f}" + (f" ({v:.2f}x)" if isinstance(v, (int, float)) else "")
        what = f"{doc.get('model', '?')} {doc.get('params', 0) / 1e6:.2f}M, batch {doc.get('batch', '?')}"
        rows.append((f"`{path.stem[len('overhead_'):]}`", what, got))
        links.append(run_line(path, doc, out_dir))
    if not rows:
        return []
    methods = list(dict.fromkeys(methods))
    return ["ms per step (in brackets: against `horovod`, plain `hvd.DistributedOptimizer`, interleaved in the same "
            "job); `compute`: the same step with no exchange at all, the floor on this machine. The run's name "
            "gives the link (`300mbit`: loopback shaped to 300 Mbit/s).", ""] + \
        table(["run", "model"] + [f"`{m}`" for m in methods], [[a, b] + [g.get(m, "") for m in methods]
                                                               for a, b, g in rows]) + [""] + links + [""] + \
        ["Runs without a recorded command were made with `horovodrun -np 2 --gloo python benchmarks/overhead.py "
         "--channels 64 --batch 32 --methods METHODS --rounds 5 --steps 30 --json FILE` (main-job CNN), "
         "`... --model synthetic --batch 16 --rounds 5 --steps 10` (synthetic net), and at 300 Mbit/s the same "
         "inside `scripts/shaped-cluster --rate 300mbit --` (`--channels 212 --batch 64 --rounds 3 --steps 20` for "
         "the 0.68M CNN).", ""]


def sec_scale(runs: List[Run], out_dir: Path) -> List[str]:
    L = []
    for path, doc in runs:
        lines = doc.get("table") if isinstance(doc, dict) else None
        sizes = doc.get("sizes") if isinstance(doc, dict) else None
        if isinstance(lines, list) and sizes:
            rows = []
            for ln in lines:
                toks = ln.split()
                vals = re.findall(r"([\d.]+) \[([\d.]+)\]", ln)
                if toks and len(vals) == len(sizes):
                    rows.append([f"`{toks[0]}`"] + [f"{a} [{b}]" for a, b in vals] + [toks[-1]])
            L += ["Bytes received per rank per step / dense fp32 gradient (modelled wire bytes in brackets), "
                  "1M-parameter MLP; `exchange=auto` picks the scalable route from N = 3.", ""]
            L += table(["spec"] + [f"N={n}" for n in sizes] + [f"route at N={sizes[-1]}"], rows) + [""]
        png = path.with_suffix(".png")
        L += [run_line(path, doc, out_dir, extra=[f"plot: [{png.name}]({rel(png, out_dir)})"] if png.exists() else []),
              ""]
    return L


def sec_workloads(summary: List[Run], workloads: List[Run], out_dir: Path) -> List[str]:
    L = []
    for path, doc in summary:
        tabs = md_tables(detail_text(path, doc))
        if tabs:
            L += table(*columns(tabs[0])) + [""]
        L += [run_line(path, doc, out_dir), ""]
    for path, doc in workloads:
        L.append(run_line(path, doc, out_dir, label="Workload", extra=plot_links(path, doc, out_dir)))
    return L + ([""] if workloads else [])


# ---- the document ----------------------------------------------------------------------------------------------

REPRODUCE = [
    "python benchmarks/compare.py --quick     # < 5 min: the main methods at 300 Mbit/s (root, iproute2)",
    "python benchmarks/compare.py             # every method, 8 epochs (~15-20 min on 2 cores)",
    "python benchmarks/compare.py --ddp --rate 300mbit|unshaped  # DDP's hooks against hvd_ext on DDP",
    "python benchmarks/auto_rates.py          # auto against fixed codecs at 4 link rates",
    "python benchmarks/auto_trust.py          # auto in loops it was not tuned on, quiet and under load (hours)",
    "python benchmarks/convergence.py         # epochs to the target per method (MNIST-1D)",
    "python benchmarks/convergence.py --workload lm|resnet|mnist1d-noniid-slow",
    "python benchmarks/defaults_check.py      # every compressor at its defaults, SGD momentum and Adam",
    "python benchmarks/synthetic.py           # 10.7M-parameter throughput at 100 Mbit/s, 1 Gbit/s, unshaped",
    "horovodrun -np 2 --gloo python benchmarks/overhead.py [--model synthetic]   # per-step cost, interleaved",
    "python benchmarks/throughput.py          # codec GB/s on CPU",
    "python benchmarks/quant_error.py         # quantization error at equal wire bits on real gradients",
    "python benchmarks/scale.py               # bytes per rank as N grows, routes",
    "python benchmarks/bench_kernels.py       # CUDA kernel GB/s (GPU); torch references on CPU",
    "python benchmarks/plan_check.py --ranks 2 4 --rates 100mbit 300mbit 1gbit unshaped --nodes2x2 300mbit"
    "   # the planner, predicted / measured",
    "python benchmarks/plan_projections.py    # the planner to 1024 GPUs on the cited presets (docs/scale.md)",
    "python benchmarks/auto_plan_check.py --ranks 2 4 --rates 100mbit 1gbit unshaped --nodes2x2 300mbit"
    "   # auto in the job against the planner's prediction of it",
    "python benchmarks/wait_modes.py          # spin or sleep while waiting, where ranks share cores",
    "python benchmarks/balance.py             # adaptive:balance=1 against none with a slow rank, over seeds",
    "python benchmarks/delayed_average_sim.py # local SGD with its average left in flight, simulated (no ranks)",
    "python benchmarks/make_results.py        # this file",
]


def build(results: Path, out: Path, extra) -> str:
    files = sorted(p for p in results.glob("*.json") if p.is_file() and p.name not in NOT_RESULTS) \
        if results.exists() else []
    docs: Dict[str, object] = {}
    for p in files:
        d = load(p)
        if d is not None:
            docs[p.name] = d
    pool: List[Run] = [(p, docs[p.name]) for p in files if p.name in docs]
    for e in extra:
        p = Path(e).resolve()
        d = load(p)
        if d is not None:
            pool.append((p, d))
    out_dir = out.parent

    def take(pred) -> List[Run]:
        got = [r for r in pool if pred(*r)]
        for r in got:
            pool.remove(r)
        return got

    # auto_rates.py summaries own their per-rate/per-seed compare runs (longest prefix wins)
    aggs = take(is_auto_rates)
    children: Dict[str, List[Run]] = {}
    for r in [r for r in pool if is_compare(r[1])]:
        owner = max((a for a, _ in aggs if r[0].stem.startswith(a.stem + "_")), key=lambda a: len(a.stem),
                    default=None)
        if owner is not None:
            children.setdefault(owner.stem, []).append(r)
            pool.remove(r)
    sections: List[Tuple[str, List[str]]] = []

    def add(title: str, lines: List[str]):
        if lines:
            sections.append((title, lines))

    main = take(lambda p, d: p.name in ("compare.json", "compare_quick.json") and is_compare(d))
    add("Training comparison — `compare.py` (MNIST-1D CNN, shaped loopback)", sec_compare_main(main, out_dir))
    add("hvd_ext on PyTorch DDP against DDP's own hooks — `compare.py --ddp`",
        sec_compare_ddp(take(lambda p, d: p.stem.startswith("compare_ddp") and is_compare(d)), out_dir))
    add("Other `compare.py` settings (straggler, node-aware testbed)",
        sec_compare_other(take(lambda p, d: is_compare(d)), out_dir))
    add("`compression=\"auto\"` against fixed codecs at several link rates — `auto_rates.py`",
        sec_auto_rates(aggs, children, out_dir))
    add("`auto` in loops it was not tuned on — `auto_trust.py`",
        sec_auto_trust(take(lambda p, d: p.stem == "auto_trust"), out_dir))
    add("Convergence on MNIST-1D — `convergence.py`",
        sec_first_table(take(lambda p, d: p.stem == "convergence"), out_dir, drop=("issue",),
                        caption="2 ranks, unshaped; epochs to the target accuracy and final accuracy per method "
                                "(the `run` column gives `scripts/train.py`'s arguments)."))
    summ = take(lambda p, d: p.stem == "convergence_workloads")
    wl = take(lambda p, d: p.stem.startswith("workload_"))
    if summ or wl:
        add("Convergence on other workloads — `convergence.py --workload NAME`", [
            "Workloads in `hvd_ext/examples/workloads.py` (generated or read from the machine, no downloads). "
            "Per-method time and epochs to the target and final quality are in each workload's file; the summary's "
            "second table compares the sync strategies with local SGD.", ""] + sec_workloads(summ, wl, out_dir))
    add("Every compressor at its defaults — `defaults_check.py`",
        sec_defaults(take(lambda p, d: p.stem in ("defaults_check", "thesis_sparsity")), out_dir))
    syn = take(lambda p, d: isinstance(d, dict) and d.get("benchmark") == "synthetic")
    syn.sort(key=lambda r: (not r[0].stem.startswith("synthetic"), r[0].name))
    add("Throughput on a 10.7M-parameter net — `synthetic.py`",
        sec_first_table(syn, out_dir, lead="SyntheticNet (10.7M parameters, 43 MB fp32 gradient), batch 16 per rank, "
                        "1 thread per rank: samples/s of all ranks (± 95% interval) and ratio against plain Horovod, "
                        "2 ranks; other rank counts and the scaling are in each run's file. `@overlap`: "
                        "`overlap=True` (buckets compressed on a worker thread), `@inline`: `overlap=False`.",
                        pick=lambda ts: next((t for t in ts if t["caption"].strip("*") == "2 ranks"), ts[0])))
    add("Per-step overhead against plain Horovod — `overhead.py`",
        sec_overhead(take(lambda p, d: p.stem.startswith("overhead_")), out_dir))
    add("Codec throughput on CPU — `throughput.py`",
        sec_first_table(take(lambda p, d: p.stem == "throughput"), out_dir,
                        keep=("method", "1M", "16M", "64M", "16M vs memcpy", "first s", "payload / dense"),
                        caption="GB/s of float32 gradient through compress + decode-and-sum of 2 ranks, 1 thread "
                                "(`16M vs memcpy`: fraction of memcpy bandwidth; `first s`: the first round, "
                                "compilation included). The previous figures are in the detail file."))
    add("Quantization error at equal wire bits — `quant_error.py`",
        sec_first_table(take(lambda p, d: p.stem == "quant_error"), out_dir,
                        caption="Relative squared error of `qdist` against the best QSGD max-norm setting with at "
                                "least as many wire bits, on gradients captured from three workloads."))
    add("Bytes per rank as N grows — `scale.py`", sec_scale(take(lambda p, d: p.stem == "scale"), out_dir))
    add("Kernels — `bench_kernels.py`", sec_first_table(take(lambda p, d: p.stem == "bench_kernels"), out_dir))
    for path, doc in list(pool):  # anything else: its first table
        title = (doc.get("title") or doc.get("benchmark") or path.stem) if isinstance(doc, dict) else path.stem
        add(f"{title} — `{path.name}`", sec_first_table([(path, doc)], out_dir))

    now = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    L = ["# hvd_ext benchmark results", "",
         f"Generated by `python benchmarks/make_results.py` on {now} from the JSON files in `benchmarks/results/`. "
         "Do not edit by hand: rerun the benchmarks, then this script.", "",
         "One summary table per benchmark. Under each, one line per run links the run's own file (full tables, "
         "per-seed and per-epoch figures, plots) with its command, date, commit and the machine's load "
         "(1-minute load average at start → end; the benchmark's own ranks count, so 2-3 is a quiet 2-core "
         "machine; a run that started above twice the core count is marked busy). Ratios are against plain Horovod "
         "measured in the same run.", "",
         "## How to reproduce", "", "On a quiet machine (root; iproute2 for the shaped namespaces):", "", "```bash",
         "source .venv/bin/activate && source scripts/env.sh"] + REPRODUCE + ["```", ""]
    mach = next((machine_of(d) for _, d in main), None) or next(
        (machine_of(d) for p, d in sorted(((p, docs[p.name]) for p in files if p.name in docs),
                                          key=lambda r: r[0].name) if machine_of(d).get("cpu")), {})
    if mach:
        L += ["## Machine", "",
              f"Unless a run says otherwise: {mach.get('cpus', '?')}-core {mach.get('cpu', '?')} VM, "
              f"{mach.get('mem_gib', '?')} GiB, python {mach.get('python', '?')}, torch {mach.get('torch', '?')}, "
              f"horovod {mach.get('horovod', '?')}, no GPU. A slow network is a network namespace whose loopback has "
              "one `tc tbf` qdisc (`scripts/shaped-cluster`), shared by all ranks, so the rate is the aggregate link; "
              "several nodes are one namespace each joined by shaped veth links. Horovod runs with the Gloo "
              "controller, DDP with gloo; MPI jobs are forced onto TCP over `lo`. No propagation delay is added "
              "(`netem` is not available); tbf `latency` is only the queue bound.", ""]
    for title, lines in sections:
        L += [f"## {title}", ""] + lines
    return "\n".join(L).rstrip() + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--results", default=str(common.RESULTS), help="folder with the benchmark JSON files")
    ap.add_argument("--out", default=str(HERE / "RESULTS.md"))
    ap.add_argument("--extra", nargs="*", default=[], help="more benchmark JSON files to summarize")
    a = ap.parse_args(argv)
    out = Path(a.out).resolve()
    text = build(Path(a.results).resolve(), out, a.extra)
    out.write_text(text)
    print(f"wrote {out} ({len(text.splitlines())} lines)")
    import technique_status  # docs/techniques.md's status table comes from the same results

    if technique_status.update(Path(a.results).resolve()):
        print(f"wrote the technique status table in {technique_status.DOC}")


if __name__ == "__main__":
    main()
