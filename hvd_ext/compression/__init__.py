"""Compressors and the spec-string front door.

``compression_from_spec("topk:ratio=0.01,feedback=ewma,beta=0.9")`` builds a
compressor and attaches its feedback; ``list_compressors()`` lists every
registered name with its options. Modules register themselves on import: add
a new compressor by writing one module and importing it below.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional

from ..feedback import registry as feedback_registry
from ..options import parse_spec
from .base import ROUTE_CHOICES, Compressor, Continue, TensorInfo, register, registry

# One module per compressor; importing registers it.
from . import none, fp16, bf16, randomk  # noqa: F401,E401  (foundation)
from . import topk, threshold, dgc, sig  # noqa: F401,E401  (sparsification)
from . import qsgd, terngrad, signsgd, efsignsgd, signum, onebit, natural, int8, powersgd, qdist  # noqa: F401,E401


def list_compressors() -> List[str]:
    """Names accepted by ``compression_from_spec`` (sorted)."""
    return sorted(registry())


def describe_compressors() -> Dict[str, Dict[str, Any]]:
    """name -> {exchange, options: {key: (default, accepted)}, default_feedback, doc}."""
    out = {}
    for name, cls in sorted(registry().items()):
        out[name] = {
            "exchange": cls.exchange,
            "default_feedback": cls.default_feedback,
            "options": {k: (o.default, o.describe()) for k, o in cls.options.items()},
            "doc": (cls.__doc__ or (__import__(cls.__module__, fromlist=["x"]).__doc__ or "")).strip().split("\n")[0],
        }
    return out


def make_feedback(name: str, owner: Optional[Compressor] = None, **kwargs):
    fbs = feedback_registry()
    if name not in fbs:
        raise ValueError(f"unknown feedback {name!r}; accepted: {', '.join(sorted(fbs))}")
    if owner is not None and owner.accepted_feedback is not None and name not in owner.accepted_feedback:
        raise ValueError(f"compressor '{owner.name}' does not accept feedback={name!r}; "
                         f"accepted: {', '.join(owner.accepted_feedback)}")
    return fbs[name](**kwargs)


def compression_from_spec(spec: str) -> Compressor:
    """Build a compressor (with its feedback) from ``"name:key=val,..."``.

    Keys are routed to the compressor's options, ``feedback=NAME`` picks the
    feedback, and the remaining keys go to that feedback's options. Any
    unknown name, key or bad value raises ``ValueError`` naming it and what is
    accepted.
    """
    name, kv = parse_spec(spec.split(":")[0] if isinstance(spec, str) else spec, "compression spec")
    if name == "auto":  # candidates= holds specs with commas of their own: its own parser
        from ..auto import AutoCompression, parse_auto_spec
        return AutoCompression(**parse_auto_spec(spec))
    name, kv = parse_spec(spec, "compression spec")
    reg = registry()
    if name not in reg:
        raise ValueError(f"unknown compressor {name!r} in spec {spec!r}; accepted: {', '.join(sorted(reg))}")
    cls = reg[name]
    route = kv.pop("exchange", "auto").strip().lower()
    accepted_routes = ("auto",) if cls.exchange == "allreduce" else ROUTE_CHOICES
    if route not in accepted_routes:
        raise ValueError(f"bad value {route!r} for 'exchange' in spec {spec!r}: compressor '{name}' accepts "
                         f"{', '.join(accepted_routes)} (allgather: every rank receives every payload; twophase: "
                         "shards reduced by their owner, bytes per rank flat in N; auto: chosen by the cost model)")
    fb_name = kv.pop("feedback", cls.default_feedback).strip().lower()
    fbs = feedback_registry()
    if fb_name not in fbs:
        raise ValueError(f"unknown feedback {fb_name!r} in spec {spec!r}; accepted: {', '.join(sorted(fbs))}")
    fb_cls = fbs[fb_name]
    comp_kw = {k: v for k, v in kv.items() if k in cls.options}
    fb_kw = {k: v for k, v in kv.items() if k in fb_cls.options and k not in cls.options}
    unknown = sorted(set(kv) - set(comp_kw) - set(fb_kw))
    if unknown:
        accepted = (sorted(set(cls.options) | set(fb_cls.options) | {"feedback"})
                    + (["exchange"] if cls.exchange != "allreduce" else []))
        raise ValueError(f"unknown key(s) {', '.join(map(repr, unknown))} in spec {spec!r} "
                         f"(compressor '{name}', feedback '{fb_name}'); accepted: {', '.join(accepted)}")
    comp = cls(**comp_kw)
    if comp.exchange == "allreduce" and route != "auto":  # randomk:shared=1
        raise ValueError(f"bad value {route!r} for 'exchange' in spec {spec!r}: '{name}' with these options rides "
                         "on allreduce; accepted: auto")
    comp.route = route
    comp.feedback = make_feedback(fb_name, comp, **fb_kw)
    return comp


__all__ = ["Compressor", "Continue", "TensorInfo", "register", "registry", "compression_from_spec",
           "list_compressors", "describe_compressors", "make_feedback"]
