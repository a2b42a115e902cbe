"""Sync strategies: when parameters (not gradients) are exchanged.

=================  =====================================================================
spec               strategy
=================  =====================================================================
``every``          ``EverySync``: plain data parallel, gradients exchanged every step
``local:...``      ``LocalSGD``: average every ``period`` steps (``warmup`` = post-local SGD)
``adaptive:...``   ``AdaptiveSync``: momentum-driven adaptive period (technique 6 in docs/techniques.md)
``event:...``      ``EventTriggeredSGD``: event-triggered async local SGD on an MPI RMA
                   parameter server with staleness weighting (techniques 1-2 in docs/techniques.md)
=================  =====================================================================

``sync_from_spec("local:period=8,warmup=100")`` validates the spec (ValueError naming
the bad key and the accepted ones, before any communication) and returns a factory;
``factory(optimizer, model)`` builds the strategy. Every strategy has
``step(loss=None)`` (calls ``optimizer.step()``), ``finish()`` (last sync, all ranks
identical), ``exchanges``, ``stats``, ``state_dict()/load_state_dict()``,
``shared_state_dict()/load_shared_state_dict()`` (parameter-server state) and ``close()``.

BatchNorm running statistics are buffers, which Horovod never exchanges: ``local`` and
``adaptive`` average them with the parameters (``sync_buffers``, default on), ``event``
averages them once in ``finish()``; under ``every`` call ``average_buffers(model)`` before
evaluating or checkpointing (``buffer_spread(model)`` measures the disagreement).
"""
from __future__ import annotations

from typing import Any, Dict

from ..options import parse_spec, resolve_options
from .adaptive import ADAPTIVE_OPTIONS, AdaptiveSync, momentum_divergence, next_period
from .event_triggered import EVENT_OPTIONS, EventTriggeredSGD, staleness_weight, trigger
from .local_sgd import LOCAL_OPTIONS, EverySync, LocalSGD
from ._common import average_buffers, buffer_spread
from .param_server import ParameterServer, init_horovod, require_mpi_controller
from .schedule import GlobalOneCycle

# spec key -> constructor keyword (short spellings used on the command line)
_ALIASES = {
    "local": {"warmup_steps": "warmup"},
    "adaptive": {"min": "min_period", "max": "max_period", "warmup_steps": "warmup"},
    "event": {},
    "every": {},
}
_CLASSES = {"every": EverySync, "local": LocalSGD, "adaptive": AdaptiveSync, "event": EventTriggeredSGD}


def list_sync() -> Dict[str, str]:
    return {k: (v.__doc__ or "").strip().splitlines()[0] for k, v in _CLASSES.items()}


class SyncFactory:
    """A validated sync spec; call it with ``(optimizer, model)`` to build the strategy."""

    def __init__(self, name: str, options: Dict[str, Any]):
        self.name = name
        self.cls = _CLASSES[name]
        self.options = options

    @property
    def needs_mpi(self) -> bool:
        return self.name == "event"

    def spec(self) -> str:
        return self.name + (":" + ",".join(f"{k}={v}" for k, v in self.options.items()) if self.options else "")

    def __call__(self, optimizer, model, **overrides):
        return self.cls(optimizer, model, **{**self.options, **overrides})

    def __repr__(self):
        return f"SyncFactory({self.spec()!r})"


def sync_from_spec(spec: str) -> SyncFactory:
    """Parse ``every`` | ``local:period=8[,warmup=T]`` | ``adaptive:min=1,max=32[,delta_lo=..,delta_hi=..,balance=1]``
    | ``event:sigma=..,tau_min=..,tau_max=..,staleness=loss|inverse|none,gamma=..[,rho=..,eps=..]``."""
    name, kv = parse_spec(spec, "sync spec")
    if name not in _CLASSES:
        raise ValueError(f"sync spec {spec!r}: unknown strategy {name!r}; accepted: {', '.join(_CLASSES)}")
    aliases = _ALIASES[name]
    given = {}
    for k, v in kv.items():
        key = aliases.get(k, k)
        if key in given:
            raise ValueError(f"sync spec {spec!r}: key {k!r} given twice")
        given[key] = v
    declared = _CLASSES[name].declared
    unknown = sorted(set(given) - set(declared))
    if unknown:
        acc = sorted(set(declared) | set(aliases))
        raise ValueError(f"sync spec {spec!r}: unknown option(s) {', '.join(map(repr, unknown))}; "
                         f"accepted: {', '.join(acc) or '(none)'}")
    opts = resolve_options(f"sync spec {spec!r}", declared, given)
    opts = {k: v for k, v in opts.items() if k in given}
    # cross-option checks, still before any communication
    if name == "adaptive":
        full = resolve_options("AdaptiveSync", declared, opts)
        if full["min_period"] > full["max_period"]:
            raise ValueError(f"sync spec {spec!r}: bad value {full['min_period']} for 'min': accepted: min <= max")
        if not full["delta_lo"] < full["delta_hi"]:
            raise ValueError(f"sync spec {spec!r}: bad value {full['delta_lo']} for 'delta_lo': "
                             f"accepted: 0 <= delta_lo < delta_hi")
        if full["normalise"] and not full["balance"]:
            raise ValueError(f"sync spec {spec!r}: bad value 1 for 'normalise': accepted: normalise=1 only with "
                             f"balance=1")
    if name == "event":
        full = resolve_options("EventTriggeredSGD", declared, opts)
        if full["tau_max"] < full["tau_min"]:
            raise ValueError(f"sync spec {spec!r}: bad value {full['tau_max']} for 'tau_max': "
                             f"accepted: integer >= tau_min (= {full['tau_min']})")
    return SyncFactory(name, opts)


__all__ = ["AdaptiveSync", "EventTriggeredSGD", "EverySync", "GlobalOneCycle", "LocalSGD", "ParameterServer", "SyncFactory",
           "average_buffers", "buffer_spread",
           "init_horovod", "list_sync", "momentum_divergence", "next_period", "require_mpi_controller", "staleness_weight",
           "sync_from_spec", "trigger", "ADAPTIVE_OPTIONS", "EVENT_OPTIONS", "LOCAL_OPTIONS"]
