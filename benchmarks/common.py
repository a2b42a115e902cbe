"""Shared helpers for the benchmarks: machine description, the shaped-cluster
wrapper, running a launched job with a step-progress bar, and small formatters."""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import os
import platform
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional

ROOT = Path(__file__).resolve().parents[1]
SHAPED = ROOT / "scripts" / "shaped-cluster"
RESULTS = ROOT / "benchmarks" / "results"
PY = sys.executable


def fmt_metric(metric: str, v) -> str:
    """A workload's metric as the results print it: accuracy in percent, a loss to 3 decimals, '—' if none."""
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "—"
    return f"{100 * v:.2f}%" if metric == "acc" else f"{v:.3f}"


def busy_load(machine: Dict) -> Optional[float]:
    """The 1-minute load at a run's start when it was above twice the core count (the benchmark's own
    ranks load the machine too, so only that marks it busy); else None."""
    start, cpus = machine.get("loadavg_start"), machine.get("cpus")
    return float(start[0]) if start and cpus and float(start[0]) > 2 * float(cpus) else None


def machine_info() -> Dict:
    """What ran the benchmark: host, CPU, cores, memory, kernel, library versions, git commit, date."""
    info = {"date_utc": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC"),
            "host": platform.node(), "kernel": platform.release(), "python": platform.python_version(),
            "cpus": os.cpu_count()}
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("MemTotal"):
                info["mem_gib"] = round(int(line.split()[1]) / 2**20, 1)
                break
    except OSError:
        pass
    for mod in ("torch", "horovod"):
        try:
            info[mod] = __import__(mod).__version__
        except Exception:  # noqa: BLE001
            info[mod] = None
    try:
        info["git_commit"] = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                                            capture_output=True, text=True, timeout=10).stdout.strip() or None
        dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain"], capture_output=True, text=True,
                               timeout=10).stdout.strip()
        info["git_dirty"] = bool(dirty)
    except Exception:  # noqa: BLE001
        info["git_commit"] = None
    info["loadavg_start"] = loadavg()
    return info


def add_load_option(parser) -> None:
    """``--allow-load``: write results even when the machine is busy (see ``refuse_if_loaded``)."""
    parser.add_argument("--allow-load", action="store_true",
                        help="run and write results even when the 1-minute load average is above the core count")


def refuse_if_loaded(args) -> None:
    """Timings on a busy machine measure contention, not the method: stop before running when the
    1-minute load average is above the core count, unless ``--allow-load`` (the load is recorded with
    every result either way, ``machine_info()['loadavg_start']``)."""
    load, cores = loadavg(), os.cpu_count() or 1
    if getattr(args, "allow_load", False):
        return
    waited = 0
    while load is not None and load[0] > cores and waited < 180:  # a run just before us: its load decays
        if waited == 0:
            print(f"load average {load[0]:.2f} above {cores} cores: waiting up to 180 s for it to fall", flush=True)
        time.sleep(10)
        waited += 10
        load = loadavg()
    if load is not None and load[0] > cores:
        raise SystemExit(f"load average {load[0]:.2f} is above the {cores} cores: timings would measure "
                         "contention. Wait for a quiet machine, or pass --allow-load to run anyway.")


def loadavg() -> Optional[List[float]]:
    try:
        return [float(x) for x in open("/proc/loadavg").read().split()[:3]]
    except OSError:
        return None


def check_testbed() -> Optional[str]:
    """None when shaped runs are possible here, else the reason they are not."""
    if os.geteuid() != 0:
        return "not root: network namespaces and tc need CAP_NET_ADMIN"
    import shutil

    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"'{tool}' (iproute2) not found"
    return None


# The testbed's shapers (tc tbf). ``bucket``: scripts/shaped-cluster's default, a 256 KiB bucket over loopback's 64 KiB
# MTU, which lets 256 KiB through at once after every idle spell, and a 50 ms queue; ``line``: loopback's
# MTU lowered to 9000, a 16 KiB bucket and a 400 ms queue, a link at its rate with no such allowance and
# no drops where every rank sends at once (8 ranks' alltoall overflows a 50 ms queue: TCP then recovers
# from losses), as the planner models a link.
SHAPERS = {"bucket": {"burst": "256kb", "latency": "50ms"},
           "line": {"mtu": "9000", "burst": "16kb", "latency": "400ms"}}


def shaped_prefix(rate: Optional[str], latency: str = "50ms", burst: str = "256kb",
                  shaper: Optional[str] = None) -> List[str]:
    """Command prefix that runs what follows in a fresh namespace; rate None = unshaped namespace;
    ``shaper`` (a key of :data:`SHAPERS`) sets the bucket and the queue, else ``burst`` and ``latency`` do."""
    if rate is None or str(rate).lower() in ("none", "unshaped", "0"):
        return [str(SHAPED), "--unshaped", "--"]
    opts = SHAPERS[shaper] if shaper else {"burst": burst, "latency": latency}
    return [str(SHAPED), "--rate", str(rate), *[a for k, v in opts.items() for a in (f"--{k}", v)], "--"]


def hvd_launcher(np_: int, kind: str = "gloo") -> List[str]:
    """Horovod launch prefix. gloo: TCP over loopback (shaped). mpi: Open MPI forced onto TCP over lo
    (its default shared-memory transport would bypass the shaper)."""
    if kind == "gloo":
        return ["horovodrun", "-np", str(np_), "-H", f"localhost:{np_}", "--gloo"]
    if kind == "mpi":
        return ["mpirun", "-np", str(np_), "--bind-to", "none", "--mca", "btl", "tcp,self",
                "--mca", "btl_tcp_if_include", "lo", "--mca", "oob_tcp_if_include", "lo"]
    raise ValueError(f"unknown launcher {kind!r}")


def flat_worlds(ranks: List[int], rates: List[str], shaper: str = "bucket"):
    """(N, rate, launch prefix) for N ranks on one node whose loopback is shaped to ``rate`` (``unshaped``: not)
    by ``shaper`` (:data:`SHAPERS`)."""
    for n in ranks:
        for rate in rates:
            yield n, rate, shaped_prefix(None if rate == "unshaped" else rate, shaper=shaper) + hvd_launcher(n)


def two_nodes_launcher(rate: str, ranks_per_node: int = 2, shaper: str = "bucket") -> List[str]:
    """The 2-node testbed (``scripts/shaped-cluster``: a namespace per node, the links between nodes shaped to
    ``rate`` by ``shaper``'s bucket and queue; their MTU is eth0's, 1500) with horovodrun over it, ``ranks_per_node``
    ranks on each node."""
    n = 2 * ranks_per_node
    return [str(SHAPED), "--nodes", "2", "--ranks-per-node", str(ranks_per_node), "--inter", rate,
            "--burst", SHAPERS[shaper]["burst"], "--latency", SHAPERS[shaper]["latency"], "--",
            "horovodrun", "-np", str(n), "-H", f"node1:{ranks_per_node},node2:{ranks_per_node}", "--gloo",
            "--start-timeout", "120"]


def add_world_options(ap, out: str, steps: int, rounds: int, ranks: List[int], rates: List[str],
                      shaper: str = "bucket") -> None:
    """A benchmark over worlds of ``--ranks`` ranks on links at ``--rates`` shaped by ``--shaper``: those, the
    options of :func:`add_worker_options` and ``--allow-load``."""
    ap.add_argument("--ranks", type=int, nargs="+", default=ranks)
    ap.add_argument("--rates", nargs="+", default=rates)
    ap.add_argument("--shaper", choices=sorted(SHAPERS), default=shaper,
                    help="the shaped links' token bucket (benchmarks/common.py, SHAPERS)")
    add_worker_options(ap, out=out, steps=steps, rounds=rounds)
    add_load_option(ap)


def add_worker_options(ap, out: str, steps: int, rounds: int) -> None:
    """The options of a benchmark whose worlds each run one job of the main job's CNN, methods in turns
    (``--rounds`` of ``--steps`` steps), and its worker's hidden ones; :func:`worker_args` forwards them."""
    ap.add_argument("--channels", type=int, default=128)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=steps)
    ap.add_argument("--rounds", type=int, default=rounds)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--out", default=out, help="results name: benchmarks/results/OUT.{json,md}")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--worker-out", default=None, help=argparse.SUPPRESS)


def worker_args(args) -> List[str]:
    """The options of :func:`add_worker_options` that a world's job passes on to its worker."""
    return ["--channels", str(args.channels), "--batch", str(args.batch), "--steps", str(args.steps),
            "--rounds", str(args.rounds), "--warmup", str(args.warmup)]


def main_cnn_run(method: str, channels: int, spec: Optional[str] = None):
    """(model, optimizer) of the main job's CNN (MNIST-1D, SGD with momentum 0.9, seed 0) for ``method``:
    ``compute`` (no exchange), ``horovod`` / ``horovod fp16`` (Horovod's own optimizer), else hvd_ext's
    optimizer with ``spec`` (default: the method). Call after ``hvd.init()``."""
    import horovod.torch as hvd
    import torch

    import hvd_ext
    from hvd_ext.examples.mnist1d import MNIST1DCNN

    torch.manual_seed(0)
    model = MNIST1DCNN(channels)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    if method.startswith("horovod"):
        comp = hvd.Compression.fp16 if method.endswith("fp16") else hvd.Compression.none
        opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(), compression=comp)
    elif method != "compute":
        opt = hvd_ext.DistributedOptimizer(opt, named_parameters=model.named_parameters(), compression=spec or method)
    return model, opt


def main_cnn_step(batch: int) -> Callable:
    """A step of a :func:`main_cnn_run` on one fixed random batch of ``batch`` samples."""
    import torch
    import torch.nn.functional as F

    x, y = torch.randn(batch, 40), torch.randint(0, 10, (batch,))

    def step(run):
        model, opt = run
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return step


def time_in_turns(runs: Dict, step: Callable, rounds: int, steps: int, sync: Callable[[str], None],
                  count: Optional[Callable[[], int]] = None, counted: Optional[Dict] = None) -> Dict:
    """Seconds per step of each of ``runs`` (key -> what ``step`` takes): ``rounds`` rounds in which every
    run takes ``steps`` steps in turn, so the machine's drift hits them alike; ``sync(name)`` lines the
    ranks up before each turn. With ``count`` (e.g. :func:`interface_tx_bytes`), ``counted[key]`` gets
    each turn's (increase of ``count()``, seconds) as well."""
    if count is not None and counted is None:
        raise ValueError("time_in_turns: give `counted`, the dict the counts go in, with `count`")
    times: Dict = {k: [] for k in runs}
    for r in range(rounds):
        for k, run in runs.items():
            sync(f"turns.{r}.{k}")
            c0 = count() if count is not None else 0
            t0 = time.perf_counter()
            for _ in range(steps):
                step(run)
            dt = time.perf_counter() - t0
            if count is not None:
                counted.setdefault(k, []).append((count() - c0, dt))
            times[k].append(dt / steps)
    return times


def interface_tx_bytes(iface: str) -> Optional[int]:
    """The bytes network interface ``iface`` of this rank's namespace has sent (its kernel counter:
    payload, TCP/IP headers and acknowledgements), or None where it cannot be read."""
    try:
        return int(Path(f"/sys/class/net/{iface}/statistics/tx_bytes").read_text())
    except (OSError, ValueError):
        return None


def run_worker(script: str, logs: str, stem: str, launch: List[str], worker_args: List[str],
               label: str, timeout: float = 900) -> Optional[Dict]:
    """``launch`` (testbed + launcher prefix) runs ``script --worker``, which writes its JSON to
    benchmarks/results/LOGS/STEM.json (its output to STEM.log); that JSON, or None (said) if it failed."""
    out = RESULTS / logs / f"{stem}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.unlink(missing_ok=True)
    cmd = launch + [PY, str(Path(script).resolve()), "--worker", "--worker-out", str(out), *worker_args]
    r = run_job(cmd, out.with_suffix(".log"), timeout=timeout)
    if r["rc"] != 0 or not out.exists():
        print(f"{label}: failed (rc {r['rc']}); see {out.with_suffix('.log')}\n{r['tail']}")
        return None
    return json.loads(out.read_text())


TESTBED_NODES_WAIT = "sleep"  # HVD_EXT_WAIT of the 2 nodes x 2 worlds (run_worlds: why)


def run_worlds(script: str, logs: str, args, summary: Callable[[Dict], str]) -> List[Dict]:
    """One job per world of ``args`` (``--ranks`` x ``--rates`` on one node, then 2 nodes x 2 ranks at
    each ``--nodes2x2`` rate), each running ``script --worker`` (:func:`run_worker`): their results,
    each with its link and the load at its end, and ``summary(result)`` printed. The 2-node worlds set
    ``HVD_EXT_WAIT`` to :data:`TESTBED_NODES_WAIT`: the testbed's nodes share this machine's cores,
    which a rank cannot see (each node is a host of its own), so hvd_ext's ranks wait as on a node
    with more ranks than cores."""
    worlds = [(f"np {n} {rate}", rate, f"np{n}_{rate}", launch)
              for n, rate, launch in flat_worlds(args.ranks, args.rates, args.shaper)]
    worlds += [(f"2x2 {rate}", f"2 nodes x 2, inter {rate}", f"2x2_{rate}",
                ["env", f"HVD_EXT_WAIT={TESTBED_NODES_WAIT}"] + two_nodes_launcher(rate, shaper=args.shaper))
               for rate in getattr(args, "nodes2x2", [])]
    results = []
    for label, link, stem, launch in worlds:
        res = run_worker(script, logs, stem, launch, worker_args(args), label)
        if res is None:
            continue
        res.update(rate=link, shaper=args.shaper, loadavg_end=loadavg())
        results.append(res)
        print(f"{label}: {summary(res)}")
    return results


def results_doc(script: str, argv: Optional[List[str]], machine: Dict, load, results: List[Dict]) -> Dict:
    """A benchmark's results file: the machine, its load at the start, the results and the command."""
    return {"machine": machine, "loadavg_start": load, "results": results,
            "command": f"python benchmarks/{script} " + " ".join(argv if argv is not None else sys.argv[1:])}


def save_results(name: str, doc, render: Callable[[Dict], str]) -> None:
    """``doc`` to benchmarks/results/NAME.json and its rendering to NAME.md; the rendering printed."""
    write_json(RESULTS / f"{name}.json", doc)
    text = render(doc)
    (RESULTS / f"{name}.md").write_text(text)
    print(text)


def add_one_job_options(ap, ranks: int) -> None:
    """``--ranks`` (default ``ranks``), the load option and the worker's hidden options of a
    :func:`one_job_benchmark`."""
    ap.add_argument("--ranks", type=int, default=ranks)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--worker-out", default=None, help=argparse.SUPPRESS)
    add_load_option(ap)


def one_job_benchmark(script: str, name: str, argv: Optional[List[str]], args, worker_args: List[str],
                      render: Callable[[Dict], str], rate: Optional[str] = None) -> None:
    """A benchmark of one ``horovodrun --gloo`` job of ``args.ranks`` ranks in a namespace, unshaped or
    its loopback at ``rate`` on the ``line`` shaper (:data:`SHAPERS`): refuse a loaded machine, run
    ``script --worker`` (:func:`run_worker`), save its result as NAME.{json,md}."""
    refuse_if_loaded(args)
    machine, load = machine_info(), loadavg()
    prefix = shaped_prefix(rate, shaper="line" if rate else None)
    res = run_worker(script, f"{name}_logs", f"np{args.ranks}", prefix + hvd_launcher(args.ranks),
                     worker_args, f"np {args.ranks}")
    if res is None:
        raise SystemExit(1)
    save_results(name, results_doc(Path(script).name, argv, machine, load, [res]), render)


def torchrun_launcher(np_: int, port: int = 29511) -> List[str]:
    return [str(Path(PY).with_name("torchrun")), "--nnodes", "1", "--nproc_per_node", str(np_),
            "--master_addr", "127.0.0.1", "--master_port", str(port)]


def slug(s: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.=-]+", "_", s).strip("_")[:80] or "x"


def child_env() -> Dict[str, str]:
    env = dict(os.environ)
    env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
    env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    env.setdefault("OMPI_MCA_rmaps_base_oversubscribe", "1")
    env.setdefault("OMP_NUM_THREADS", "1")
    env["GLOO_SOCKET_IFNAME"] = "lo"
    env["PATH"] = str(Path(PY).parent) + os.pathsep + env.get("PATH", "")
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def run_job(cmd: List[str], log_file: Path, timeout: float, progress: Optional[Callable[[], None]] = None,
            poll_s: float = 0.5, env: Optional[Dict[str, str]] = None) -> Dict:
    """Run cmd (a shaped-cluster command) in its own session, output to log_file; call progress()
    every poll_s. On timeout or Ctrl-C the session gets SIGTERM (shaped-cluster then removes its
    namespace), SIGKILL 15 s later. Returns {rc, wall_s, timed_out, tail}."""
    log_file.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    timed_out = False
    with open(log_file, "w") as out:
        out.write("$ " + " ".join(f"{k}={shlex.quote(v)}" for k, v in (env or {}).items()) + " "
                  + " ".join(shlex.quote(c) for c in cmd) + "\n")
        out.flush()
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env={**child_env(), **(env or {})}, cwd=str(ROOT), start_new_session=True)
        try:
            while proc.poll() is None:
                if time.perf_counter() - t0 > timeout:
                    timed_out = True
                    _stop(proc)
                    break
                if progress is not None:
                    progress()
                time.sleep(poll_s)
        except BaseException:
            _stop(proc)
            raise
        rc = proc.wait()
        if progress is not None:
            progress()
    return {"rc": rc, "wall_s": time.perf_counter() - t0, "timed_out": timed_out, "tail": tail(log_file)}


def _stop(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()


def tail(path: Path, n: int = 15) -> str:
    try:
        lines = [ln for ln in Path(path).read_text(errors="replace").splitlines()
                 if "hostname of the client socket" not in ln and ln.strip()]
    except OSError:
        return ""
    return "\n".join(lines[-n:])


class LineCounter:
    """Counts lines of a growing file (a per-step JSON-lines log) without rereading it."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.pos = 0
        self.count = 0

    def __call__(self) -> int:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.pos)
                chunk = f.read()
        except OSError:
            return self.count
        if chunk:
            complete = chunk[:chunk.rfind(b"\n") + 1]
            self.count += complete.count(b"\n")
            self.pos += len(complete)
        return self.count


def fmt_bytes(b: Optional[float]) -> str:
    if b is None:
        return "—"
    for unit, k in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if b >= k:
            return f"{b / k:.3g} {unit}"
    return f"{b:.0f} B"


def fmt(x: Optional[float], spec: str = ".1f", suffix: str = "") -> str:
    return "—" if x is None else f"{x:{spec}}{suffix}"


def write_json(path: Path, obj) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1))
    os.replace(tmp, path)
