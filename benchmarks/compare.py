#!/usr/bin/env python
"""Side-by-side training benchmark on a shaped network: hvd_ext methods vs plain Horovod and PyTorch DDP.

    python benchmarks/compare.py --quick                 # < 5 min: 6 methods x 2 epochs, target 50%
    python benchmarks/compare.py                         # full: 16 methods x 8 epochs, target 93%
                                                         #   (~15-20 min on a quiet 2-core machine)
    python benchmarks/compare.py --methods topk:ratio=0.01 dgc:ratio=0.01 --epochs 8 --rate 100mbit

Every method trains the MNIST-1D CNN (hvd_ext/examples/mnist1d.py) with N ranks
(default 2) in its own network namespace whose loopback is shaped with tc tbf
(scripts/shaped-cluster; default 300 Mbit/s). The same run always includes the
peers a user would pick instead:

  horovod           scripts/train.py --plain-horovod: horovod.torch.DistributedOptimizer itself,
                    uncompressed fp32 allreduce (the reference for every ratio)
  horovod:fp16      the same with Horovod's own hvd.Compression.fp16
  none              hvd_ext.DistributedOptimizer without compression (our overhead over Horovod)
  ddp               PyTorch DDP, gloo, launched with torchrun (scripts/train.py --engine ddp)
  ddp:fp16          DDP with torch's fp16_compress_hook
  ddp:powersgd      DDP with torch's PowerSGD comm hook, rank 2 (start_powerSGD_iter=100, as
                    hvd_ext's powersgd warm-up)

Method syntax:
  horovod | horovod:fp16     -> scripts/train.py --plain-horovod [--compression fp16]
  COMPRESSION                e.g. topk:ratio=0.01,feedback=ewma  -> scripts/train.py --compression ...
  COMPRESSION@SYNC           e.g. none@local:period=8             -> ... --sync local:period=8
  ddp | ddp:HOOK[:rank=R,start=S]  DDP's own hooks: allreduce, fp16, bf16, powersgd, batched_powersgd
  ddp+COMPRESSION            hvd_ext's codec on DDP's buckets (hvd_ext.ddp), e.g. ddp+auto, ddp+qsgd:bits=8
  --ddp                      the DDP set (DDP_METHODS): DDP's hooks against hvd_ext on DDP
                             (with --nodes, DDP jobs start one torchrun per node: scripts/torchrun-nodes)

Horovod jobs use `horovodrun --gloo` (TCP over the namespace's loopback, so the
shaper applies); sync strategies that need MPI (`event`: one-sided parameter
server; hvd_ext.sync_from_spec(...).needs_mpi) use mpirun with Open MPI forced
onto TCP over lo (its shared-memory transport would bypass the shaper). A method whose compressor is
not registered (or whose spec is invalid, or that needs `--sync` while train.py
has none yet) is reported as skipped; a method whose job fails is reported as
failed with the tail of its log; neither stops the run.

Records per method: ms/step, comm-wait ms/step, bytes sent/step (per rank,
payload), test accuracy per epoch with cumulative training wall-clock (eval
excluded), time to --target accuracy (first epoch end at or above it), the
job's total wall time including start-up. Writes OUT.json, OUT.md (table with
ratios vs plain Horovod), OUT_acc_vs_time.png and OUT_bytes.png, where OUT
defaults to benchmarks/results/compare (compare_quick with --quick). Logs of
every job go to OUT_logs/ (per-step logs are deleted after a successful job).

Heterogeneous runs: --slow-rank R --slow-factor F makes rank R's compute F
times slower in every method (both engines of train.py sleep alike).

Several nodes: --nodes M --ranks-per-node L runs every job on the multi-node
testbed (scripts/shaped-cluster --nodes M --ranks-per-node L --inter RATE:
one namespace per node, inter-node links shaped to --rate, each node's
loopback unshaped unless --intra), launched as on a cluster with
`horovodrun -np M*L -H node1:L,...,nodeM:L --gloo`. The default methods are
then plain Horovod, Horovod with HOROVOD_HIERARCHICAL_ALLREDUCE=1
(`horovod:hier`; this CPU build has no hierarchical allreduce op, only
NCCL's, so it runs the flat ring), and qsgd:bits=8 and topk:ratio=0.01 each
with hierarchy=flat and with the default node-aware exchange (scripts/train.py
calls plain hvd.init(): the node groups ride on the global alltoall, no
process sets needed). The routes each
hvd_ext method takes are those the same code chooses on a simulated world
of the same layout; the table adds each node-aware method's step time
against its hierarchy=flat twin.

    python benchmarks/compare.py --nodes 2 --ranks-per-node 2 --rate 300mbit --epochs 4 \
        --out benchmarks/results/compare_nodes

(4 epochs, 248 steps: the node-aware jobs' hierarchy trial takes the first 44.)
"""
from __future__ import annotations

import argparse
import json
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import common  # noqa: E402
from common import ROOT, fmt, fmt_bytes  # noqa: E402

REFERENCE = "horovod"
BASELINES = [REFERENCE, "horovod:fp16", "none", "ddp", "ddp:fp16", "ddp:powersgd:rank=2"]
# PyTorch DDP: its own hooks, and hvd_ext's codecs on DDP's buckets (hvd_ext.ddp), in one run
DDP_METHODS = ["ddp", "ddp:fp16", "ddp:powersgd:rank=2", "ddp:batched_powersgd:rank=2",
               "ddp+auto", "ddp+topk:ratio=0.01", "ddp+qsgd:bits=8", "ddp+powersgd:rank=2"]
FULL_METHODS = [
    # sparsification
    "topk:ratio=0.01", "topk:ratio=0.01,scope=model", "dgc:ratio=0.01,warmup_steps=250", "sig:ratio=0.01",
    "topk:ratio=0.01,scope=model,feedback=ewma",
    # quantisation / low rank; the sign family needs a lower lr (see convergence.py), so it is
    # timed there and in throughput.py rather than here at the common lr
    "qdist:bits=3", "qsgd:bits=8", "powersgd:rank=2",
    # synchronisation strategies
    "none@local:period=8", "none@adaptive:min=1,max=32", "none@event",
]
QUICK_METHODS = ["topk:ratio=0.01", "powersgd:rank=2"]
NODE_BASELINES = [REFERENCE, "horovod:hier"]
NODE_METHODS = ["qsgd:bits=8,hierarchy=flat", "qsgd:bits=8", "topk:ratio=0.01,hierarchy=flat", "topk:ratio=0.01"]
TARGETS = (0.90, 0.93, 0.94)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--methods", nargs="+", default=None,
                   help="methods to compare (the baselines in BASELINES are always added)")
    p.add_argument("--quick", action="store_true",
                   help=f"< 5 min: baselines + {' '.join(QUICK_METHODS)}, 2 epochs (unless given)")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--epochs", type=int, default=None, help="default 8 (2 with --quick)")
    p.add_argument("--lr", type=float, default=0.2)
    p.add_argument("--batch", type=int, default=32, help="samples per rank per step")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--target", type=float, default=None,
                   help="target test accuracy for time-to-accuracy (default 0.93; 0.5 with --quick, whose 2 epochs "
                        "cannot reach 93%%)")
    p.add_argument("--rate", default="300mbit", help="tbf rate of the namespace loopback; 'unshaped' for none")
    p.add_argument("--latency", default="50ms", help="tbf latency (max queueing delay)")
    p.add_argument("--burst", default="256kb")
    p.add_argument("--launcher", choices=["auto", "gloo", "mpi"], default="auto",
                   help="Horovod launcher (auto: gloo, mpi for --sync event)")
    p.add_argument("--slow-rank", type=int, default=0, help="with --slow-factor: this rank computes slower")
    p.add_argument("--slow-factor", type=float, default=1.0,
                   help="heterogeneous run: the slow rank's compute takes this many times longer (all methods)")
    p.add_argument("--ddp-powersgd-start", type=int, default=100,
                   help="start_powerSGD_iter for DDP's PowerSGD hooks (default 100: hvd_ext powersgd's warm-up)")
    p.add_argument("--ddp", action="store_true", help="the DDP set: DDP's hooks and hvd_ext on DDP (DDP_METHODS)")
    p.add_argument("--timeout", type=float, default=None, help="seconds per method (default 120 + 0.5 s/step)")
    p.add_argument("--out", default=None, help="output prefix (default benchmarks/results/compare[_quick])")
    p.add_argument("--no-baselines", action="store_true", help="do not add the baselines (debugging only)")
    p.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    p.add_argument("--nodes", type=int, default=0,
                   help="multi-node testbed: this many nodes (network namespaces), --rate shapes the inter-node links")
    p.add_argument("--ranks-per-node", type=int, default=2, help="with --nodes: ranks per node")
    p.add_argument("--intra", default=None, help="with --nodes: also shape each node's loopback to this rate")
    common.add_load_option(p)
    a = p.parse_args(argv)
    if a.nodes:
        if a.nodes < 1 or a.ranks_per_node < 1:
            p.error("--nodes and --ranks-per-node must be >= 1")
        if str(a.rate).lower() in ("none", "unshaped", "0"):
            p.error("--nodes needs a --rate for the inter-node links")
        a.ranks = a.nodes * a.ranks_per_node
        if a.methods is None:
            a.methods = NODE_METHODS
    if a.epochs is None:
        a.epochs = 2 if a.quick else 8
    if a.target is None:
        a.target = 0.5 if a.quick else 0.93
    if a.methods is None:
        a.methods = DDP_METHODS if a.ddp else QUICK_METHODS if a.quick else FULL_METHODS
    if a.out is None:
        a.out = str(common.RESULTS / ("compare_quick" if a.quick else "compare"))
    if a.ranks < 1 or a.epochs < 1:
        p.error("--ranks and --epochs must be >= 1")
    if a.slow_factor < 1.0:
        p.error("--slow-factor must be >= 1")
    if not 0 < a.target <= 1:
        p.error("--target must be in (0, 1]")
    return a


def method_list(a):
    seen, out = set(), []
    base = NODE_BASELINES if a.nodes else BASELINES
    for m in ([] if a.no_baselines else base) + list(a.methods):
        m = m.strip()
        if m and m not in seen:
            seen.add(m)
            out.append(m)
    return out


_train_help = None


def train_supports(flag: str) -> bool:
    global _train_help
    if _train_help is None:
        r = subprocess.run([common.PY, str(ROOT / "scripts" / "train.py"), "--help"], capture_output=True,
                           text=True, env=common.child_env(), timeout=120)
        _train_help = r.stdout
    return re.search(rf"(^|\s){re.escape(flag)}[\s=,]", _train_help) is not None


def hosts(a) -> str:
    return ",".join(f"node{i + 1}:{a.ranks_per_node}" for i in range(a.nodes))


def launcher_prefix(a, kind: str):
    """horovodrun / mpirun prefix: one host, or the testbed's nodes (-H node1:L,...)."""
    if not a.nodes:
        return common.hvd_launcher(a.ranks, kind)
    if kind == "gloo":
        return ["horovodrun", "-np", str(a.ranks), "-H", hosts(a), "--gloo", "--start-timeout", "120"]
    return ["mpirun", "-np", str(a.ranks), "-H", hosts(a), "--bind-to", "none",
            "-x", "BENCH_EXTRA_ARGS", "-x", "PYTHONPATH", "-x", "OMP_NUM_THREADS"]


# Bytes through node1's inter-node interface during the job (the testbed runs CMD inside node1's namespace).
NIC_WRAP = ('s=/sys/class/net/eth0/statistics; read t0 < $s/tx_bytes; read r0 < $s/rx_bytes; "$@"; rc=$?; '
            'read t1 < $s/tx_bytes; read r1 < $s/rx_bytes; echo "NODE1_ETH0_BYTES tx=$((t1-t0)) rx=$((r1-r0))"; exit $rc')


def nic_bytes(log_text: str):
    """(tx, rx) bytes node1's eth0 carried during the job, from the NIC_WRAP line, or None."""
    m = re.search(r"NODE1_ETH0_BYTES tx=(\d+) rx=(\d+)", log_text)
    return (int(m.group(1)), int(m.group(2))) if m else None


def testbed_prefix(a):
    if not a.nodes:
        return common.shaped_prefix(a.rate, a.latency, a.burst)
    cmd = [str(common.SHAPED), "--nodes", str(a.nodes), "--ranks-per-node", str(a.ranks_per_node),
           "--inter", str(a.rate), "--latency", a.latency, "--burst", a.burst]
    if a.intra:
        cmd += ["--intra", str(a.intra)]
    return cmd + ["--", "bash", "-c", NIC_WRAP, "bash"]


def predicted_routes(method: str, a):
    """Routes the hvd_ext pipeline takes for the main job's model on this layout (the same choice
    code, run on a simulated world laid out on the same nodes), or None."""
    comp = method.partition("@")[0]
    if not a.nodes or method.startswith(("horovod", "ddp")):
        return None
    try:
        import torch

        from hvd_ext.examples.mnist1d import MNIST1DCNN
        from hvd_ext.testing.harness import run_pipeline

        torch.manual_seed(0)
        named = list(MNIST1DCNN(64).named_parameters())
        grads = [[{n: torch.zeros_like(p) for n, p in named} for _ in range(a.ranks)]]
        runs = run_pipeline(comp, grads, a.ranks, params={n: p.detach() for n, p in named},
                            ranks_per_node=a.ranks_per_node)
        return runs[0].routes
    except Exception as e:  # noqa: BLE001 -- informative only
        return [f"unknown ({type(e).__name__}: {e})"]


def plan(method: str, a, workdir: Path):
    """-> dict(method, framework, launcher, cmd, json, log) or dict(status='skipped', reason=...)."""
    p = _plan(method, a, workdir)
    if a.nodes and "env" in p:
        if method == "horovod:hier":
            p["env"]["HOROVOD_HIERARCHICAL_ALLREDUCE"] = "1"
        routes = predicted_routes(method, a)
        if routes is not None:
            p["routes"] = routes
    return p


def _plan(method: str, a, workdir: Path):
    base = {"method": method}
    out_json = workdir / f"{common.slug(method)}.json"
    step_log = workdir / f"{common.slug(method)}.steps"
    common_args = ["--epochs", str(a.epochs), "--lr", str(a.lr), "--batch", str(a.batch), "--seed", str(a.seed),
                   "--json", str(out_json), "--no-progress"]
    # --log is an ambiguous abbreviation to horovodrun's and torchrun's argparse: pass it via argv_shim.py
    env = {"BENCH_EXTRA_ARGS": json.dumps(["--log", str(step_log)])}
    shim = [common.PY, str(ROOT / "benchmarks" / "argv_shim.py")]
    if method == "ddp" or method.startswith(("ddp:", "ddp+")):
        comp = ddp_compression(method, a)
        if comp is None:
            return {**base, "framework": "pytorch-ddp", "status": "skipped",
                    "reason": f"bad DDP method {method!r}: ddp, ddp:HOOK[:rank=R,start=S] or ddp+HVD_EXT_SPEC"}
        args = ["--engine", "ddp", "--compression", comp]
        if a.slow_factor > 1.0:
            args += ["--slow-rank", str(a.slow_rank), "--slow-factor", str(a.slow_factor)]
        launch = ([str(ROOT / "scripts" / "torchrun-nodes")] if a.nodes
                  else common.torchrun_launcher(a.ranks))
        cmd = launch + ["--no-python"] + shim + [str(ROOT / "scripts" / "train.py")] + args + common_args
        fw = "hvd_ext on pytorch-ddp" if method.startswith("ddp+") else "pytorch-ddp"
        return {**base, "framework": fw, "launcher": "torchrun/gloo", "cmd": cmd, "json": out_json,
                "steps_log": step_log, "env": env}
    if method in ("horovod", "horovod:none", "horovod:fp16", "horovod:hier"):
        comp = "fp16" if method.endswith("fp16") else "none"
        cmd = (launcher_prefix(a, "gloo" if a.launcher == "auto" else a.launcher) + shim
               + [str(ROOT / "scripts" / "train.py"), "--plain-horovod", "--compression", comp] + common_args)
        return {**base, "framework": "horovod", "launcher": "horovodrun/gloo", "cmd": cmd, "json": out_json,
                "steps_log": step_log, "env": env}
    comp, _, sync = method.partition("@")
    try:
        import hvd_ext

        hvd_ext.compression_from_spec(comp)
    except ValueError as e:
        why = "compressor not registered" if "unknown compressor" in str(e) else "invalid spec"
        return {**base, "framework": "horovod+hvd_ext", "status": "skipped", "reason": f"{why}: {e}"}
    except ImportError as e:
        return {**base, "framework": "horovod+hvd_ext", "status": "skipped", "reason": f"hvd_ext import failed: {e}"}
    extra = []
    needs_mpi = False
    if sync:
        if not train_supports("--sync"):
            return {**base, "framework": "horovod+hvd_ext", "status": "skipped",
                    "reason": "scripts/train.py has no --sync option yet"}
        sync_from_spec = getattr(hvd_ext, "sync_from_spec", None)
        if sync_from_spec is not None:
            try:
                needs_mpi = bool(getattr(sync_from_spec(sync), "needs_mpi", False))
            except ValueError as e:
                return {**base, "framework": "horovod+hvd_ext", "status": "skipped", "reason": f"invalid sync spec: {e}"}
        else:
            needs_mpi = sync.split(":")[0].strip() == "event"
        extra = ["--sync", sync]
    if a.slow_factor > 1.0:
        if not train_supports("--slow-rank"):
            return {**base, "framework": "horovod+hvd_ext", "status": "skipped",
                    "reason": "scripts/train.py has no --slow-rank option"}
        extra += ["--slow-rank", str(a.slow_rank), "--slow-factor", str(a.slow_factor)]
    launcher = a.launcher
    if launcher == "auto":
        launcher = "mpi" if needs_mpi else "gloo"
    cmd = launcher_prefix(a, launcher) + shim + [str(ROOT / "scripts" / "train.py"),
                                                          "--compression", comp] + extra + common_args
    fw = "horovod+hvd_ext"
    return {**base, "framework": fw, "launcher": f"horovodrun/{launcher}" if launcher == "gloo" else "mpirun/tcp",
            "cmd": cmd, "json": out_json, "steps_log": step_log, "env": env}


def ddp_compression(method: str, a):
    """scripts/train.py --engine ddp's --compression for a DDP method, or None when malformed:
    ``ddp`` -> DDP's allreduce; ``ddp:HOOK[...]`` -> DDP's own hook (PowerSGD's ``start`` defaults
    to --ddp-powersgd-start); ``ddp+SPEC`` -> the hvd_ext codec SPEC on DDP's buckets."""
    if method == "ddp":
        return "ddp:allreduce"
    if method.startswith("ddp+"):
        return method[4:] or None
    hook, _, opts = method[4:].partition(":")
    if hook not in ("allreduce", "fp16", "bf16", "powersgd", "batched_powersgd"):
        return None
    if "powersgd" in hook and "start=" not in opts:
        opts = ",".join(filter(None, [opts, f"start={a.ddp_powersgd_start}"]))
    return f"ddp:{hook}" + (f":{opts}" if opts else "")


def time_to(history, target):
    for h in history:
        if h["test_acc"] >= target:
            return h["train_time_s"], h["epoch"]
    return None, None


def summarize(entry, a):
    r = entry["result"]
    hist = r.get("history", [])
    entry["time_to_target_s"], entry["epochs_to_target"] = time_to(hist, a.target)
    entry["time_to"] = {f"{t:.2f}": time_to(hist, t)[0] for t in TARGETS}
    entry["best_acc"] = max((h["test_acc"] for h in hist), default=None)
    entry["exchanges_per_epoch"] = (r.get("exchanges") / r["epochs"]) if r.get("exchanges") is not None else None


def add_ratios(entries):
    ref = next((e for e in entries if e["method"] == REFERENCE and e["status"] == "ok"), None)
    for e in entries:
        e["vs_horovod"] = None
        if ref is None or e["status"] != "ok":
            continue
        r, rr = e["result"], ref["result"]
        e["vs_horovod"] = {
            "speedup_ms_per_step": rr["ms_per_step"] / r["ms_per_step"] if r["ms_per_step"] else None,
            "bytes_fewer": rr["bytes_sent_per_step"] / r["bytes_sent_per_step"] if r["bytes_sent_per_step"] else None,
            "speedup_time_to_target": (ref["time_to_target_s"] / e["time_to_target_s"]
                                       if ref.get("time_to_target_s") and e.get("time_to_target_s") else None),
            "acc_delta_pp": 100 * (r["test_acc"] - rr["test_acc"]),
        }


def one_line(i, n, e, a):
    if e["status"] != "ok":
        return f"[{i}/{n}] {e['method']:<34} {e['status'].upper()}: {e.get('reason', '')[:150]}"
    r = e["result"]
    v = e.get("vs_horovod_live") or {}
    sp = f" ({v['speedup_ms_per_step']:.2f}x)" if v.get("speedup_ms_per_step") else ""
    bf = f" ({v['bytes_fewer']:.1f}x fewer)" if v.get("bytes_fewer") else ""
    tt = fmt(e["time_to_target_s"], ".1f", " s") if e["time_to_target_s"] is not None else "not reached"
    return (f"[{i}/{n}] {e['method']:<34} acc {100 * r['test_acc']:5.2f}%  ms/step {r['ms_per_step']:7.2f}{sp}  "
            f"wait {fmt(r.get('comm_wait_ms_per_step'), '6.2f')}  bytes/step {fmt_bytes(r['bytes_sent_per_step'])}{bf}  "
            f"t->{100 * a.target:.0f}% {tt}  [job {e['wall_s']:.0f} s]")


def run(a):
    from tqdm import tqdm

    out = Path(a.out)
    workdir = Path(str(out) + "_logs")
    if not a.dry_run:
        workdir.mkdir(parents=True, exist_ok=True)
    methods = method_list(a)
    why_not = common.check_testbed()
    if why_not and not a.dry_run:
        sys.exit(f"compare.py: cannot build the shaped testbed: {why_not}")
    meta = {"benchmark": "compare", "machine": common.machine_info(),
            "command": "python " + " ".join(shlex.quote(x) for x in [str(Path(sys.argv[0]))] + sys.argv[1:]),
            "config": {"ranks": a.ranks, "epochs": a.epochs, "lr": a.lr, "batch_per_rank": a.batch, "seed": a.seed,
                       "target": a.target, "rate": a.rate, "tbf_latency": a.latency, "tbf_burst": a.burst,
                       "quick": a.quick, "model": "MNIST1DCNN(channels=64)", "data": "MNIST-1D 8000/2000",
                       "ddp_powersgd_start_iter": a.ddp_powersgd_start,
                       "slow_rank": a.slow_rank if a.slow_factor > 1.0 else None, "slow_factor": a.slow_factor,
                       "nodes": a.nodes or None, "ranks_per_node": a.ranks_per_node if a.nodes else None,
                       "intra": (a.intra or "unshaped") if a.nodes else None},
            "notes": ["bytes_sent_per_step: payload bytes one rank hands to the collectives per step (mean over ranks)",
                      "ms_per_step and time_to_target: training wall-clock only (test evaluation and start-up excluded)",
                      "one tbf shaper on the namespace loopback is shared by all ranks: --rate is the aggregate link",
                      "DDP comm wait: from the last bucket hook call to the end of backward()",
                      "DDP PowerSGD bytes/step average all steps, including the first start_powerSGD_iter "
                      "uncompressed ones"]}
    if a.nodes:
        meta["notes"] += ["multi-node: bytes/step of a node-aware method include its dense intra-node "
                          "reduce-scatter and allgather (fast link); the inter-node bytes are ~1/L of the "
                          "hierarchy=flat method's off-node share",
                          "multi-node: --rate shapes each node's inter-node link (both directions); "
                          "intra-node traffic stays on the node's loopback"]
    entries = []
    plans = [plan(m, a, workdir) for m in methods]
    if a.dry_run:
        for p in plans:
            if "cmd" in p:
                print(" ".join(f"{k}={shlex.quote(v)}" for k, v in p["env"].items()), " ".join(
                    shlex.quote(c) for c in testbed_prefix(a) + p["cmd"]))
            else:
                print(f"# {p['method']}: skipped ({p['reason']})")
        return None
    steps_total = (8000 // (a.batch * a.ranks)) * a.epochs
    timeout = a.timeout or (120 + 0.5 * steps_total)
    print(f"compare: {len(methods)} methods, {a.ranks} ranks x {a.epochs} epochs ({steps_total} steps), "
          f"loopback {a.rate} (tbf latency {a.latency}); output {out}.*", flush=True)
    outer = tqdm(total=len(plans), desc="methods", unit="method", position=0, dynamic_ncols=True)
    ref = None
    try:
        for i, p in enumerate(plans, 1):
            e = {k: v for k, v in p.items() if k not in ("cmd", "json", "steps_log", "env")}
            if "env" in p:
                e["env"] = dict(p["env"])
            if "cmd" not in p:
                entries.append(e)
                outer.write(one_line(i, len(plans), e, a))
                outer.update(1)
                continue
            cmd = testbed_prefix(a) + p["cmd"]
            e["cmd"] = " ".join(f"{k}={shlex.quote(v)}" for k, v in p["env"].items()) + " " + \
                " ".join(shlex.quote(c) for c in cmd)
            for f in (p["json"], Path(str(p["steps_log"]) + ".rank0")):
                f.unlink(missing_ok=True)
            counter = common.LineCounter(Path(str(p["steps_log"]) + ".rank0"))
            inner = tqdm(total=steps_total, desc=p["method"][:30], unit="step", position=1, leave=False,
                         dynamic_ncols=True)

            def progress(counter=counter, inner=inner):
                n = min(counter(), steps_total)
                if n > inner.n:
                    inner.update(n - inner.n)

            e["loadavg_before"] = common.loadavg()
            res = common.run_job(cmd, workdir / f"{common.slug(p['method'])}.log", timeout, progress, env=p["env"])
            inner.close()
            e["loadavg_after"] = common.loadavg()
            e["wall_s"] = res["wall_s"]
            e["log"] = str((workdir / f"{common.slug(p['method'])}.log").relative_to(ROOT)) \
                if str(workdir).startswith(str(ROOT)) else str(workdir / f"{common.slug(p['method'])}.log")
            if res["rc"] == 0 and p["json"].exists():
                e["status"] = "ok"
                e["result"] = json.loads(p["json"].read_text())
                if a.nodes:
                    nb = nic_bytes((workdir / f"{common.slug(p['method'])}.log").read_text(errors="replace"))
                    if nb is not None:
                        e["node1_nic_bytes"] = {"tx": nb[0], "rx": nb[1],
                                                "per_step": (nb[0] + nb[1]) / max(e["result"]["steps"], 1)}
                for r_ in range(a.ranks):
                    Path(f"{p['steps_log']}.rank{r_}").unlink(missing_ok=True)
                summarize(e, a)
                if p["method"] == REFERENCE:
                    ref = e
                if ref is not None:
                    add_ratios([ref, e])
                    e["vs_horovod_live"] = e.pop("vs_horovod")
            else:
                e["status"] = "failed"
                why = "timed out" if res["timed_out"] else f"exit {res['rc']}"
                e["reason"] = f"{why}; log tail: " + " | ".join(res["tail"].splitlines()[-4:])
            entries.append(e)
            outer.write(one_line(i, len(plans), e, a))
            outer.update(1)
            write_outputs(out, meta, entries, a, partial=True)
    except KeyboardInterrupt:
        outer.write("compare: interrupted; writing what finished")
    finally:
        outer.close()
    for e in entries:
        e.pop("vs_horovod_live", None)
    return write_outputs(out, meta, entries, a, partial=False)


def write_outputs(out: Path, meta, entries, a, partial: bool):
    add_ratios(entries)
    doc = {**meta, "partial": partial, "methods": entries}
    doc["machine"]["loadavg_end"] = common.loadavg()
    common.write_json(Path(str(out) + ".json"), doc)
    md = markdown(doc)
    Path(str(out) + ".md").write_text(md)
    if not partial:
        doc["plots"] = plots(doc, out)
        common.write_json(Path(str(out) + ".json"), doc)
        print()
        print(md)
        print(f"wrote {out}.json, {out}.md, " + ", ".join(doc["plots"]))
    return doc


def markdown(doc) -> str:
    cfg = doc["config"]
    tgt = f"{100 * cfg['target']:.0f}%"
    hdr = ["method", "framework", "final acc", "ms/step", "speed-up vs hvd", "comm wait ms/step", "bytes/step",
           "bytes fewer vs hvd", f"time to {tgt} (s)", f"speed-up to {tgt}", "exchanges/epoch"]
    rows = []
    skipped = []
    for e in doc["methods"]:
        if e["status"] != "ok":
            skipped.append(e)
            continue
        r, v = e["result"], e.get("vs_horovod") or {}
        x = lambda k: fmt(v.get(k), ".2f", "x")  # noqa: E731
        rows.append([f"`{e['method']}`", e["framework"], fmt(100 * r["test_acc"], ".2f", "%"),
                     fmt(r["ms_per_step"], ".2f"), x("speedup_ms_per_step"), fmt(r.get("comm_wait_ms_per_step"), ".2f"),
                     fmt_bytes(r["bytes_sent_per_step"]), fmt(v.get("bytes_fewer"), ".1f", "x"),
                     fmt(e["time_to_target_s"], ".1f") if e["time_to_target_s"] is not None else "not reached",
                     x("speedup_time_to_target"), fmt(e.get("exchanges_per_epoch"), ".1f")])
    if cfg.get("nodes"):
        where = (f"{cfg['nodes']} nodes x {cfg['ranks_per_node']} ranks (testbed: one network namespace per node), "
                 f"inter-node links shaped to {cfg['rate']} (tbf latency {cfg['tbf_latency']}), intra-node "
                 f"{cfg.get('intra') or 'unshaped'}")
    else:
        where = f"loopback shaped to {cfg['rate']} (tbf latency {cfg['tbf_latency']})"
    lines = [f"{cfg['ranks']} ranks x {cfg['epochs']} epochs, MNIST-1D CNN, {where}; ratios against plain Horovod "
             "(`horovod`: hvd.DistributedOptimizer itself) in the same run.", "",
             "| " + " | ".join(hdr) + " |", "|" + "---|" * len(hdr)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    if cfg.get("nodes"):
        lines += node_summary(doc)
    lines += ddp_summary(doc)
    if skipped:
        lines += ["", "Not measured:", ""]
        lines += [f"- `{e['method']}`: {e['status']} — {e.get('reason', '')}" for e in skipped]
    acc = [e for e in doc["methods"] if e["status"] == "ok"]
    if acc:
        lines += ["", "Test accuracy per epoch (cumulative training seconds):", ""]
        n = max(len(e["result"]["history"]) for e in acc)
        lines += ["| method | " + " | ".join(f"ep {i + 1}" for i in range(n)) + " |", "|" + "---|" * (n + 1)]
        for e in acc:
            cells = [f"{100 * h['test_acc']:.1f}% @ {h['train_time_s']:.1f}s" for h in e["result"]["history"]]
            lines.append(f"| `{e['method']}` | " + " | ".join(cells + [""] * (n - len(cells))) + " |")
    return "\n".join(lines) + "\n"


DDP_PAIRS = [  # (hvd_ext on DDP, the DDP baseline(s) it is held against: the faster of several)
    ("ddp+powersgd:rank=2", ["ddp:powersgd:rank=2"]),
    ("ddp+auto", ["ddp", "ddp:fp16"]),
    ("ddp+auto", ["ddp"]),
    ("ddp+topk:ratio=0.01", ["ddp", "ddp:fp16"]),
    ("ddp+qsgd:bits=8", ["ddp", "ddp:fp16"]),
]


def ddp_summary(doc):
    """hvd_ext on DDP against DDP's own hooks of the same run: step-time ratio and accuracy gap."""
    ok = {e["method"]: e["result"] for e in doc["methods"] if e["status"] == "ok"}
    rows = []
    for mine, refs in DDP_PAIRS:
        have = [r for r in refs if r in ok]
        if mine not in ok or not have:
            continue
        ref = min(have, key=lambda m: ok[m]["ms_per_step"])
        r, rr = ok[mine], ok[ref]
        rows.append(f"| `{mine}` | {' / '.join(f'`{m}`' for m in refs)} -> `{ref}` | "
                    f"{r['ms_per_step'] / rr['ms_per_step']:.2f}x | "
                    f"{100 * (r['test_acc'] - rr['test_acc']):+.2f} pt | "
                    f"{rr['bytes_sent_per_step'] / max(r['bytes_sent_per_step'], 1):.1f}x |")
    if not rows:
        return []
    return ["", "hvd_ext on PyTorch DDP (`hvd_ext.ddp`) against DDP's own hooks in this run "
            "(against the faster baseline where two are named):", "",
            "| hvd_ext on DDP | against | step time ratio | accuracy | fewer bytes |", "|---|---|---|---|---|"] + rows


def node_aware_pairs(doc):
    """[(node-aware entry, its hierarchy=flat twin or None)] among the measured methods."""
    ok = {e["method"]: e for e in doc["methods"] if e["status"] == "ok"}
    pairs = []
    for m, e in ok.items():
        if m.startswith(("horovod", "ddp")) or "hierarchy=flat" in m:
            continue
        comp, _, sync = m.partition("@")
        twin = comp + ("," if ":" in comp else ":") + "hierarchy=flat" + ("@" + sync if sync else "")
        pairs.append((e, ok.get(twin)))
    return pairs


def node_summary(doc):
    ok = {e["method"]: e for e in doc["methods"] if e["status"] == "ok"}
    ref = ok.get(REFERENCE)
    lines = ["", "Routes (per bucket) and node-aware step time against the same spec with `hierarchy=flat` "
             "and against plain Horovod, measured in this run:", "",
             "| method | routes | ms/step | vs hierarchy=flat | vs plain Horovod | node1 NIC bytes/step (tx+rx) |",
             "|---|---|---|---|---|---|"]
    for e in doc["methods"]:
        if e["status"] != "ok" or e["method"].startswith("ddp"):
            continue
        r = e["result"]
        twin = None
        for ne, fe in node_aware_pairs(doc):
            if ne is e:
                twin = fe
        vs_flat = fmt(r["ms_per_step"] / twin["result"]["ms_per_step"], ".2f", "x") if twin else "-"
        vs_hvd = fmt(r["ms_per_step"] / ref["result"]["ms_per_step"], ".2f", "x") if ref else "-"
        nic = e.get("node1_nic_bytes")
        # the routes the job took (its measured node links chose them); else the plan's prediction
        routes = ", ".join(r.get("routes") or e.get("routes") or
                           (["Horovod allreduce"] if e["method"].startswith("horovod") else ["?"]))
        trial = r.get("route_trial")
        if trial and trial.get("choice"):  # hierarchy=auto measured flat against node-aware
            routes += " (trial: " + ", ".join(f"{k} {v} ms" for k, v in trial["measured_period_ms"].items()) + \
                f"; model {trial['model']}, kept {trial['choice']})"
        lines.append(f"| `{e['method']}` | {routes} | {r['ms_per_step']:.2f} | {vs_flat} | {vs_hvd} | "
                     f"{fmt_bytes(nic['per_step']) if nic else '-'} |")
    hier = ok.get("horovod:hier")
    if hier and ref:
        lines += ["", f"`horovod:hier` (HOROVOD_HIERARCHICAL_ALLREDUCE=1): {hier['result']['ms_per_step']:.2f} ms/step, "
                  f"{hier['result']['ms_per_step'] / ref['result']['ms_per_step']:.2f}x plain Horovod; this CPU-only "
                  "Horovod build has no hierarchical allreduce operation (Horovod implements it over NCCL; on CPU "
                  "only MPI's hierarchical allgather exists), so the variable does not make the Gloo allreduce "
                  "hierarchical: the difference is run-to-run variation."]
    lines += ["", "node1 NIC bytes/step: bytes through node 1's inter-node interface during the whole job "
              "(start-up, broadcast and evaluation included) divided by the training steps."]
    return lines


def plots(doc, out: Path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [e for e in doc["methods"] if e["status"] == "ok"]
    if not ok:
        return []
    cfg = doc["config"]
    files = []
    fig, ax = plt.subplots(figsize=(8, 5))
    for e in ok:
        h = e["result"]["history"]
        style = "--" if e["framework"] != "horovod+hvd_ext" else "-"
        ax.plot([x["train_time_s"] for x in h], [100 * x["test_acc"] for x in h], style, marker="o", ms=3,
                label=e["method"])
    ax.axhline(100 * cfg["target"], color="grey", lw=0.8, ls=":")
    ax.set_xlabel("training wall-clock (s)")
    ax.set_ylabel("test accuracy (%)")
    ax.set_title(f"MNIST-1D CNN, {cfg['ranks']} ranks, loopback {cfg['rate']}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    f = Path(str(out) + "_acc_vs_time.png")
    fig.savefig(f, dpi=110)
    plt.close(fig)
    files.append(str(f))

    fig, ax = plt.subplots(figsize=(8, max(3, 0.35 * len(ok) + 1)))
    names = [e["method"] for e in ok]
    vals = [e["result"]["bytes_sent_per_step"] for e in ok]
    colors = ["tab:grey" if e["framework"] != "horovod+hvd_ext" else "tab:blue" for e in ok]
    ax.barh(names, vals, color=colors)
    ax.set_xscale("log")
    ax.invert_yaxis()
    for y, v in enumerate(vals):
        ax.text(v, y, " " + fmt_bytes(v), va="center", fontsize=7)
    ax.set_xlabel("bytes sent per step per rank (log scale)")
    ax.set_title("Payload per step (grey: Horovod / DDP peers)")
    fig.tight_layout()
    f = Path(str(out) + "_bytes.png")
    fig.savefig(f, dpi=110)
    plt.close(fig)
    files.append(str(f))
    return files


def main(argv=None):
    a = parse_args(argv)
    common.refuse_if_loaded(a)
    t0 = time.perf_counter()
    doc = run(a)
    if doc is not None:
        print(f"compare: done in {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
