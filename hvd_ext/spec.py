"""Spec strings -> compressors, feedbacks and ``auto``: every spec hvd_ext accepts is parsed here.

``compression_from_spec("topk:ratio=0.01,feedback=ewma,beta=0.9")`` builds a compressor and
attaches its feedback: keys go to the compressor's options, ``feedback=NAME`` picks the
feedback, the remaining keys go to that feedback's options; the keys every codec takes
(``route=``, ``hierarchy=``, ``variance=``, ``warmup=``: :mod:`hvd_ext.compression.common`) are
parsed by the compressor's base class. ``auto:...,candidates=...`` builds :class:`hvd_ext.auto.AutoCompression`
from candidate specs. Any unknown name, key or bad value raises ``ValueError`` naming it and
what is accepted, before any collective.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional

from .auto import AUTO_OPTIONS, DEFAULT_CANDIDATES, AutoCompression
from .compression import Compressor, registry
from .compression.common import COMMON_ALIASES, COMMON_OPTIONS
from .feedback import registry as feedback_registry
from .options import parse_spec


def list_compressors() -> List[str]:
    """Names accepted by ``compression_from_spec`` (sorted)."""
    return sorted(registry())


def describe_compressors() -> Dict[str, Dict[str, Any]]:
    """name -> {collective, options: {key: (default, accepted)}, default_feedback, doc}; the options
    every codec takes are :data:`hvd_ext.compression.common.COMMON_OPTIONS`."""
    out = {}
    for name, cls in sorted(registry().items()):
        out[name] = {
            "collective": cls.collective,
            "default_feedback": cls.default_feedback,
            "options": {k: (o.default, o.describe()) for k, o in cls.options.items()},
            "doc": (cls.__doc__ or (__import__(cls.__module__, fromlist=["x"]).__doc__ or "")).strip().split("\n")[0],
        }
    return out


def make_feedback(name: str, owner: Optional[Compressor] = None, spec: Optional[str] = None, **kwargs):
    """The feedback ``name`` with its options, checked against what ``owner`` accepts."""
    fbs = feedback_registry()
    where = f" in spec {spec!r}" if spec else ""
    if name not in fbs:
        raise ValueError(f"unknown feedback {name!r}{where}; accepted: {', '.join(sorted(fbs))}")
    if owner is not None and owner.accepted_feedback is not None and name not in owner.accepted_feedback:
        raise ValueError(f"compressor '{owner.name}' does not accept feedback={name!r}{where}; "
                         f"accepted: {', '.join(owner.accepted_feedback)}")
    return fbs[name](**kwargs)


def compression_from_spec(spec: str) -> Compressor:
    """Build a compressor (with its feedback) from ``"name:key=val,..."``, or ``auto`` from
    ``"auto:key=val,...,candidates=spec,spec"``."""
    name, _ = parse_spec(spec.split(":")[0] if isinstance(spec, str) else spec, "compression spec")
    if name == "auto":  # candidates= holds specs with commas of their own: its own parser
        return auto_from_spec(spec)
    name, kv = parse_spec(spec, "compression spec")
    reg = registry()
    if name not in reg:
        raise ValueError(f"unknown compressor {name!r} in spec {spec!r}; accepted: {', '.join(sorted(reg))}")
    cls = reg[name]
    fb_name = kv.pop("feedback", cls.default_feedback).strip().lower()
    fb_cls = feedback_registry().get(fb_name)
    fb_options = fb_cls.options if fb_cls is not None else {}
    comp_keys = set(cls.options) | set(COMMON_OPTIONS) | set(COMMON_ALIASES) | set(cls.aliases)
    comp_kw = {k: v for k, v in kv.items() if k in comp_keys}
    fb_kw = {k: v for k, v in kv.items() if k in fb_options and k not in comp_keys}
    unknown = sorted(set(kv) - set(comp_kw) - set(fb_kw))
    if fb_cls is not None and unknown:
        accepted = sorted(set(cls.options) | set(COMMON_OPTIONS) | set(fb_options) | {"feedback"})
        raise ValueError(f"unknown key(s) {', '.join(map(repr, unknown))} in spec {spec!r} "
                         f"(compressor '{name}', feedback '{fb_name}'); accepted: {', '.join(accepted)}")
    if fb_cls is None:  # names the bad feedback, before its keys are judged
        make_feedback(fb_name, spec=spec)
    try:
        comp = cls(**comp_kw)
    except ValueError as e:
        raise ValueError(f"{e} (in spec {spec!r})") from None
    comp.feedback = make_feedback(fb_name, comp, spec=spec, **fb_kw)
    return comp


def auto_from_spec(spec: str) -> AutoCompression:
    """``auto`` with its options and its candidates (each built by :func:`compression_from_spec`)."""
    kw = parse_auto_spec(spec)
    specs = kw.pop("candidates", None)
    specs = list(DEFAULT_CANDIDATES if specs is None else specs)
    if not specs or not all(isinstance(s, str) and s.strip() for s in specs):
        raise ValueError(f"auto: candidates must be a non-empty list of compression specs, got {specs!r}")
    specs = [s.strip() for s in specs]
    for s in specs:
        if s.split(":")[0].strip().lower() == "auto":
            raise ValueError(f"auto: a candidate cannot be 'auto' (candidates: {', '.join(specs)})")
    return AutoCompression([(s, compression_from_spec(s)) for s in specs], **kw)


def split_candidates(text: str) -> List[str]:
    """``"none,fp16,topk:ratio=0.01,scope=layer"`` -> ``["none", "fp16", "topk:ratio=0.01,scope=layer"]``."""
    out: List[str] = []
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        if out and ":" not in item and "=" in item:
            out[-1] = out[-1] + ("," if ":" in out[-1] else ":") + item
        else:
            out.append(item)
    return out


def parse_auto_spec(spec: str) -> Dict[str, Any]:
    """``auto:key=val,...,candidates=...`` -> keyword arguments of :class:`AutoCompression`."""
    _, _, rest = spec.strip().partition(":")
    kw: Dict[str, Any] = {}
    head, sep, cands = rest.partition("candidates=")
    if sep:
        if head.strip() and not head.strip().endswith(","):
            raise ValueError(f"compression spec {spec!r}: 'candidates=' must start an item")
        kw["candidates"] = split_candidates(cands)
    for item in head.split(","):
        item = item.strip()
        if not item:
            continue
        key, eq, val = item.partition("=")
        if not eq or not key.strip():
            raise ValueError(f"compression spec {spec!r}: item {item!r} is not of the form key=value")
        key = key.strip()
        if key in kw:
            raise ValueError(f"compression spec {spec!r}: key {key!r} given twice")
        if COMMON_ALIASES.get(key, key) not in AUTO_OPTIONS:
            raise ValueError(f"unknown key {key!r} in spec {spec!r} (compressor 'auto'); accepted: "
                             f"{', '.join(sorted(AUTO_OPTIONS) + ['candidates'])}")
        kw[key] = val.strip()
    return kw
