"""Periodic model averaging (local SGD) and post-local SGD.

Lin, Stich, Patel, Jaggi, "Don't use large mini-batches, use local SGD", ICLR 2020:
every rank takes ``period`` (H) local optimizer steps on its own data, then the
parameters are averaged over all ranks; with ``warmup=T`` the first T steps
are fully synchronous (post-local SGD), then the period is H (``warmup_steps=`` is the
old name of ``warmup=``).

The optimizer's momentum buffers are averaged with the parameters (``sync_momentum``, default
on), as in parallel restarted SGD with momentum (Yu, Jin, Yang, "On the Linear Speedup Analysis
of Communication Efficient Momentum SGD for Distributed Non-Convex Optimization", ICML 2019):
each rank's buffer otherwise keeps pushing along its own last H steps right after the average,
and at a high learning rate that makes the run fragile -- which seed or which 1e-4 change of the
starting point lands well. ``sync_momentum=0`` halves the bytes of a sync and keeps buffers local
(Lin et al.); ``benchmarks/convergence.py --workload mnist1d-slow`` compares both.

Usage (the strategy wraps the optimizer's ``step``)::

    opt = hvd_ext.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    sync = hvd_ext.LocalSGD(opt, model, period=8, warmup=100)
    for x, y in data:
        opt.zero_grad(); loss = F.cross_entropy(model(x), y); loss.backward()
        sync.step(loss)          # optimizer.step() + parameter average every H steps
    sync.finish()                # last average, all ranks identical

Around an ``hvd_ext.DistributedOptimizer`` the per-step gradient exchange is
switched off (``set_gradient_exchange(False)``) outside the warm-up, so the only
communication is one fused allreduce of one flat buffer per sync. Around a plain
torch optimizer the warm-up averages the parameters every step, which equals
synchronous SGD for SGD with (Nesterov) momentum and weight decay (the update is
linear in the gradient). Every decision depends on the step counter only, so all
ranks agree (the rule of consistency).

Under Horovod elastic (``HOROVOD_ELASTIC=1``) nothing is exchanged at construction (a
worker may join a running job); the configuration check and the agreement on the
counters (the most advanced rank's ``steps``, ``since_sync`` and period) run at the
first ``step()`` in each world, i.e. again after every re-initialisation of Horovod.
Until then the gradient exchange stays off, so the first step in a new world
exchanges, if it is a warm-up step, at ``optimizer.step()`` on every rank at once.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch

from ..ops.device import any_nonfinite
from ..world import World, fingerprint_mismatch
from ..options import Option, resolve_options
from ._common import FlatState, check_optimizer_model, exchange_for, is_distributed_optimizer, stats_for

_INT1 = dict(accepted="integer >= 1", check=lambda v: v >= 1)
_INT0 = dict(accepted="integer >= 0", check=lambda v: v >= 0)

LOCAL_OPTIONS = {
    "period": Option(int, 8, help="local steps between parameter averages (H)", **_INT1),
    "warmup": Option(int, 0, help="fully synchronous steps first (post-local SGD)", **_INT0),
    "sync_buffers": Option(bool, True, help="also average floating-point model buffers (BatchNorm stats)"),
    "sync_momentum": Option(bool, True, help="also average the optimizer's momentum/moment buffers"),
}


def resolve_warmup(owner: str, warmup: int, warmup_steps: Optional[int]) -> int:
    """``warmup``, or ``warmup_steps`` (its old name) when that is the one given."""
    if warmup_steps is None:
        return warmup
    if warmup != 0:
        raise ValueError(f"{owner}: 'warmup' given twice (as 'warmup_steps' too, its old name); give it once")
    return warmup_steps


def finite_average(tensors: List[torch.Tensor], name: str, process_set=None) -> Tuple[int, float, int]:
    """Average ``tensors`` in place over the ranks whose tensors are all finite.

    A rank holding NaN/Inf contributes zeros and a flag of 1; the flag (float32) travels in the same
    fused allreduce as the float32 tensors (one collective for a float32 model; one per dtype, as
    always, for other dtypes), so every rank learns how many ranks were bad and
    the average is rescaled by N / (N - bad): a non-finite value never reaches the average and the
    bad rank gets the others' mean. If every rank is bad, every rank keeps its own values.
    Returns (bytes, seconds, bad)."""
    ex = exchange_for(process_set)
    if not tensors:
        return 0, 0.0, 0
    bad = any_nonfinite(tensors)
    n = ex.size
    home = next((t for t in tensors if t.dtype == torch.float32), tensors[0])   # fused with the float32 ones
    flag = torch.full((1,), 1.0 if bad else 0.0, dtype=torch.float32, device=home.device)
    own = [t.detach().clone() for t in tensors] if bad else None
    if bad:
        with torch.no_grad():
            for t in tensors:
                t.zero_()
    nbytes, wait = ex.allreduce_average(list(tensors) + [flag], name)
    nbad = int(round(float(flag) * n))
    with torch.no_grad():
        if nbad >= n:      # nothing finite anywhere: every rank keeps its own values
            for t, o in zip(tensors, own):
                t.copy_(o)
        elif nbad:
            for t in tensors:
                t.mul_(n / (n - nbad))
    return nbytes, wait, nbad


def check_same_config(owner: str, fingerprint: Dict[str, Any], process_set=None) -> None:
    """Once at construction: every rank raises ValueError naming what differs across ranks."""

    msg = fingerprint_mismatch(exchange_for(process_set).allgather_object(fingerprint, "hvd_ext.sync.config"), owner)
    if msg is not None:
        raise ValueError(msg)


class _NoSharedState:
    """Strategies without process-wide state (no parameter server): nothing to close or share."""

    def close(self) -> None:
        pass

    def shared_state_dict(self):
        return None

    def load_shared_state_dict(self, sd) -> None:
        pass


class LocalSGD(_NoSharedState):
    """Average parameters every ``period`` steps with one fused allreduce (see module doc)."""

    name = "local"
    declared = LOCAL_OPTIONS

    def __init__(self, optimizer, model, period: int = 8, warmup: int = 0, sync_buffers: bool = True,
                 sync_momentum: bool = True, warmup_steps: Optional[int] = None, **extra):
        given = dict(period=period, warmup=resolve_warmup(type(self).__name__, warmup, warmup_steps),
                     sync_buffers=sync_buffers, sync_momentum=sync_momentum, **extra)
        self._setup(optimizer, model, given)

    def _setup(self, optimizer, model, given: Dict[str, Any]) -> None:
        owner = type(self).__name__
        check_optimizer_model(owner, optimizer, model)
        opts = resolve_options(owner, self.declared, given)
        self._configure(opts)
        import horovod.torch as hvd

        self.hvd = hvd
        self.optimizer = optimizer
        self.model = model
        self.options = opts
        self.process_set = getattr(optimizer, "process_set", None) or hvd.global_process_set
        self.state = FlatState(model, optimizer, opts["sync_buffers"], opts.get("sync_momentum", True))
        self.distributed = is_distributed_optimizer(optimizer)
        self.stats = stats_for(optimizer)
        self.steps = 0            # optimizer steps taken through this wrapper
        self.since_sync = 0       # local steps since the last parameter average
        self.syncs = 0            # parameter averages made
        self.grad_steps = 0       # steps whose gradients were exchanged (warm-up)
        self.skipped_syncs = 0    # averages where some rank held a non-finite value
        self.included = self.process_set.included()
        self.stats.extra.setdefault("sync", self.describe())
        self._fingerprint = {"sync": self.describe(), "distributed": self.distributed,
                             "tensors": [tuple(t.shape) for t in self.state.params + self.state.buffers],
                             "momentum": bool(self.state.momentum)}
        # Horovod elastic: no collective at construction; check and agree at the first step of each world

        self._world = World(exchange_for(self.process_set, optimizer), self.included)
        if self.included and not self._world.elastic:
            check_same_config(owner, self._fingerprint, self.process_set)
        self._set_mode()

    @property
    def world_changes(self) -> int:
        """Re-initialisations of Horovod this strategy has followed (elastic)."""
        world = getattr(self, "_world", None)
        return world.changes if world is not None else 0

    def _enter_world(self) -> None:
        """Under Horovod elastic, at the top of ``step()``/``finish()``: after a re-initialisation of
        Horovod (a worker left or joined) check the configuration and agree on the counters again,
        then set the gradient-exchange mode from the agreed counters -- the same on every rank."""

        w = self._world
        if w.moved():
            w.enter()
        if w.check_due:
            w.check_due = False
            check_same_config(type(self).__name__, self._fingerprint, self.process_set)
        if w.agree_due:
            self._agree()
            self._set_mode()

    def _settle(self) -> None:
        """Before the counters are read (``step``/``finish``): under Horovod elastic follow the world,
        else agree once with the other ranks (the resume recipe). Idempotent within a step."""
        if self._world.elastic:
            self._enter_world()
        elif self._world.agree_due:
            self._agree()

    def _agree(self) -> None:
        """Once, at the first step: if ranks hold different strategy state (a checkpoint loaded on
        rank 0 only, as in Horovod's resume recipe), every rank takes the most advanced rank's, so
        all ranks keep deciding identically when to average."""
        self._world.agree_due = False
        states = exchange_for(self.process_set).allgather_object(self.state_dict(), "hvd_ext.sync.resume")
        steps = [int(sd.get("steps", 0)) for sd in states]
        root = steps.index(max(steps))
        if any(sd != states[root] for sd in states):
            self.load_state_dict(states[root])

    # ---- configuration (AdaptiveSync overrides) ------------------------------------------
    def _configure(self, opts: Dict[str, Any]) -> None:
        self.period = opts["period"]
        self.warmup = opts["warmup"]

    def describe(self) -> str:
        return f"{self.name}:period={self.period},warmup={self.warmup}"

    # ---- per-step --------------------------------------------------------------------------
    def in_warmup(self, step: Optional[int] = None) -> bool:
        return (self.steps if step is None else step) < self.warmup

    def _set_mode(self) -> None:
        """Gradient exchange for the coming step: on during warm-up (DistributedOptimizer only);
        under Horovod elastic off until the counters are agreed in this world."""
        if self.distributed:
            w = getattr(self, "_world", None)
            pending = w is not None and w.elastic and (w.check_due or w.agree_due)
            self.optimizer.set_gradient_exchange(self.in_warmup() and not pending)

    def _due(self) -> bool:
        return self.since_sync >= self.period

    def step(self, loss=None, closure=None):
        self._settle()
        warm = self.in_warmup()
        out = self.optimizer.step(closure) if closure is not None else self.optimizer.step()
        self.steps += 1
        nbytes, wait, synced = 0, 0.0, False
        if warm:
            if self.distributed:
                self.grad_steps += 1      # the optimizer exchanged and recorded this step itself
            else:
                nbytes, wait = self._average(defer=True)
                synced = True
        else:
            self.since_sync += 1
            if self._due():
                nbytes, wait = self._average(defer=True)
                synced = True
        if not (warm and self.distributed):
            self.stats.record(bytes_sent=nbytes, bytes_received=nbytes, comm_wait_s=wait, compress_s=0.0,
                              skipped=False, exchanged=synced, sync_period=self.period)
        self._set_mode()
        return out

    def _tensors(self):
        return self.state.params + self.state.buffers + self.state.momentum_tensors()

    def _average(self, defer: bool = False):
        """Average the tensors now. ``defer``: a strategy may leave what it decides from the average
        in flight until the next ``step`` (``AdaptiveSync``); here nothing is decided."""
        if not self.included:  # outside the process set: local steps only, as Horovod
            self.since_sync = 0
            return 0, 0.0
        nbytes, wait, bad = finite_average(self._tensors(), "hvd_ext.sync.params", self.process_set)
        if bad:
            self.skipped_syncs += 1
            self.stats.extra["skipped_syncs"] = self.skipped_syncs
        self.since_sync = 0
        self.syncs += 1
        return nbytes, wait

    def finish(self) -> None:
        """Average what is left since the last sync so every rank ends with the same model."""
        self._settle()
        if self.since_sync > 0:
            nbytes, wait = self._average()
            self.stats.exchanges += 1
            self.stats.bytes_sent += nbytes
            self.stats.bytes_received += nbytes
        if self.distributed:
            self.optimizer.set_gradient_exchange(True)

    @property
    def exchanges(self) -> int:
        """Parameter averages + gradient-exchange steps made by this rank."""
        return self.syncs + self.grad_steps

    # ---- checkpoint ------------------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        return {"kind": self.name, "steps": self.steps, "since_sync": self.since_sync, "syncs": self.syncs,
                "grad_steps": self.grad_steps, "period": self.period}

    def load_state_dict(self, sd: Dict[str, Any]) -> None:
        if sd.get("kind") != self.name:
            raise ValueError(f"{type(self).__name__}.load_state_dict: checkpoint is for sync '{sd.get('kind')}'")
        self.steps, self.since_sync = int(sd["steps"]), int(sd["since_sync"])
        self.syncs, self.grad_steps = int(sd["syncs"]), int(sd["grad_steps"])
        self.period = int(sd["period"])
        self._set_mode()


class EverySync(_NoSharedState):
    """``--sync every``: plain data parallel; the optimizer exchanges gradients each step."""

    name = "every"
    declared: Dict[str, Option] = {}

    def __init__(self, optimizer, model, **extra):
        check_optimizer_model("EverySync", optimizer, model)
        resolve_options("EverySync", self.declared, extra)
        self.optimizer = optimizer
        self.model = model
        self.stats = stats_for(optimizer)
        # hvd_ext's optimizer, or Horovod's own (the plain-Horovod baseline): both exchange in step()
        self.distributed = is_distributed_optimizer(optimizer) or callable(getattr(optimizer, "synchronize", None))
        if not self.distributed:
            raise ValueError("EverySync: needs a distributed optimizer (hvd_ext.DistributedOptimizer or "
                             "hvd.DistributedOptimizer); plain optimizers do not exchange")
        self.steps = 0

    def describe(self) -> str:
        return "every"

    def step(self, loss=None, closure=None):
        self.steps += 1
        return self.optimizer.step(closure) if closure is not None else self.optimizer.step()

    def finish(self) -> None:
        pass

    @property
    def exchanges(self) -> int:
        return self.stats.exchanges

    def state_dict(self):
        return {"kind": "every", "steps": self.steps}

    def load_state_dict(self, sd):
        self.steps = int(sd.get("steps", 0))
