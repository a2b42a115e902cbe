"""The Horovod world a rank is in, and what its ranks agreed on in it.

Every rank must make the same collectives (else jobs hang), so before the first gradient exchange
in a world the ranks (1) check that they are configured alike -- one allgather of a small
fingerprint, :func:`fingerprint_mismatch` names the first difference; a fixed-size job compares
the calibration file apart, before pricing its routes with it (:func:`agree_on_calibration`) --
and (2) agree on state (a checkpoint loaded on rank 0 only: every rank takes the most advanced rank's).

:class:`World` is that state machine, per world::

    NEW --check--> CHECKED --agree--> AGREED --(hvd re-initialised, or reset())--> NEW

A fixed-size job checks at construction. Under Horovod elastic (``horovodrun --min-np/--max-np``)
nothing runs at construction -- a joining worker constructs while the others resynchronise -- and
both steps run at the first exchange of each world.
"""
from __future__ import annotations

import sys
from typing import Any, Dict, List, Optional

from .compression.base import Compressor
from .exchange import calibration
from .exchange.transport import horovod_elastic


def world_of(exchange) -> tuple:
    """What identifies the Horovod world this rank is in: (initialisation, size, rank). The first
    item is the table of pending handles that ``horovod.torch`` replaces on every ``hvd.init()``
    (so a re-initialisation with an unchanged size is seen too); compare with :func:`same_world`."""
    mpi_ops = sys.modules.get("horovod.torch.mpi_ops")
    return (getattr(mpi_ops, "_handle_map", None), exchange.size, exchange.rank)


def same_world(a: Optional[tuple], b: Optional[tuple]) -> bool:
    return a is not None and b is not None and a[0] is b[0] and a[1:] == b[1:]


class World:
    """Where this rank stands in the state machine of the module docstring."""

    def __init__(self, exchange, included: bool):
        self.exchange = exchange
        self.elastic = included and horovod_elastic()
        self.current = world_of(exchange) if included else None
        self.changes = 0                  # re-initialisations of Horovod seen
        self.check_due = self.elastic     # a fixed-size job checks at construction
        self.agree_due = included

    def moved(self) -> bool:
        """Horovod was re-initialised (elastic) since this world was entered."""
        return self.elastic and not same_world(self.current, world_of(self.exchange))

    def unsettled(self) -> bool:
        """The check or the agreement is still due here, or the world moved."""
        return self.check_due or self.agree_due or not same_world(self.current, world_of(self.exchange))

    def enter(self) -> None:
        """Now in a new world: check and agree again."""
        self.current = world_of(self.exchange)
        self.changes += 1
        self.check_due = self.agree_due = True

    def forget(self) -> None:
        """Treat the world as changed at the next exchange (``reset_world``)."""
        self.elastic = True
        self.current = None


def _full_spec(compressor: Compressor) -> str:
    """Spec with every option spelled out (defaults too), feedback included."""
    opts = getattr(compressor, "opts", None)
    if not isinstance(opts, dict):
        return compressor.spec()
    items = [f"{k}={v}" for k, v in sorted(opts.items())]
    fb = getattr(compressor, "feedback", None)
    if fb is not None:
        items.append(f"feedback={fb.name}")
        items += [f"{k}={v}" for k, v in sorted(getattr(fb, "opts", {}).items())]
    return compressor.name + (":" + ",".join(items) if items else "")


def config_fingerprint(named_params, compressor: Compressor, op_name: str, backward_passes_per_step: int,
                       gradient_predivide_factor: float, bucket_bytes: int, sparse_as_dense: bool,
                       buckets: List[List[str]], routes: Optional[List[str]] = None) -> Dict[str, Any]:
    """What every rank of a process set must agree on for the exchange to match (rule of consistency)."""
    return {
        "compression": _full_spec(compressor),
        "op": op_name,
        "backward_passes_per_step": int(backward_passes_per_step),
        "gradient_predivide_factor": float(gradient_predivide_factor),
        "sparse_as_dense": bool(sparse_as_dense),
        "bucket_bytes": int(bucket_bytes),
        "parameters": [(n, tuple(p.shape), str(p.dtype).replace("torch.", "")) for n, p in named_params],
        "buckets": [list(b) for b in buckets],
        # the calibration file the routes (and auto) are priced with: the same content on every rank
        # (named before the routes, which differ where it does)
        "calibration": calibration.env_digest(),
        "routes": list(routes or []),
        # auto: the candidates the optimizer leaves it (a different optimizer on a rank would make it choose otherwise)
        "eligible": [bool(compressor.allowed(i)) for i in range(len(compressor.candidates))]
        if callable(getattr(compressor, "allowed", None)) else None,
    }


def _short(v, limit: int = 160) -> str:
    r = repr(v)
    return r if len(r) <= limit else r[:limit - 3] + "..."


def agree_on_calibration(exchange, what: str = "hvd_ext.DistributedOptimizer") -> None:
    """Before the routes are priced with the calibration file (``HVD_EXT_CALIBRATION``, which pricing may
    follow with collectives, e.g. the node links' probe where the file has none): one allgather of each
    rank's :func:`~hvd_ext.exchange.calibration.env_digest`. Ranks that read different files, or a rank
    that cannot use its file, raise on every rank together rather than one rank alone."""
    got = exchange.allgather_object({"calibration": calibration.env_digest()}, "hvd_ext.calibration")
    msg = fingerprint_mismatch(got, what, "checked at construction, before the routes are priced; every rank "
                                          "must read the same file, or a copy of it")
    if msg is not None:
        raise ValueError(msg)
    calibration.from_env()  # a file no rank can use: every rank raises its error here, together


def fingerprint_mismatch(fingerprints: List[Dict[str, Any]], what: str = "hvd_ext.DistributedOptimizer",
                         when: str = "checked once, at construction; under Horovod elastic at the first exchange "
                                     "after each reset") -> Optional[str]:
    """None when every rank's fingerprint equals rank 0's; else a message naming the first key
    that differs, the ranks and both values (lists: the first differing entry)."""
    ref = fingerprints[0]
    for key in ref:
        for r, fp in enumerate(fingerprints[1:], start=1):
            a, b = ref.get(key), fp.get(key)
            if a == b:
                continue
            detail = f"rank 0 has {_short(a)}, rank {r} has {_short(b)}"
            if isinstance(a, list) and isinstance(b, list):
                if len(a) != len(b):
                    detail = f"rank 0 has {len(a)} entries, rank {r} has {len(b)}; "
                else:
                    detail = ""
                i = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
                x = a[i] if i < len(a) else "(none)"
                y = b[i] if i < len(b) else "(none)"
                detail += f"first difference at entry {i}: rank 0 has {_short(x)}, rank {r} has {_short(y)}"
            return (f"{what}: ranks are configured differently ({key}: {detail}); every rank must pass "
                    f"the same configuration ({when})")
    extra = sorted({k for fp in fingerprints for k in fp} - set(ref))
    if extra:
        return f"{what}: ranks are configured differently (keys {extra} set on some ranks only)"
    return None
