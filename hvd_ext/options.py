"""Declared, validated options for compressors, feedbacks and sync strategies.

Every configurable part declares its options as ``Option`` objects; spec strings
(``"topk:ratio=0.01,feedback=ewma"``) and keyword arguments are both checked
against those declarations, so a bad key or value raises ``ValueError`` naming
what was wrong and what is accepted -- on every rank, before any collective,
because the check depends only on the arguments.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional, Sequence

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


@dataclass(frozen=True)
class Option:
    """One option: its type, default, and accepted values.

    ``check`` is a predicate on the converted value; ``accepted`` is the human
    description used in error messages (e.g. ``"0 < ratio <= 1"``).
    ``choices`` restricts the value to a fixed set.
    """

    type: type
    default: Any
    accepted: str = ""
    check: Optional[Callable[[Any], bool]] = None
    choices: Optional[Sequence[Any]] = None
    help: str = ""

    def describe(self) -> str:
        if self.choices is not None:
            return "one of " + ", ".join(repr(c) for c in self.choices)
        return self.accepted or self.type.__name__

    def convert(self, owner: str, key: str, value: Any) -> Any:
        """Convert ``value`` (string from a spec, or a Python value) and validate."""
        try:
            if isinstance(value, str) and self.type is not str:
                v = value.strip()
                if self.type is bool:
                    low = v.lower()
                    if low in _TRUE:
                        out = True
                    elif low in _FALSE:
                        out = False
                    else:
                        raise ValueError(v)
                elif self.type is int:
                    f = float(v)
                    if f != int(f):
                        raise ValueError(v)
                    out = int(f)
                else:
                    out = self.type(v)
            elif self.type is float and isinstance(value, (int, float)) and not isinstance(value, bool):
                out = float(value)
            elif self.type is int and isinstance(value, float) and value == int(value):
                out = int(value)
            elif self.type is bool and isinstance(value, (int,)) and value in (0, 1):
                out = bool(value)
            elif isinstance(value, self.type) and not (self.type is int and isinstance(value, bool)):
                out = value
            else:
                raise TypeError(type(value).__name__)
        except (TypeError, ValueError, OverflowError):  # OverflowError: int('1e400'), int(inf)
            raise ValueError(
                f"{owner}: bad value {value!r} for '{key}': expected {self.type.__name__}, "
                f"accepted: {self.describe()}"
            ) from None
        if self.type is float and out != out:  # NaN
            raise ValueError(f"{owner}: bad value {value!r} for '{key}': accepted: {self.describe()}")
        if self.choices is not None and out not in self.choices:
            raise ValueError(f"{owner}: bad value {value!r} for '{key}': accepted: {self.describe()}")
        if self.check is not None and not self.check(out):
            raise ValueError(f"{owner}: bad value {value!r} for '{key}': accepted: {self.describe()}")
        return out


def resolve_options(owner: str, declared: Dict[str, Option], given: Dict[str, Any],
                    aliases: Optional[Dict[str, str]] = None) -> Dict[str, Any]:
    """Validate ``given`` against ``declared``; return all options with defaults filled.

    ``aliases`` maps an old key to the declared one it still spells (``variance_warmup`` ->
    ``warmup``); giving both is an error."""
    aliases = aliases or {}
    spelled = {aliases.get(k, k): k for k in given}  # errors name the key as the user wrote it
    given = canonical_keys(owner, given, aliases)
    unknown = sorted(set(given) - set(declared))
    if unknown:
        accepted = ", ".join(sorted(declared)) or "(none)"
        raise ValueError(f"{owner}: unknown option(s) {', '.join(map(repr, unknown))}; accepted: {accepted}")
    out = {}
    for key, opt in declared.items():
        out[key] = opt.convert(owner, spelled.get(key, key), given[key]) if key in given else opt.default
    return out


def canonical_keys(owner: str, given: Dict[str, Any], aliases: Dict[str, str]) -> Dict[str, Any]:
    """``given`` with every alias key replaced by the key it stands for."""
    out: Dict[str, Any] = {}
    for key, value in given.items():
        name = aliases.get(key, key)
        if name in out:
            raise ValueError(f"{owner}: '{name}' given twice (as {key!r} too, its old name); give it once")
        out[name] = value
    return out


def parse_spec(spec: str, what: str = "spec"):
    """Split ``"name:key=val,key=val"`` into ``(name, {key: val})`` (values stay strings)."""
    if not isinstance(spec, str):
        raise ValueError(f"{what} must be a string like 'name:key=val,...', got {type(spec).__name__}")
    spec = spec.strip()
    if not spec:
        raise ValueError(f"{what} is empty; expected 'name' or 'name:key=val,...'")
    name, _, rest = spec.partition(":")
    name = name.strip().lower()
    kv: Dict[str, str] = {}
    if rest.strip():
        for item in rest.split(","):
            item = item.strip()
            if not item:
                continue
            key, eq, val = item.partition("=")
            key = key.strip()
            if not eq or not key:
                raise ValueError(f"{what} {spec!r}: item {item!r} is not of the form key=value")
            if key in kv:
                raise ValueError(f"{what} {spec!r}: key {key!r} given twice")
            kv[key] = val.strip()
    return name, kv


def positive(v) -> bool:
    return v > 0


def non_negative(v) -> bool:
    return v >= 0


def fraction(v) -> bool:
    return 0 < v <= 1


def unit_interval(v) -> bool:
    return 0 <= v <= 1
