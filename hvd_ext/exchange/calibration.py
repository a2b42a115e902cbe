"""A calibration file: the links and codec speeds measured once on a cluster
(``python -m hvd_ext.plan --measure``), read by the planner and by ``compression="auto"``, so both
predict with the same numbers.

Format (JSON)::

    {"version": 1, "ranks": N, "nodes": M, "local": L, "device": "cuda" | "cpu",
     "links": {"flat":  {"lat": s per allreduce, "bandwidth": B/s,     # this world's allreduce
                         "lat_by_kind": {"allreduce": s, "allgather": s, "alltoall": s},  # optional
                         "busy_lat_by_kind": {...}},  # optional: the same right after a step
               "intra": {"alpha": s per message, "bandwidth": B/s,      # inside a node
                         "busy_lat_by_kind": {...}},  # optional (M > 1): a node's collectives after a step
               "inter": {"alpha": ..., "bandwidth": ...},               # between nodes (M > 1)
               "horovod": {"lat": s, "bandwidth": B/s, "lat_by_kind": {"allreduce": s},  # optional:
                           "busy_lat_by_kind": {"allreduce": s}},  # Horovod's own wait (waiting.py)
               "horovod_fp16": {"lat": s, "bandwidth": B/s of float16}},  # optional: Horovod's fp16 sum
     "codec": {"<spec>": elements per second of one encode or decode pass, ...},
     "codec_fixed_s": {"<spec>": seconds one pass costs whatever its size, ...},
     "codec_compiled": {"<spec>": elements per second of a call of compile_min elements or more},  # optional:
     "compile_min": elements,  # a CPU, where calls of compile_min elements or more run compiled
     "route_overhead_s": {"<spec>": {"<route>": [s per bucket, per tensor, per element]}},  # optional: a
                       # bucket's host work on a flat route beyond its codec passes, in this world (plan.route_overhead)
     "compute_s": optional seconds of one step's forward + backward}

Set ``HVD_EXT_CALIBRATION=path`` for a job: ``auto`` then takes the flat link and each collective's
fixed cost (:func:`collective_latencies`) from the file instead of probing them (when the file's
rank count is the job's), and the node-aware route choice takes the intra / inter links from it
instead of measuring them. A fixed codec's route choice (:func:`hvd_ext.exchange.routes.route_options`)
prices with the same links and collective costs, and each codec call as the file timed the codec
(:class:`CodecTiming`: speed, fixed cost per call, compiled speed). Codec times ``auto`` still
measures on the job's own buckets. The ranks compare the file's content (:func:`env_digest`) before
they price with it (under Horovod elastic at the first exchange): every rank must read the same file,
or a copy of it, and a rank that cannot use its file fails with the others.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import dataclass
from typing import Any, Dict, Optional, Sequence, Tuple

from .cost import LinkModel, NodeModel

ENV = "HVD_EXT_CALIBRATION"
COLLECTIVES = ("allreduce", "allgather", "alltoall")
VERSION = 1
_CACHE: Dict[str, Any] = {}  # path -> its calibration, or the CalibrationError it raised


class CalibrationError(ValueError):
    """A calibration file that cannot be used: its ``path``, and ``what`` is wrong with it."""

    def __init__(self, path: str, what: str):
        super().__init__(f"calibration file {path!r}: {what}; write one with `python -m hvd_ext.plan --measure`")
        self.path, self.what = path, what


def _number(v: Any, low: float = 0.0, strict: bool = False) -> bool:
    """``v`` is a finite number (not a bool) >= ``low`` (> ``low`` if ``strict``)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        return False
    return v > low if strict else v >= low


def _object(path: str, value: Any, where: str) -> Dict[str, Any]:
    if not isinstance(value, dict):
        raise CalibrationError(path, f"{where} must be an object, got {type(value).__name__}")
    return value


def _read(path: str) -> Any:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except OSError as e:
        raise CalibrationError(path, f"cannot be read ({e.strerror})") from None
    except UnicodeDecodeError:
        raise CalibrationError(path, "is not UTF-8 text") from None
    except json.JSONDecodeError as e:
        raise CalibrationError(path, f"is not JSON ({e.msg} at line {e.lineno})") from None


def _check_links(path: str, links: Dict[str, Any]) -> None:
    for name, need in (("flat", ("lat", "bandwidth")), ("intra", ("alpha", "bandwidth")),
                       ("inter", ("alpha", "bandwidth")), ("horovod", ("lat", "bandwidth")),
                       ("horovod_fp16", ("lat", "bandwidth"))):
        if name not in links:
            continue
        link = _object(path, links[name], f"links.{name}")
        if not all(_number(link.get(k)) for k in need) or not _number(link["bandwidth"], strict=True):
            raise CalibrationError(path, f"links.{name} needs {' and '.join(need)} (numbers, bandwidth > 0)")
        for key in ("lat_by_kind", "busy_lat_by_kind"):
            kinds = link.get(key, {})
            if not isinstance(kinds, dict) or any(k not in COLLECTIVES or not _number(v) for k, v in kinds.items()):
                raise CalibrationError(path, f"links.{name}.{key} maps {', '.join(COLLECTIVES)} to seconds >= 0")


def _check_route_overhead(path: str, table: Dict[str, Any]) -> None:
    for spec, routes in table.items():
        for route, v in _object(path, routes, f"route_overhead_s.{spec}").items():
            if not (isinstance(v, list) and len(v) == 3 and all(_number(x) for x in v)):
                raise CalibrationError(path, f"route_overhead_s.{spec}.{route} must be [seconds per bucket, per "
                                             f"tensor, per element], numbers >= 0, got {v!r}")


def load(path: str) -> Dict[str, Any]:
    """The calibration at ``path``, checked: a :class:`CalibrationError` names what is wrong."""
    cal = _read(path)
    if not isinstance(cal, dict) or cal.get("version") != VERSION:
        raise CalibrationError(path, f"version must be {VERSION}")
    for key in ("ranks", "nodes", "local"):
        if key in cal and (isinstance(cal[key], bool) or not isinstance(cal[key], int) or cal[key] < 1):
            raise CalibrationError(path, f"{key} must be an int >= 1, got {cal[key]!r}")
    if "compute_s" in cal and not _number(cal["compute_s"]):
        raise CalibrationError(path, f"compute_s must be seconds >= 0, got {cal['compute_s']!r}")
    if not isinstance(cal.get("device", "cpu"), str):
        raise CalibrationError(path, f"device must be a string, got {cal['device']!r}")
    _check_links(path, _object(path, cal.get("links", {}), "links"))
    for key, what, strict in (("codec", "codec speed", True), ("codec_compiled", "codec_compiled speed", True),
                              ("codec_fixed_s", "codec_fixed_s", False)):
        for spec, v in _object(path, cal.get(key, {}), key).items():
            if not _number(v, strict=strict):
                raise CalibrationError(path, f"{what} of {spec!r} must be a number {'>' if strict else '>='} 0, "
                                             f"got {v!r}")
    _check_route_overhead(path, _object(path, cal.get("route_overhead_s", {}), "route_overhead_s"))
    if "codec_compiled" in cal and (isinstance(cal.get("compile_min"), bool) or
                                    not isinstance(cal.get("compile_min"), int) or cal["compile_min"] < 1):
        raise CalibrationError(path, "codec_compiled needs compile_min, the elements from which a call runs "
                                     "compiled (an int >= 1)")
    return cal


def from_env() -> Optional[Dict[str, Any]]:
    """The calibration ``HVD_EXT_CALIBRATION`` names (read once per path; a file that cannot be used
    raises its :class:`CalibrationError` at every call), or None."""
    path = os.environ.get(ENV, "").strip()
    if not path:
        return None
    if path not in _CACHE:
        try:
            _CACHE[path] = load(path)
        except CalibrationError as e:
            _CACHE[path] = e
    got = _CACHE[path]
    if isinstance(got, CalibrationError):
        raise CalibrationError(got.path, got.what)
    return got


def usable_from_env() -> Optional[Dict[str, Any]]:
    """:func:`from_env`, or None where this rank cannot use the file: for pricing before the ranks can
    compare their files (Horovod elastic prices at construction, compares at the first exchange)."""
    try:
        return from_env()
    except CalibrationError:
        return None


def digest(cal: Optional[Dict[str, Any]]) -> Optional[str]:
    """A short hash of ``cal``'s content (None without one): the ranks of a job compare it before the
    first exchange, since the routes they choose follow the file (each rank may read its own copy)."""
    if cal is None:
        return None
    return hashlib.sha256(json.dumps(cal, sort_keys=True).encode()).hexdigest()[:16]


def env_digest() -> Optional[str]:
    """:func:`digest` of :func:`from_env`'s calibration, or what is wrong with the file, as text; never
    raises. The ranks compare it before pricing with the file, so a rank that cannot use it fails
    together with the others rather than alone."""
    try:
        return digest(from_env())
    except CalibrationError as e:
        return f"unusable {e.path!r}: {e.what}"


def node_model(cal: Optional[Dict[str, Any]]) -> Optional[NodeModel]:
    """The intra / inter links of ``cal`` as a :class:`NodeModel`, if it has both."""
    links = (cal or {}).get("links", {})
    if "intra" not in links or "inter" not in links:
        return None
    return NodeModel(intra=LinkModel(alpha=links["intra"]["alpha"], bandwidth=links["intra"]["bandwidth"]),
                     inter=LinkModel(alpha=links["inter"]["alpha"], bandwidth=links["inter"]["bandwidth"]))


def flat_link(cal: Optional[Dict[str, Any]], ranks: int) -> Optional[Dict[str, float]]:
    """``{"lat", "bandwidth"}`` of this world's allreduce, if ``cal`` measured a world of ``ranks``."""
    if not timed_here(cal, ranks) or "flat" not in cal.get("links", {}):
        return None
    flat = cal["links"]["flat"]
    return {"lat": flat["lat"], "bandwidth": flat["bandwidth"]}


def node_layout(topo: Any) -> Tuple[Optional[int], Optional[int]]:
    """``(nodes, local)`` of a job's :class:`hvd_ext.exchange.transport.Topology`, or ``(None, None)``
    where it is not known: :func:`timed_here` then checks the ranks alone."""
    return (topo.cross_size, topo.local_size) if topo is not None else (None, None)


def timed_here(cal: Optional[Dict[str, Any]], ranks: int, nodes: Optional[int] = None,
               local: Optional[int] = None) -> bool:
    """Whether ``cal`` was measured on a world of ``ranks`` (of ``nodes`` x ``local``, where given):
    only there do its collectives' timings hold."""
    if not cal or int(cal.get("ranks", -1)) != ranks:
        return False
    return nodes is None or (cal.get("nodes"), cal.get("local")) == (nodes, local)


def collective_latencies(cal: Optional[Dict[str, Any]], ranks: int, nodes: Optional[int] = None,
                         local: Optional[int] = None) -> Optional[Tuple[Dict[str, float], Dict[str, float]]]:
    """``(first, then)``: the fixed seconds of each collective over this world, as a bucket's first
    one pays it (inside a step, waiting for the slowest rank: ``busy_lat_by_kind`` where timed, else
    ``lat_by_kind``) and as a later one does (the ranks together: ``lat_by_kind``), if ``cal`` timed
    them on a world of ``ranks`` (of ``nodes`` x ``local``, where given), a kind it did not time at
    its flat allreduce's latency; else None. The planner and
    ``compression="auto"`` both price a bucket's collectives with these
    (:func:`hvd_ext.exchange.cost.collective_seconds`)."""
    if not timed_here(cal, ranks, nodes, local):
        return None
    flat = cal.get("links", {}).get("flat", {})
    idle, busy = flat.get("lat_by_kind") or {}, flat.get("busy_lat_by_kind") or {}
    if not idle and not busy:
        return None
    lat = flat.get("lat", max([*idle.values(), *busy.values()]))  # for a kind the file did not time
    then = {k: idle.get(k, lat) for k in COLLECTIVES} if idle else {}
    return {**(then or dict.fromkeys(COLLECTIVES, lat)), **busy}, then


@dataclass(frozen=True)
class CodecTiming:
    """One codec's encode or decode call as timed on a device: ``speed`` elements per second,
    ``fixed`` seconds whatever the size, and ``compiled`` elements per second of a call of
    ``compile_min`` elements or more (on a CPU, where those run compiled; None: not timed);
    ``route_overhead``: per flat route, a bucket's host work beyond the codec's passes, ``[seconds per
    bucket, per tensor, per element]``
    (:mod:`hvd_ext.plan.route_overhead`; measured in one world)."""

    speed: float
    fixed: float = 0.0
    compiled: Optional[float] = None
    compile_min: Optional[int] = None
    route_overhead: Optional[Dict[str, Sequence[float]]] = None

    def overhead_seconds(self, route: str, shapes: Sequence[Sequence[int]], local: int = 1) -> float:
        """Host seconds of a bucket of tensors of ``shapes`` on ``route`` beyond the codec's passes; a
        node-aware route: its inner route's on a rank's shard of the elements (nodes of ``local``
        ranks); none where not measured."""
        fixed = (self.route_overhead or {}).get(route[route.find(":") + 1:])
        if not fixed:
            return 0.0
        shard = max(int(local), 1) if route.startswith("node:") else 1
        return fixed[0] + fixed[1] * len(shapes) + fixed[2] * sum(math.prod(s) for s in shapes) / shard

    def seconds(self, numel: int) -> float:
        """Seconds of one call on ``numel`` elements (none for a codec that codes nothing: speed inf)."""
        speed = self.speed
        if self.compiled and self.compile_min is not None and numel >= self.compile_min:
            speed = self.compiled
        return 0.0 if math.isinf(speed) else self.fixed + numel / speed


def codec_timing(cal: Optional[Dict[str, Any]], *keys: str, ranks: Optional[int] = None,
                 nodes: Optional[int] = None, local: Optional[int] = None) -> Optional[CodecTiming]:
    """The file's timing of a codec, each figure under the first of ``keys`` (a spec, the codec's own
    spec, its family) it is listed by, as the planner looks them up; None where no speed is listed;
    its routes' overhead only where the file measured a world of ``ranks`` (of ``nodes`` x ``local``,
    where given: :func:`timed_here`). A job's route choice prices a codec call with it."""
    def first(table: str):
        entries = (cal or {}).get(table, {})
        return next((entries[k] for k in keys if k in entries), None)

    speed = first("codec")
    if speed is None:
        return None
    compiled = first("codec_compiled")
    return CodecTiming(float(speed), float(first("codec_fixed_s") or 0.0), float(compiled) if compiled else None,
                       cal.get("compile_min") if compiled else None,
                       first("route_overhead_s") if ranks is not None and timed_here(cal, ranks, nodes, local)
                       else None)


def node_latencies(cal: Optional[Dict[str, Any]], ranks: int, nodes: Optional[int] = None,
                   local: Optional[int] = None) -> Dict[str, float]:
    """The fixed seconds of each collective of a node's ranks timed inside a step
    (``links.intra.busy_lat_by_kind``: the node-aware route's first collective pays it), if ``cal``
    timed them on this world (as :func:`collective_latencies`); else empty."""
    if not timed_here(cal, ranks, nodes, local):
        return {}
    return dict(cal.get("links", {}).get("intra", {}).get("busy_lat_by_kind") or {})
