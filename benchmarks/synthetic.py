#!/usr/bin/env python
"""Synthetic-data throughput benchmark (after Horovod's examples/pytorch/pytorch_synthetic_benchmark.py).

    python benchmarks/synthetic.py                     # 2 and 4 ranks x {100mbit, 1gbit, unshaped}, ~12 min
                                                       #   on a quiet 2-core machine (4 ranks at 100mbit dominate)
    python benchmarks/synthetic.py --quick             # 2 ranks, 1gbit + unshaped, fewer methods (~2 min)
    python benchmarks/synthetic.py --ranks 2 --nets 100mbit --methods horovod topk:ratio=0.01

Model: benchmarks/models.py SyntheticNet (~10.7M parameters, 43 MB fp32
gradient), random 3x32x32 inputs and labels fixed once (no data loading), SGD.
Per (network, ranks) one job runs every Horovod-side method in turn inside a
fresh namespace (scripts/shaped-cluster: tbf-shaped loopback, or unshaped), and
one torchrun job runs the DDP methods. For each method: 1 warm-up step, then
timed steps until --min-time seconds and >= --min-steps steps (default 2 s, 2 steps) (<= --max-steps); reported
as samples/s per rank (mean +- 1.96 std over steps, like Horovod's script) and
in total (x ranks), and bytes sent per step per rank.

Methods:
  horovod, horovod-fp16   horovod.torch.DistributedOptimizer (Compression.none / fp16): real plain Horovod
  SPEC                    hvd_ext.DistributedOptimizer with compression_from_spec(SPEC) (`none` = hvd_ext's
                          own uncompressed path); SPEC@overlap / SPEC@inline: with overlap=True / False
                          (buckets compressed on a worker thread / in the backward hooks; default "auto")
  ddp, ddp-powersgd[:rank=R]  PyTorch DDP (gloo) via torchrun, default / PowerSGD hook (start_powerSGD_iter=2)

Writes benchmarks/results/synthetic[_quick].json and .md (samples/s table per
network and rank count, ratios vs `horovod`, and a scaling table 2 -> 4 ranks).
On this 2-core machine 4 ranks oversubscribe the CPUs (1 thread each): the
scaling table shows that, next to the network's effect.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import common  # noqa: E402
from common import ROOT, fmt, fmt_bytes  # noqa: E402

# ddp-powersgd is not in the default list: on the 10.7M-parameter net its job stalled (no CPU use, no
# progress for > 5 min, even unshaped) and was not debugged; it runs in compare.py on the CNN.
DEFAULT_METHODS = ["horovod", "horovod-fp16", "topk:ratio=0.01", "powersgd:rank=4", "ddp"]
QUICK_METHODS = ["horovod", "horovod-fp16", "topk:ratio=0.01", "ddp"]
DEFAULT_NETS = ["100mbit", "1gbit", "unshaped"]


# --------------------------------------------------------------------------------------------- worker
def _worker(cfg):
    import torch
    import torch.nn.functional as F

    from models import SyntheticNet

    torch.set_num_threads(cfg["threads"])
    fw = cfg["framework"]
    if fw == "hvd":
        import horovod.torch as hvd

        hvd.init()
        rank, size = hvd.rank(), hvd.size()

        def agree(flag: bool) -> bool:  # every rank takes rank 0's decision
            return bool(hvd.broadcast(torch.tensor([int(flag)]), root_rank=0, name="synth.stop").item())
    else:
        import torch.distributed as dist
        from datetime import timedelta

        dist.init_process_group("gloo", timeout=timedelta(seconds=900))
        rank, size = dist.get_rank(), dist.get_world_size()

        def agree(flag: bool) -> bool:
            t = torch.tensor([int(flag)])
            dist.broadcast(t, 0)
            return bool(t.item())

    torch.manual_seed(cfg["seed"])
    data = torch.randn(cfg["batch"], 3, 32, 32)
    target = torch.randint(0, 1000, (cfg["batch"],))
    results = []
    for method in cfg["methods"]:
        torch.manual_seed(cfg["seed"])
        model = SyntheticNet()
        dense = sum(p.numel() * 4 for p in model.parameters())
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        count_bytes = None
        stats = None
        if fw == "hvd":
            import horovod.torch as hvd

            if method in ("horovod", "horovod-fp16"):
                comp = hvd.Compression.fp16 if method == "horovod-fp16" else hvd.Compression.none
                opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(), compression=comp)
                per_step = dense // 2 if method == "horovod-fp16" else dense
                count_bytes = lambda per_step=per_step: per_step  # noqa: E731
            else:
                import hvd_ext

                spec, overlap = split_overlap(method)
                opt = hvd_ext.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                                   compression=hvd_ext.compression_from_spec(spec), overlap=overlap)
                stats = opt.stats
            hvd.broadcast_parameters(model.state_dict(), root_rank=0)
            net = model
        else:
            import torch.distributed as dist
            from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
            from torch.nn.parallel import DistributedDataParallel as DDP

            net = DDP(model)
            counter = {"b": 0}
            if method.startswith("ddp-powersgd"):
                r = 2
                for kv in method.partition(":")[2].split(","):
                    if kv.startswith("rank="):
                        r = int(kv[5:])
                state = psgd.PowerSGDState(process_group=None, matrix_approximation_rank=r, start_powerSGD_iter=2,
                                           min_compression_rate=2, use_error_feedback=True, warm_start=True)
                orig = dist.all_reduce

                def counting(t, *a, _orig=orig, **k):
                    counter["b"] += t.numel() * t.element_size()
                    return _orig(t, *a, **k)

                dist.all_reduce = counting
                net.register_comm_hook(state, psgd.powerSGD_hook)
                count_bytes = lambda: counter["b"]  # noqa: E731  (cumulative, differenced below)
            else:
                count_bytes = lambda dense=dense: dense  # noqa: E731
            opt = torch.optim.SGD(net.parameters(), lr=0.01)

        def step():
            opt.zero_grad()
            loss = F.cross_entropy(net(data), target)
            loss.backward()
            opt.step()

        # DDP PowerSGD runs vanilla allreduce until start_powerSGD_iter=2: warm up past it
        for _ in range(max(cfg["warmup"], 3) if method.startswith("ddp-powersgd") else cfg["warmup"]):
            step()
        if stats is not None:
            stats.reset()
        b0 = count_bytes() if method.startswith("ddp-powersgd") else 0
        times = []
        t_start = time.perf_counter()
        while True:
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)
            done = (len(times) >= cfg["min_steps"] and time.perf_counter() - t_start >= cfg["min_time"]) \
                or len(times) >= cfg["max_steps"]
            if agree(done):
                break
        if stats is not None:
            bps = stats.summary()["bytes_sent_per_step"]
            wait = stats.summary()["comm_wait_ms_per_step"]
        elif method.startswith("ddp-powersgd"):
            bps, wait = (count_bytes() - b0) / len(times), None
        else:
            bps, wait = float(count_bytes()), None
        rates = [cfg["batch"] / t for t in times]
        mean = statistics.mean(rates)
        ci = 1.96 * statistics.stdev(rates) if len(rates) > 1 else 0.0
        row = {"method": method, "framework": {"hvd": "horovod" if method.startswith("horovod") else
                                               "horovod+hvd_ext", "ddp": "pytorch-ddp"}[fw],
               "ranks": size, "steps": len(times), "ms_per_step": 1e3 * statistics.mean(times),
               "samples_per_s_per_rank": mean, "ci95_per_rank": ci, "samples_per_s_total": mean * size,
               "bytes_sent_per_step": bps, "comm_wait_ms_per_step": wait, "dense_bytes": dense}
        results.append(row)
        if rank == 0:
            print(f"synthetic: {method:<24} {mean:8.1f} +- {ci:6.1f} samples/s per rank, "
                  f"total {mean * size:8.1f}, {1e3 * statistics.mean(times):8.1f} ms/step, "
                  f"{fmt_bytes(bps)}/step", flush=True)
        if hasattr(opt, "stats"):
            try:
                opt.stats.close()
            except Exception:  # noqa: BLE001
                pass
        if fw == "ddp" and method.startswith("ddp-powersgd"):
            dist.all_reduce = orig
        del net, opt, model
    if rank == 0:
        Path(cfg["out"]).write_text(json.dumps(results, indent=1))
    if fw == "ddp":
        import torch.distributed as dist

        dist.destroy_process_group()


# --------------------------------------------------------------------------------------------- driver
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--methods", nargs="+", default=None, help=f"default: {' '.join(DEFAULT_METHODS)}")
    p.add_argument("--nets", nargs="+", default=None,
                   help="tbf rates (tc syntax) and/or 'unshaped'; default 100mbit 1gbit unshaped")
    p.add_argument("--ranks", nargs="+", type=int, default=None, help="rank counts; default 2 4")
    p.add_argument("--batch", type=int, default=16, help="samples per rank per step")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--min-time", type=float, default=2.0, help="timed seconds per method (at least)")
    p.add_argument("--min-steps", type=int, default=2)
    p.add_argument("--max-steps", type=int, default=20)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--latency", default="50ms", help="tbf latency")
    p.add_argument("--timeout", type=float, default=900, help="seconds per job")
    p.add_argument("--quick", action="store_true", help="2 ranks, 1gbit + unshaped, 4 methods, min-time 2 s")
    p.add_argument("--out", default=None, help="output prefix (default benchmarks/results/synthetic[_quick])")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    common.add_load_option(p)
    a = p.parse_args(argv)
    if a.quick:
        a.methods = a.methods or QUICK_METHODS
        a.nets = a.nets or ["1gbit", "unshaped"]
        a.ranks = a.ranks or [2]
        a.min_time = min(a.min_time, 2.0)
    a.methods = a.methods or DEFAULT_METHODS
    a.nets = a.nets or DEFAULT_NETS
    a.ranks = a.ranks or [2, 4]
    a.out = a.out or str(common.RESULTS / ("synthetic_quick" if a.quick else "synthetic"))
    return a


def split_overlap(method: str):
    """'SPEC@overlap' -> (SPEC, True); 'SPEC@inline' -> (SPEC, False); 'SPEC' -> (SPEC, "auto")."""
    spec, _, mode = method.partition("@")
    if mode not in ("", "overlap", "inline"):
        raise ValueError(f"method {method!r}: the suffix after @ must be 'overlap' or 'inline'")
    return spec, {"": "auto", "overlap": True, "inline": False}[mode]


def split_methods(methods):
    """-> (hvd methods, ddp methods, skipped [(method, reason)])."""
    hvd_m, ddp_m, skipped = [], [], []
    for m in methods:
        if m == "ddp" or m.startswith("ddp-powersgd"):
            ddp_m.append(m)
        elif m in ("horovod", "horovod-fp16"):
            hvd_m.append(m)
        else:
            try:
                import hvd_ext

                hvd_ext.compression_from_spec(split_overlap(m)[0])
                hvd_m.append(m)
            except (ValueError, ImportError) as e:
                skipped.append((m, str(e)))
    return hvd_m, ddp_m, skipped


def run(a):
    from tqdm import tqdm

    why = common.check_testbed()
    if why:
        sys.exit(f"synthetic.py: cannot build the shaped testbed: {why}")
    from models import SyntheticNet, num_params

    hvd_m, ddp_m, skipped = split_methods(a.methods)
    out = Path(a.out)
    logdir = Path(str(out) + "_logs")
    logdir.mkdir(parents=True, exist_ok=True)
    jobs = []
    for n in a.ranks:
        for net in a.nets:
            if hvd_m:
                jobs.append((n, net, "hvd", hvd_m))
            if ddp_m:
                jobs.append((n, net, "ddp", ddp_m))
    doc = {"benchmark": "synthetic", "machine": common.machine_info(),
           "command": "python " + " ".join(shlex.quote(x) for x in [str(Path(sys.argv[0]))] + sys.argv[1:]),
           "config": {"model": "SyntheticNet", "params": num_params(SyntheticNet()), "batch_per_rank": a.batch,
                      "input": "3x32x32 random, fixed", "warmup_steps": a.warmup, "min_time_s": a.min_time,
                      "min_steps": a.min_steps, "max_steps": a.max_steps, "threads_per_rank": a.threads,
                      "nets": a.nets, "ranks": a.ranks, "tbf_latency": a.latency, "methods": a.methods},
           "skipped": [{"method": m, "reason": r} for m, r in skipped], "jobs": [], "rows": []}
    for m, r in skipped:
        print(f"synthetic: {m}: skipped ({r})")
    print(f"synthetic: {len(jobs)} jobs ({len(a.ranks)} rank counts x {len(a.nets)} networks); output {out}.*",
          flush=True)
    bar = tqdm(total=len(jobs), desc="synthetic jobs", unit="job", dynamic_ncols=True)
    try:
        for n, net, fw, methods in jobs:
            tag = f"{fw}_np{n}_{common.slug(net)}"
            res_file = logdir / f"{tag}.json"
            res_file.unlink(missing_ok=True)
            cfg = {"framework": fw, "methods": methods, "batch": a.batch, "warmup": a.warmup,
                   "min_time": a.min_time, "min_steps": a.min_steps, "max_steps": a.max_steps,
                   "threads": a.threads, "seed": a.seed, "out": str(res_file)}
            worker = [common.PY, str(Path(__file__).resolve()), "--worker"]
            launch = common.hvd_launcher(n, "gloo") if fw == "hvd" else common.torchrun_launcher(n) + ["--no-python"]
            rate = None if net == "unshaped" else net
            cmd = common.shaped_prefix(rate, a.latency) + launch + worker
            bar.set_postfix_str(f"{fw} np={n} {net}")
            r = common.run_job(cmd, logdir / f"{tag}.log", a.timeout, env={"SYNTH_CONFIG": json.dumps(cfg)})
            job = {"framework": fw, "ranks": n, "net": net, "methods": methods, "rc": r["rc"], "wall_s": r["wall_s"],
                   "log": str(logdir / f"{tag}.log")}
            if r["rc"] == 0 and res_file.exists():
                rows = json.loads(res_file.read_text())
                for row in rows:
                    row["net"] = net
                    doc["rows"].append(row)
                    bar.write(f"np={n} {net:<9} {row['method']:<22} {row['samples_per_s_total']:8.1f} samples/s "
                              f"total ({row['samples_per_s_per_rank']:.1f} +- {row['ci95_per_rank']:.1f} per rank), "
                              f"{row['ms_per_step']:.0f} ms/step, {fmt_bytes(row['bytes_sent_per_step'])}/step")
            else:
                job["error"] = ("timed out; " if r["timed_out"] else f"exit {r['rc']}; ") + \
                    " | ".join(r["tail"].splitlines()[-4:])
                bar.write(f"np={n} {net} {fw}: FAILED {job['error'][:200]}")
            doc["jobs"].append(job)
            bar.update(1)
            common.write_json(Path(str(out) + ".json"), doc)
    except KeyboardInterrupt:
        bar.write("synthetic: interrupted; writing what finished")
    finally:
        bar.close()
    doc["machine"]["loadavg_end"] = common.loadavg()
    common.write_json(Path(str(out) + ".json"), doc)
    md = markdown(doc)
    Path(str(out) + ".md").write_text(md)
    print(md)
    print(f"wrote {out}.json, {out}.md")
    return doc


def markdown(doc) -> str:
    rows = doc["rows"]
    cfg = doc["config"]
    lines = [f"SyntheticNet ({cfg['params'] / 1e6:.1f}M parameters, {4 * cfg['params'] / 1e6:.0f} MB fp32 gradient), "
             f"batch {cfg['batch_per_rank']} per rank, {cfg['threads_per_rank']} thread per rank; samples/s total "
             "(all ranks); ratio vs `horovod` (plain horovod.torch.DistributedOptimizer) in the same job set.", ""]
    nets = list(dict.fromkeys(cfg["nets"]))
    ranks = list(dict.fromkeys(cfg["ranks"]))
    methods = list(dict.fromkeys(r["method"] for r in rows))
    get = {(r["method"], r["ranks"], r["net"]): r for r in rows}
    for n in ranks:
        hdr = ["method"] + [f"{net} samples/s" for net in nets] + [f"{net} vs horovod" for net in nets] + \
              ["bytes/step/rank"]
        lines += [f"**{n} ranks**", "", "| " + " | ".join(hdr) + " |", "|" + "---|" * len(hdr)]
        for m in methods:
            cells, ratios, b = [], [], None
            for net in nets:
                r = get.get((m, n, net))
                ref = get.get(("horovod", n, net))
                cells.append(f"{r['samples_per_s_total']:.1f} ± {r['ci95_per_rank'] * n:.1f}" if r else "—")
                ratios.append(f"{r['samples_per_s_total'] / ref['samples_per_s_total']:.2f}x" if r and ref else "—")
                if r:
                    b = r["bytes_sent_per_step"]
            lines.append(f"| `{m}` | " + " | ".join(cells + ratios) + f" | {fmt_bytes(b)} |")
        lines.append("")
    if len(ranks) >= 2:
        lo, hi = ranks[0], ranks[-1]
        hdr = ["method"] + [f"{net}: {lo} -> {hi} ranks (samples/s, scaling eff.)" for net in nets]
        lines += [f"**Scaling {lo} -> {hi} ranks** (efficiency = total_{hi} / (total_{lo} x {hi}/{lo}); "
                  f"{doc['machine'].get('cpus')} CPU cores here)", "",
                  "| " + " | ".join(hdr) + " |", "|" + "---|" * len(hdr)]
        for m in methods:
            cells = []
            for net in nets:
                a_, b_ = get.get((m, lo, net)), get.get((m, hi, net))
                if a_ and b_:
                    eff = b_["samples_per_s_total"] / (a_["samples_per_s_total"] * hi / lo)
                    cells.append(f"{a_['samples_per_s_total']:.1f} -> {b_['samples_per_s_total']:.1f} ({eff:.0%})")
                else:
                    cells.append("—")
            lines.append(f"| `{m}` | " + " | ".join(cells) + " |")
        lines.append("")
    bad = [j for j in doc["jobs"] if "error" in j]
    if bad or doc["skipped"]:
        lines += ["Not measured:", ""]
        lines += [f"- `{s['method']}`: skipped — {s['reason']}" for s in doc["skipped"]]
        lines += [f"- {j['framework']} job, {j['ranks']} ranks, {j['net']}: {j['error']}" for j in bad]
        lines.append("")
    return "\n".join(lines)


def main(argv=None):
    if "--worker" in (argv if argv is not None else sys.argv[1:]):
        return _worker(json.loads(os.environ["SYNTH_CONFIG"]))
    a = parse_args(argv)
    common.refuse_if_loaded(a)
    t0 = time.perf_counter()
    run(a)
    print(f"synthetic: done in {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
