"""``python -m hvd_ext.plan --measure``: measure this cluster once, write the calibration file
(:mod:`hvd_ext.exchange.calibration` gives its format) that the planner and ``compression="auto"``
(``HVD_EXT_CALIBRATION=file``) both read.

Run it under the job's launcher (``horovodrun -np N`` / ``mpirun``), on the job's nodes. It measures:

* **the flat link** -- a small and a large allreduce over all ranks (the fastest of a few tries; the
  large one of gradient-like values, :func:`gradient_like`),
  fitted to ``lat + wire / bandwidth``, as ``auto``'s own probe does; and the fixed cost of each
  kind of collective the routes use (a small allreduce, allgather and alltoall: under a launcher
  whose alltoall is slow, the two-phase routes pay it on every bucket), tried in rounds spread over
  the whole calibration, as a run of steps pays it (:func:`typical`; a collective's waits come in
  bursts: :class:`_SpreadTries`);
* **the node links** -- with several nodes of several ranks, the intra- and inter-node probes of
  :func:`hvd_ext.exchange.probe.measure_node_model`; on one node the intra link is the flat one;
* **codec speed** -- every listed spec (and ``auto``'s candidates) compresses and decodes a small
  (16k elements) and a ``codec_numel``-element gradient on this rank's device (CUDA when there is
  one), CUDA events around the work: a fixed cost per pass and elements per second, the ranks' mean.
  On a CPU, where tensors of ``HVD_EXT_COMPILE_MIN`` elements and more run compiled and smaller ones
  eagerly (:mod:`hvd_ext.ops.cpu_kernels`), the speed is fitted below that size, and the compiled
  speed at ``codec_numel`` is kept apart (``codec_compiled``, with ``compile_min``);
* **a route's host work beyond its codec's passes** -- last, each codec's flat routes run through
  the gradient pipeline on a tiny, a many-tensor and a large bucket (:mod:`hvd_ext.plan.route_overhead`),
  each exchange right after a ``step`` where one is given: seconds per bucket, tensor and element
  outside the collectives' waits;
* **compute** -- only when a ``step`` callable is given to :func:`measure` (the API): its seconds
  per call in runs of calls back to back, as training runs them (:func:`_measure_compute`); and
  then also each kind of collective **in a step** (``busy_lat_by_kind``): a small allreduce,
  allgather and alltoall timed right after every rank ran ``step`` -- what a collective costs in
  training, where it waits for the slowest rank's compute and, when ranks share cores, for the
  scheduler to run every rank's part in turn; across nodes also a node's alltoall so
  (``links.intra.busy_lat_by_kind``: the node-aware route's first collective). The planner uses
  these when present;
* **Horovod's own allreduce** -- only where hvd_ext waits otherwise than Horovod (ranks share cores:
  :mod:`hvd_ext.exchange.waiting`; on any rank, every rank measures): the flat allreduce again,
  waited for by Horovod's spinning ``synchronize``, for the planner's Horovod rows, and with a
  ``step`` its cost inside a step, both in rounds spread over the calibration (:class:`_SpreadTries`);
  and always Horovod's float16
  allreduce, which its fp16 compression uses (on a CPU Horovod sums float16 element by element in
  scalar code, slower per byte than float32; hvd_ext sums half precision in float32 itself).

Every rank runs the same collectives in the same order (its first allreduce checks that every rank was
given the same step, steps and methods, :func:`_agree`); rank 0 writes the file.
"""
from __future__ import annotations

import json
import statistics
import time
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch

from ..auto import DEFAULT_CANDIDATES
from ..compression.base import Continue, TensorInfo
from ..exchange import calibration, cost
from ..exchange.routes import STEADY_STEP
from ..ops.cpu_kernels import MIN_NUMEL, compile_enabled
from ..ops.device import Timer
from ..spec import compression_from_spec
from .route_overhead import measure_route_overhead

SMALL, LARGE = 256, 4 * 1024 * 1024  # floats per allreduce probe
BUSY_ROUNDS = 3  # rounds of tries of each collective inside a step (_measure_busy_latency)
IDLE_TRIES = 3  # tries of each collective with the ranks together, a round (_SpreadTries)
GRADIENT_SCALE = 1e-4  # of the values the probes time (gradient_like): about half below float16's smallest normal


def gradient_like(numel: int, device, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``numel`` values drawn as a gradient's: what the codecs and sums are timed on. A gradient is
    small, much of it below float16's normal range (the reason for loss scaling: Micikevicius et al.,
    "Mixed Precision Training", ICLR 2018); a Laplace sample of scale ``GRADIENT_SCALE`` puts about
    half of its entries there. Zeros would not do: on a CPU, float16 arithmetic in scalar code
    (Horovod's sum) takes a fast path on zeros and a slow one on subnormals. The draw leaves the
    caller's random stream as it was (a job may calibrate in the middle of training)."""
    with torch.random.fork_rng(devices=[]):
        return torch.distributions.Laplace(0.0, GRADIENT_SCALE).sample((numel,)).to(device=device, dtype=dtype)


def time_codec(spec: str, numel: int, device, reps: int = 3) -> float:
    """Seconds of one pass (encode or decode) of ``spec`` over ``numel`` elements on ``device``: the
    fastest of ``reps`` round trips, halved; in the codec's steady state (past any dense warm-up or
    density ramp, as the planner prices its bytes: ``STEADY_STEP``)."""
    comp = compression_from_spec(spec)
    g = gradient_like(numel, device)
    shape = torch.Size([64, numel // 64]) if numel % 64 == 0 else torch.Size([numel])
    g = g.reshape(shape)
    best = None
    for step in range(reps + 1):  # the first round pays one-time allocations and compiles
        info = TensorInfo(name="calibration", shape=shape, step=STEADY_STEP + step, rank=0, size=2, scale=0.5)
        timer = Timer(device)
        timer.mark()
        payload, ctx = comp.compress(g, info)
        if comp.collective == "allreduce":
            out = comp.decompress(payload, ctx, info)
            while isinstance(out, Continue):
                out = comp.decompress(out.payload, out.ctx, info)
        else:
            comp.aggregate([payload], ctx, info)
        timer.mark()
        comp.discard()
        dt = timer.seconds()[0]
        if step > 0:
            best = dt if best is None else min(best, dt)
    return best / 2.0


def fit_codec(spec: str, numel: int, device) -> tuple:
    """(fixed seconds per pass, elements per second) of ``spec`` as the job's tensors run it, from a
    small and a mid-sized tensor, and the elements per second at ``numel`` where that size runs
    compiled and the smaller ones do not (:func:`hvd_ext.ops.cpu_kernels.compile_enabled`; else 0):
    on a CPU a layer below the compile threshold runs eagerly, several times slower per element."""
    small = 16 * 1024
    compiled = compile_enabled(numel, device) and not compile_enabled(small, device)
    mid = min(numel, max(4 * small, MIN_NUMEL // 4), MIN_NUMEL - 1) if compiled else numel  # eager
    t_small, t_mid = time_codec(spec, small, device), time_codec(spec, mid, device)
    speed = (mid - small) / max(t_mid - t_small, 1e-9)
    fixed = max(t_small - small / speed, 0.0)
    return fixed, speed, (numel / max(time_codec(spec, numel, device) - fixed, 1e-9) if compiled else 0.0)


class _Job:
    """This job's exchange and the two collectives the measurements agree with: an allreduce and the
    ranks' mean of a list of floats."""

    def __init__(self, ex, device, transport=None):
        self.ex, self.device = ex, device
        self.top = transport if transport is not None else ex.transport
        self.N = self.top.size()  # the transport's group (a node, or the same local rank across nodes)

    def allreduce(self, t, name, op="sum"):
        return self.top.wait(self.top.allreduce_async(t, name, op=op))

    def mean(self, values):
        return self.allreduce(torch.tensor(values, dtype=torch.float64), f"hvd_ext.calibrate.{len(values)}",
                              "average").tolist()

    def small_collectives(self, tag: str) -> Dict[str, Callable[[], Any]]:
        """One small (``SMALL`` floats) allreduce, allgather and alltoall, each a call that waits for it."""
        top, N = self.top, self.N
        small = torch.zeros(SMALL, device=self.device)
        splits = [SMALL // N] * (N - 1) + [SMALL - (N - 1) * (SMALL // N)]
        return {"allreduce": lambda: self.allreduce(small, f"hvd_ext.calibrate.{tag}.ar"),
                "allgather": lambda: top.wait(top.allgather_async(small, f"hvd_ext.calibrate.{tag}.ag")),
                "alltoall": lambda: top.wait(top.alltoall_async(small, splits, f"hvd_ext.calibrate.{tag}.a2a"))}

    def run_step(self, step: Callable[[], Any]) -> None:
        """``step()``, finished on the device."""
        step()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def _tries(run: Callable[[], Any], reps: int, before: Optional[Callable[[], Any]] = None) -> List[float]:
    """Seconds of each of ``reps`` calls of ``run``, back to back, or each after an untimed ``before()``."""
    out = []
    for _ in range(reps):
        if before is not None:
            before()
        t0 = time.perf_counter()
        run()
        out.append(time.perf_counter() - t0)
    return out


def typical(rounds: Sequence[Sequence[float]]) -> float:
    """A collective's typical seconds in a run of steps, from rounds of tries: the median over the
    rounds of each round's mean try. A run of steps pays every try, its slow tail too (the mean), and
    a burst that holds one round does not decide the figure (the median over rounds)."""
    return statistics.median(statistics.fmean(r) for r in rounds)


def _flat_link(job: _Job, tag: str, dtype: torch.dtype = torch.float32) -> Dict[str, float]:
    """A small float32 allreduce and a large one of ``dtype`` over all ranks, the fastest of a few
    tries each (the link itself), fitted to ``lat + wire / bandwidth``. The large allreduce sums
    :func:`gradient_like` values, as training does (an allreduce is in place: a fresh copy each try)."""
    values = gradient_like(LARGE, job.device, dtype)
    large = values.clone()
    small = job.small_collectives(tag)["allreduce"]
    small()  # the ranks start together
    t_small = min(_tries(small, 5))
    t_large = float("inf")
    for _ in range(3):
        large.copy_(values)
        if job.device.type == "cuda":  # the copy is queued on the stream the allreduce waits for
            torch.cuda.synchronize(job.device)
        t0 = time.perf_counter()
        job.allreduce(large, f"hvd_ext.calibrate.{tag}.large")
        t_large = min(t_large, time.perf_counter() - t0)
    t_small, t_large = job.mean([t_small, t_large])
    wire = cost.allreduce_wire(large.element_size() * (LARGE - SMALL), job.N)
    return {"lat": t_small, "bandwidth": wire / max(t_large - t_small, 1e-7)}


def _measure_links(job: _Job) -> tuple:
    """The flat link (and each collective's fixed cost), and the node links across nodes;
    with the number of nodes and ranks per node."""
    from ..exchange import probe

    N = job.N
    links: Dict[str, Dict[str, Any]] = {"flat": _flat_link(job, "idle")}
    topo = job.ex.topology()
    nodes, local = (topo.cross_size, topo.local_size) if topo is not None else (1, N)
    if topo is not None and topo.multi_node:
        job.ex.node_exchanges()
        m = probe.measure_node_model(job.ex, job.device)["model"]
        links["intra"] = {"alpha": m.intra.alpha, "bandwidth": m.intra.bandwidth}
        links["inter"] = {"alpha": m.inter.alpha, "bandwidth": m.inter.bandwidth}
    elif N > 1:
        links["intra"] = {"alpha": links["flat"]["lat"] / (2.0 * (N - 1)), "bandwidth": links["flat"]["bandwidth"]}
    return links, nodes, local


def _measure_compute(job: _Job, step: Callable[[], Any], steps: int, runs: int = 3) -> float:
    """The ranks' mean of the median, over ``runs`` runs, of the seconds per ``step`` in a run of
    ``steps`` calls back to back, as training runs them: the ranks start each run together, and
    the collective library's own threads (Horovod's background loop coordinates every cycle) run
    beside them, which takes a share of the cores where ranks share them. The first call is left out."""
    tick = torch.zeros(1, device=job.device)
    job.run_step(step)
    per_step = []
    for r in range(runs):
        job.allreduce(tick, f"hvd_ext.calibrate.compute.start.{r}")
        t0 = time.perf_counter()
        for _ in range(steps):
            job.run_step(step)
        per_step.append((time.perf_counter() - t0) / steps)
    return job.mean([statistics.median(per_step)])[0]


def _measure_busy_latency(job: _Job, step: Callable[[], Any], steps: int, tag: str = "busy",
                          kinds: Sequence[str] = calibration.COLLECTIVES,
                          agree: Optional[_Job] = None, rounds: int = BUSY_ROUNDS) -> Dict[str, float]:
    """Each kind of collective's seconds right after a ``step`` on every rank (the mean over all
    ranks, ``agree``'s, of :func:`typical` of ``rounds`` rounds of ``steps`` tries, the kinds in
    turns): the fixed cost a collective has inside a training step. Where ranks share cores the tries
    are heavy-tailed (a rank waits off its core), and one short run moves from run to run."""
    run = job.small_collectives(tag)
    times: Dict[str, List[List[float]]] = {kind: [] for kind in kinds}
    for _ in range(rounds):
        for kind in kinds:
            times[kind].append(_tries(run[kind], steps, before=lambda: job.run_step(step)))
    return dict(zip(kinds, (agree or job).mean([typical(times[k]) for k in kinds])))


def spin_transport():
    """Horovod's own transport, waited for as Horovod's ``synchronize`` waits (it spins)."""
    from ..exchange.transport import HorovodTransport

    return HorovodTransport(wait="spin")


class _SpreadTries:
    """Small collectives whose typical cost is wanted, tried in rounds spread over the whole
    calibration (:meth:`round` between its other measurements). A collective's cost comes in bursts
    of a few seconds several times the usual one (``benchmarks/inside_step_probe.py``: most of all a
    spinning rank's, inside a step), and the tries of one short run can all fall into one burst; a
    step's time is an average, which pays the tail that comes every round. So a probe's figure is
    :func:`typical` of its rounds (the ranks' mean). Each probe's round starts with one untimed call,
    which lines the ranks up again (the work before differs per rank)."""

    def __init__(self, job: _Job):
        """``job``: the one the ranks agree over."""
        self.job = job
        self.probes: Dict[str, tuple] = {}
        self.rounds: Dict[str, List[List[float]]] = {}

    def add(self, name: str, run: Callable[[], Any], reps: int, before: Optional[Callable[[], Any]] = None) -> None:
        """A probe: ``reps`` tries of ``run`` a round (each after an untimed ``before()``, where given)."""
        self.probes[name] = (run, reps, before)
        self.rounds[name] = []

    def round(self) -> None:
        """One round of every probe's tries."""
        for name, (run, reps, before) in self.probes.items():
            run()
            self.rounds[name].append(_tries(run, reps, before))

    def seconds(self) -> Dict[str, float]:
        """Each probe's figure: the ranks' mean of :func:`typical` of its rounds."""
        names = list(self.probes)
        return dict(zip(names, self.job.mean([typical(self.rounds[n]) for n in names])))


def _add_idle_probes(spread: _SpreadTries, job: _Job, hjob: Optional[_Job]) -> None:
    """The fixed cost of each kind of collective with the ranks together, as a bucket's later
    collectives pay it (``lat_by_kind``), :func:`typical` of its rounds: a collective waits for the next
    cycle of Horovod's background thread, which the link's fastest try happened not to. With
    ``hjob``, Horovod's own allreduce so."""
    for kind, run in job.small_collectives("idle").items():
        spread.add(f"flat.{kind}", run, IDLE_TRIES)
    if hjob is not None:
        spread.add("horovod.allreduce", hjob.small_collectives("horovod")["allreduce"], IDLE_TRIES)


def _measure_node_busy_latency(job: _Job, step: Callable[[], Any], steps: int, links: Dict[str, Any]) -> None:
    """Across nodes, the same inside a step for a node's ranks (the group of the node-aware route's
    first collective, its reduce-scatter), into ``links["intra"]``."""
    local, _ = job.ex.node_exchanges()
    links["intra"]["busy_lat_by_kind"] = _measure_busy_latency(_Job(job.ex, job.device, local.transport), step,
                                                               steps, "intra.busy", ("alltoall",), agree=job)


def _agree(job: _Job, sleeps: bool, shape: Sequence[float]) -> bool:
    """Whether hvd_ext waits by sleeping on any rank (ranks share cores: then every rank also times
    Horovod's own allreduce, which spins), in one allreduce that also checks that every rank
    calibrates alike (``shape``: whether a step is timed, its steps a round, the codecs timed); else
    every rank raises, where their rounds would run different collectives and hang."""
    shape = [float(v) for v in shape]
    got = job.mean([1.0 if sleeps else 0.0, *shape, *(v * v for v in shape)])
    mean, square = got[1:1 + len(shape)], got[1 + len(shape):]
    if any(sq - m * m > 1e-9 * max(1.0, sq) for m, sq in zip(mean, square)):  # the ranks' values differ
        raise ValueError("hvd_ext.plan --measure: the ranks calibrate differently (a model step given or not, "
                         "--steps, the methods); give every rank the same arguments")
    return got[0] > 0


def measure(methods: Sequence[str] = (), codec_numel: int = 4 * 1024 * 1024,
            step: Optional[Callable[[], Any]] = None, steps: int = 10) -> Dict[str, Any]:
    """The calibration of this job's world (collective over Horovod's global set, through
    :class:`hvd_ext.exchange.core.Exchange` as every collective of hvd_ext)."""
    import horovod.torch as hvd

    from ..exchange.core import Exchange

    if not hvd.is_initialized():
        hvd.init()
    device = torch.device("cuda", hvd.local_rank()) if torch.cuda.is_available() else torch.device("cpu")
    job = _Job(Exchange(), device)
    # each codec once, under the key a job and the planner look it up by (Compressor.codec_spec)
    specs = [s for s in dict.fromkeys(compression_from_spec(m).codec_spec() for m in [*methods, *DEFAULT_CANDIDATES])
             if s != "none"]
    sleeps = _agree(job, getattr(job.top, "sleeps", False), (step is not None, steps, len(specs)))
    links, nodes, local = _measure_links(job)
    hjob = _Job(job.ex, device, spin_transport()) if sleeps else job
    spread = _SpreadTries(job)
    _add_idle_probes(spread, job, hjob if sleeps else None)
    if sleeps and step is not None:  # Horovod's spinning wait inside a step
        spread.add("horovod.busy", hjob.small_collectives("horovod.busy")["allreduce"], steps,
                   before=lambda: hjob.run_step(step))
    fits: List[float] = []
    for s in specs:
        spread.round()
        fits += fit_codec(s, codec_numel, device)
    fits = job.mean(fits)
    out: Dict[str, Any] = {"version": calibration.VERSION, "ranks": job.N, "nodes": nodes, "local": local,
                           "device": device.type, "links": links,
                           "codec": {s: fits[3 * i + 1] for i, s in enumerate(specs)},
                           "codec_fixed_s": {s: fits[3 * i] for i, s in enumerate(specs)},
                           "date_utc": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}
    if any(fits[3 * i + 2] > 0 for i in range(len(specs))):  # (the same on every rank: the ranks' mean)
        out["codec_compiled"] = {s: fits[3 * i + 2] for i, s in enumerate(specs) if fits[3 * i + 2] > 0}
        out["compile_min"] = MIN_NUMEL
    if step is not None:
        spread.round()
        out["compute_s"] = _measure_compute(job, step, steps)
        spread.round()
        links["flat"]["busy_lat_by_kind"] = _measure_busy_latency(job, step, steps)
        if "inter" in links:  # node groups made (every node runs as many ranks: Topology.multi_node)
            _measure_node_busy_latency(job, step, steps, links)
    if sleeps:
        spread.round()
        links["horovod"] = _flat_link(hjob, "horovod")
    # Horovod's own float16 allreduce (its fp16 compression), whose sum on a CPU is scalar code
    spread.round()
    links["horovod_fp16"] = _flat_link(hjob, "horovod.fp16", dtype=torch.float16)
    spread.round()
    _put_spread(links, spread.seconds())
    out["route_overhead_s"] = measure_route_overhead(job, specs, {s: calibration.codec_timing(out, s) for s in specs},
                                                     gradient_like, step)
    return out


def _put_spread(links: Dict[str, Any], figures: Dict[str, float]) -> None:
    """The spread probes' figures into the file's links: ``flat.lat_by_kind``, and where timed
    ``horovod.lat_by_kind`` and ``horovod.busy_lat_by_kind`` (its allreduce)."""
    links["flat"]["lat_by_kind"] = {k: figures[f"flat.{k}"] for k in calibration.COLLECTIVES}
    if "horovod.allreduce" in figures:
        links["horovod"]["lat_by_kind"] = {"allreduce": figures["horovod.allreduce"]}
    if "horovod.busy" in figures:
        links["horovod"]["busy_lat_by_kind"] = {"allreduce": figures["horovod.busy"]}


def measure_to_file(path: str, methods: Sequence[str] = (), **kw) -> Dict[str, Any]:
    """:func:`measure`, written to ``path`` by rank 0 (and checked by reading it back)."""
    import horovod.torch as hvd

    cal = measure(methods, **kw)
    if hvd.rank() == 0:
        with open(path, "w") as f:
            json.dump(cal, f, indent=1)
        calibration.load(path)
        print(f"hvd_ext.plan: calibration of {cal['ranks']} ranks ({cal['nodes']} node(s)) written to {path}")
    return cal
