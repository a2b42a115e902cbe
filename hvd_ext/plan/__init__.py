"""``hvd_ext.plan``: will compression pay on my cluster? Predicted bytes, exchange and step time for
Horovod's own allreduce (fp32, fp16, hierarchical), every hvd_ext codec on each route it can take,
and what ``compression="auto"`` would pick, before the cluster is rented.

    python -m hvd_ext.plan --model resnet50 --cluster p3-v100-25gbe --nodes 4
    hvd_ext.plan(model, compute_s=0.1, cluster="dgx-a100", nodes=16).table()

The model is :mod:`hvd_ext.plan.model` (alpha-beta links, codec passes, overlap with backward); the
inputs are named presets with their sources (:mod:`hvd_ext.plan.presets`) or a calibration file
``python -m hvd_ext.plan --measure`` writes on the user's own cluster
(:mod:`hvd_ext.plan.calibration`), which ``compression="auto"`` reads too. Agarwal et al., "On the
utility of gradient compression in distributed training systems" (MLSys 2022), use the same
accounting and the same warning: against fp16 allreduce on a fast network compression rarely pays.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Optional, Sequence, Union

from ..auto import (AUTO_OPTIONS, DEFAULT_CANDIDATES, AutoCompression, AutoTuner, fastest_candidate,
                    most_accurate_within)
from ..exchange import calibration as cal_file
from ..exchange import codec_speed, cost
from ..optimizer import DEFAULT_BUCKET_BYTES
from ..spec import compression_from_spec
from . import presets
from .model import Cluster, Row, bind_like, check_optimizer, codec_rows, horovod_rows, make_row, numel_of

DEFAULT_METHODS = ("fp16", "qsgd:bits=8", "qsgd:bits=4", "topk:ratio=0.01", "efsignsgd", "powersgd:rank=4",
                   "qdist:bits=3")
CHUNK = 2048 * 2048  # a bare parameter count is split into matrices of this many elements
PAYS = 1.05  # a method "pays" when its predicted step is at least this much faster than fp32 Horovod


@dataclass
class Plan:
    """Rows (one per method and route), the Horovod baselines and ``auto``'s pick, with the inputs."""

    rows: List[Row]
    compute_s: float
    cluster: Cluster
    inputs: Dict[str, Any] = field(default_factory=dict)
    auto_pick: Dict[str, int] = field(default_factory=dict)
    shapes: List[tuple] = field(default_factory=list, repr=False)
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    optimizer: str = "sgd"

    def sweep(self, bandwidths: Sequence[float]) -> Dict[str, List[float]]:
        """Predicted step seconds at each inter-node bandwidth (bytes/s; one node: intra), per method on
        its fastest route there, and ``auto``."""
        out: Dict[str, List[float]] = {}
        for bw in bandwidths:
            rows, _ = predict_rows(self.shapes, self.compute_s, with_bandwidth(self.cluster, bw),
                                   self.inputs["methods"], self.bucket_bytes, optimizer=self.optimizer)
            best: Dict[str, float] = {}
            for r in rows:
                best[r.label] = min(best.get(r.label, math.inf), r.step_s)
            for k, v in best.items():
                out.setdefault(k, []).append(v)
        return out

    def row(self, label: str, route: Optional[str] = None) -> Row:
        for r in self.rows:
            if r.label == label and (route is None or r.route == route):
                return r
        raise KeyError(f"no row {label!r}{'' if route is None else ' on ' + route}")

    def speedup(self, r: Row, baseline: str = "horovod") -> float:
        return self.row(baseline).step_s / r.step_s

    def records(self) -> List[Dict[str, Any]]:
        out = []
        for r in self.rows:
            out.append({"method": r.label, "route": r.route, "wire_bytes_per_rank": r.wire,
                        "nic_bytes": r.nic, "exchange_s": r.exchange_s, "step_s": r.step_s,
                        "speedup_vs_fp32": self.speedup(r), "speedup_vs_fp16": self.speedup(r, "horovod fp16"),
                        "pays_below_bandwidth": self.inputs.get("breakeven", {}).get(f"{r.label}|{r.route}"),
                        "note": r.note})
        return out

    def table(self) -> str:
        """A markdown table, one row per method and route, fastest first."""
        hdr = ("| method | route | MB/rank | MB on busiest link | exchange ms | step ms | vs fp32 | vs fp16 "
               "| pays below |\n|---|---|---|---|---|---|---|---|---|")
        lines = [hdr]
        for rec in sorted(self.records(), key=lambda d: d["step_s"]):
            be = rec["pays_below_bandwidth"]
            lines.append(f"| {rec['method']} | {rec['route']} | {rec['wire_bytes_per_rank'] / 1e6:.2f} | "
                         f"{rec['nic_bytes'] / 1e6:.2f} | {rec['exchange_s'] * 1e3:.2f} | {rec['step_s'] * 1e3:.2f} "
                         f"| {rec['speedup_vs_fp32']:.2f}x | {rec['speedup_vs_fp16']:.2f}x | {fmt_bandwidth(be)} |")
        return "\n".join(lines)


def fmt_bandwidth(b: Optional[float]) -> str:
    """Bytes/s as Gbit/s; 'always' / 'never' for the open ends of the search."""
    if b is None:
        return "—"
    if b == math.inf:
        return "always"
    if b == 0:
        return "never"
    return f"{b * 8 / 1e9:.3g} Gbit/s"


def tensor_shapes(model: Union[int, Sequence[int], Any]) -> List[tuple]:
    """Tensor shapes from a parameter count (split into 2048 x 2048 matrices and a remainder), a list
    of sizes (1-D) or shapes, a torch module or its ``named_parameters()``."""
    bad = ("plan: model must be a parameter count >= 1, a list of tensor sizes or shapes (each >= 1), "
           "a torch module or its named_parameters()")
    if isinstance(model, bool):
        raise ValueError(bad)
    if isinstance(model, int):
        if model < 1:
            raise ValueError(f"{bad}; got {model!r}")
        full, rest = divmod(model, CHUNK)
        return [(2048, CHUNK // 2048)] * full + ([(rest,)] if rest else [])
    if hasattr(model, "named_parameters"):
        model = model.named_parameters()
    shapes = []
    for item in model:
        if isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str):
            item = item[1]
        if hasattr(item, "requires_grad"):
            if item.requires_grad:
                shapes.append(tuple(item.shape))
        elif isinstance(item, (tuple, list)):
            shapes.append(tuple(int(d) for d in item))
        else:
            shapes.append((int(item),))
    if not shapes or any(math.prod(s) < 1 for s in shapes):
        raise ValueError(bad)
    return shapes


def auto_row(shapes: Sequence[tuple], compute_s: float, c: Cluster, bucket_bytes: int,
             candidates: Sequence[str] = DEFAULT_CANDIDATES, optimizer: str = "sgd") -> tuple:
    """What ``auto`` would pick per bucket: each candidate it allows under ``optimizer`` (as
    :meth:`hvd_ext.auto.AutoCompression.allowed`: no memory under a live second moment, no codec that
    compresses the momentum under momentum SGD) on each bucket's fastest route, then the most accurate within
    ``slack`` of the fastest's share of the step (the rule of :meth:`hvd_ext.auto.AutoTuner._choose`).
    Assumes every allowed candidate passes the accuracy guard (that verdict depends on the gradients)."""
    auto = AutoCompression([(s, compression_from_spec(s)) for s in candidates])
    bind_like(auto, optimizer)
    # per candidate and bucket: (route, cost) by the bucket's own cost (unaware of fusion), as the job's
    # auto takes its route (hvd_ext.auto.AutoTuner._route), the first listed on ties; none where not allowed
    per_cand = []
    for i, spec in enumerate(auto.candidate_specs):
        rows = codec_rows(spec, shapes, compute_s, c, bucket_bytes, optimizer) if auto.allowed(i) else []
        per_cand.append([min(((r.route, r.buckets[b]) for r in rows), key=lambda rb: rb[1].seconds)
                         for b in range(len(rows[0].buckets))] if rows else None)
    some = next(cand for cand in per_cand if cand is not None)
    secs = [[math.inf if cand is None else cand[b][1].seconds for cand in per_cand] for b in range(len(some))]
    dense = AutoTuner.dense_index(auto)
    fastest = [fastest_candidate(times, dense) for times in secs]
    total = sum(b.numel for _, b in some) or 1
    step = compute_s + sum(times[f] for times, f in zip(secs, fastest))
    slack = AUTO_OPTIONS["slack"].default
    chosen, labels = [], []
    for b, (times, f) in enumerate(zip(secs, fastest)):
        k = most_accurate_within(times, f, slack * step * some[b][1].numel / total)
        route, cost_b = per_cand[k][b]
        chosen.append(cost_b)
        labels.append(f"{auto.candidate_specs[k]} ({route})")
    picks = {label: labels.count(label) for label in dict.fromkeys(labels)}
    note = "; ".join(f"{k}: {v} bucket{'s' * (v > 1)}" for k, v in picks.items())
    row = make_row("auto", "auto", "per bucket", chosen, compute_s, c, note)
    row.picks = labels
    return row, picks


def breakeven(speedup_at, lo: float = 1e6, hi: float = 1e12) -> Optional[float]:
    """The bandwidth (bytes/s) below which a method pays, i.e. ``speedup_at(bw)`` (its step-time
    speed-up over fp32 Horovod at that inter-node bandwidth; one node: intra) is at least ``PAYS``:
    ``inf`` if it pays everywhere in [lo, hi], 0 if nowhere. A bisection in log bandwidth: the
    speed-up falls as the link gets faster."""
    if speedup_at(hi) >= PAYS:
        return math.inf
    if speedup_at(lo) < PAYS:
        return 0.0
    a, b = math.log(lo), math.log(hi)
    for _ in range(30):
        m = (a + b) / 2
        if speedup_at(math.exp(m)) >= PAYS:
            a = m
        else:
            b = m
    return math.exp((a + b) / 2)


def make_cluster(cluster: Union[str, presets.Cluster, None], nodes: int, gpus_per_node: Optional[int],
                 intra: Optional[cost.LinkModel], inter: Optional[cost.LinkModel], device: Optional[str],
                 calibration: Optional[Dict[str, Any]]) -> tuple:
    """The model's :class:`Cluster` from a preset, overrides and a calibration (its links and codec
    speeds win over the preset's; explicit links win over both); with the device name."""
    if isinstance(cluster, str):
        if cluster not in presets.CLUSTERS:
            raise ValueError(f"plan: unknown cluster {cluster!r}; accepted: {', '.join(presets.CLUSTERS)}")
        cluster = presets.CLUSTERS[cluster]
    links = (calibration or {}).get("links", {})
    link = lambda k: cost.LinkModel(alpha=links[k]["alpha"], bandwidth=links[k]["bandwidth"])  # noqa: E731
    intra = intra or (link("intra") if "intra" in links else None) or (
        cluster.intra if cluster is not None else None)
    inter = inter or (link("inter") if "inter" in links else None) or (
        cluster.inter if cluster is not None else intra)
    local = gpus_per_node or (cluster.gpus_per_node if cluster is not None else (calibration or {}).get("local"))
    if intra is None or local is None:
        raise ValueError("plan: give a cluster preset, or gpus_per_node and the links (intra, inter), or a "
                         "calibration file")
    if nodes < 1 or local < 1:
        raise ValueError(f"plan: nodes and gpus_per_node must be >= 1, got {nodes} and {local}")
    device = device or (cluster.device if cluster is not None else
                        "cpu" if (calibration or {}).get("device", "cpu") == "cpu" else None)
    if device not in presets.DEVICES:
        raise ValueError(f"plan: unknown device {device!r}; accepted: {', '.join(presets.DEVICES)}")
    # each family's default, as a job prices a codec no file timed (its device here a named preset)
    gbs = None if device == "cpu" else presets.DEVICES[device].copy_gbs
    codec = {fam: codec_speed.pass_speed_at(fam, gbs) for fam in codec_speed.CPU_ROUND_TRIP}
    codec.update((calibration or {}).get("codec", {}))
    fixed = dict((calibration or {}).get("codec_fixed_s", {}))
    same_world = cal_file.timed_here(calibration, nodes * local, nodes, local)
    flat = links.get("flat", {})
    # measured for this world only; inside a step (after compute) where the calibration timed it there
    lat, idle = cal_file.collective_latencies(calibration, nodes * local, nodes, local) or ({}, {})
    hv = links.get("horovod") if same_world and "bandwidth" in flat else None
    hv_lat = (hv.get("busy_lat_by_kind") or hv.get("lat_by_kind") or {}).get("allreduce", hv["lat"]) if hv else None
    base = hv or flat  # Horovod's float32 allreduce, against which its float16 one is measured
    h16 = links.get("horovod_fp16") if same_world and "bandwidth" in flat else None
    compiled = dict((calibration or {}).get("codec_compiled", {}))
    return Cluster(nodes, local, intra, inter, codec=codec, codec_on_compute=device == "cpu",
                   allreduce_tree=device != "cpu",
                   codec_fixed=fixed,
                   route_overhead=dict((calibration or {}).get("route_overhead_s", {})) if same_world else {},
                   codec_compiled=compiled, compile_min=(calibration or {}).get("compile_min") if compiled else None,
                   collective_lat=lat, idle_lat=idle,
                   horovod_lat=hv_lat,
                   horovod_slowdown=flat["bandwidth"] / hv["bandwidth"] if hv else 1.0,
                   horovod_fp16_slowdown=base["bandwidth"] / h16["bandwidth"] if h16 else 1.0,
                   intra_lat=cal_file.node_latencies(calibration, nodes * local, nodes, local)), device


def predict_rows(shapes: Sequence[tuple], compute_s: float, c: Cluster, methods: Iterable[str],
                 bucket_bytes: int, with_auto: bool = True, optimizer: str = "sgd") -> tuple:
    rows = horovod_rows(shapes, compute_s, c)
    for spec in methods:
        rows += codec_rows(spec, shapes, compute_s, c, bucket_bytes, optimizer)
    picks = {}
    if with_auto:
        r, picks = auto_row(shapes, compute_s, c, bucket_bytes, optimizer=optimizer)
        rows.append(r)
    return rows, picks


def with_bandwidth(c: Cluster, bw: float) -> Cluster:
    """``c`` with the inter-node link (one node: the intra link) at ``bw`` bytes/s."""
    if c.nodes > 1:
        return dataclasses.replace(c, inter=dataclasses.replace(c.inter, bandwidth=bw))
    return dataclasses.replace(c, intra=dataclasses.replace(c.intra, bandwidth=bw))


def speedup_at(c: Cluster, shapes: Sequence[tuple], compute_s: float, r: Row, bucket_bytes: int,
               optimizer: str = "sgd") -> float:
    """fp32 Horovod's predicted step over row ``r``'s method's on cluster ``c``."""
    hv = horovod_rows(shapes, compute_s, c)
    base = hv[0].step_s
    if r.spec is None:
        mine = next(h for h in hv if h.label == r.label)
    else:
        mine = next(x for x in codec_rows(r.spec, shapes, compute_s, c, bucket_bytes, optimizer) if x.route == r.route)
    return base / mine.step_s


def plan(model, compute_s: Optional[float] = None, cluster: Union[str, presets.Cluster, None] = "p3-v100-25gbe",
         nodes: int = 1, gpus_per_node: Optional[int] = None, intra: Optional[cost.LinkModel] = None,
         inter: Optional[cost.LinkModel] = None, device: Optional[str] = None,
         methods: Sequence[str] = DEFAULT_METHODS, calibration: Optional[Dict[str, Any]] = None,
         bucket_bytes: int = DEFAULT_BUCKET_BYTES, breakeven_search: bool = True, optimizer: str = "sgd") -> Plan:
    """Predict every method on ``nodes`` nodes of ``cluster`` (see the module doc). ``model``: a
    parameter count, a list of tensor sizes or shapes, a torch module or its ``named_parameters()``, or the
    name of a published model (:data:`presets.MODELS`, which also gives the compute time). ``optimizer``
    (``sgd``, ``adam`` or ``none``): the job's, which decides some codecs' routes (:func:`model.bind_like`)."""
    check_optimizer(optimizer)   # before any work
    if not isinstance(bucket_bytes, int) or isinstance(bucket_bytes, bool) or bucket_bytes < 1:
        raise ValueError(f"plan: bad bucket_bytes {bucket_bytes!r}; accepted: an int >= 1 (the optimizer's "
                         f"bucket size in bytes, {DEFAULT_BUCKET_BYTES} by default)")
    if isinstance(model, str):
        if model not in presets.MODELS:
            raise ValueError(f"plan: unknown model {model!r}; accepted: {', '.join(presets.MODELS)}, a "
                             "parameter count, tensor sizes or shapes, or a torch module")
        pub = presets.MODELS[model]
        shapes = tensor_shapes(pub.params)
    else:
        pub, shapes = None, tensor_shapes(model)
    c, dev = make_cluster(cluster, nodes, gpus_per_node, intra, inter, device, calibration)
    if compute_s is None:
        compute_s = (calibration or {}).get("compute_s")
    if compute_s is None:
        if pub is None or dev == "cpu":
            raise ValueError("plan: give compute_s (one step's forward + backward seconds), or a published "
                             "model on a GPU preset, or a calibration with a measured compute time")
        compute_s = presets.compute_seconds(pub, dev)
    if not compute_s >= 0:
        raise ValueError(f"plan: bad compute_s {compute_s!r}; accepted: seconds >= 0")
    methods = list(methods)
    rows, picks = predict_rows(shapes, compute_s, c, methods, bucket_bytes, optimizer=optimizer)
    inputs = {"params": numel_of(shapes), "tensors": len(shapes), "compute_s": compute_s, "device": dev,
              "nodes": c.nodes, "gpus_per_node": c.local, "methods": methods, "optimizer": optimizer,
              "intra": dataclasses.asdict(c.intra), "inter": dataclasses.asdict(c.inter)}
    if breakeven_search:
        inputs["breakeven"] = {f"{r.label}|{r.route}": breakeven(lambda bw, r=r: speedup_at(
            with_bandwidth(c, bw), shapes, compute_s, r, bucket_bytes, optimizer)) for r in rows
            if r.label not in ("horovod", "auto")}
    return Plan(rows, compute_s, c, inputs, picks, list(shapes), bucket_bytes, optimizer)


__all__ = ["Plan", "plan", "DEFAULT_METHODS"]
