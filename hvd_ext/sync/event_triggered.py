"""Event-triggered asynchronous local SGD (technique 1 in docs/techniques.md) with loss-weighted
staleness compensation (technique 2), against the one-sided ``ParameterServer``.

Global variable consensus (Boyd et al. 2011): minimise sum_i f_i(x_i) subject to x_i = z. Worker i
runs local SGD on x_i and keeps x̂_i, its parameters at its last exchange. After
every local step it evaluates the event trigger (event-triggered control of
multi-agent systems, Dimarogonas, Frazzoli, Johansson, IEEE TAC 2012)::

    exchange  iff  tau_local >= tau_min  and  ( tau_local >= tau_max  or
                   ||x_i - x̂_i||² > sigma * ||x̂_i||² * rho^k + eps )

k = exchanges so far (a decaying threshold for rho < 1), tau_local = local steps
since the last exchange: never before tau_min steps (no Zeno behaviour), always
by tau_max (bounded drift). An exchange pushes

    Δ_i = w_s * (x_i - x̂_i) / N      into z by MPI Accumulate(op=SUM),

then Gets z and sets x_i = x̂_i = z. There is no barrier: the other workers keep
computing. Staleness weight w_s:

* ``"loss"`` (technique 2): w_s = min(1, L_global / L_i)^gamma, L_i = the mean
  training loss over the local steps that produced this update, L_global = the
  mean of the latest entries of all workers on the loss board (this worker's
  entry included, written just before the push). gamma = 0 is plain async SGD.
* ``"inverse"``: staleness-aware ASGD (Zhang et al., IJCAI 2016), w_s = 1 / tau with tau = 1 + the
  number of other workers' pushes since this worker last pulled (read from the
  board's push counters).
* ``"none"``: w_s = 1.

``finish()`` ends training consistently: every worker pushes its remaining drift
(w_s = 1), one barrier, then every worker pulls the same z, so all ranks finish
with identical parameters; with ``sync_buffers`` (default) the floating-point model
buffers (BatchNorm running statistics, never pushed to the server) are then averaged
by one Horovod allreduce, so the buffers end identical too. ``stats.extra`` has
``trigger_reasons`` (threshold / tau_max / final counts), ``weights`` and ``delays`` (one entry per exchange),
and ``local_steps``; ``stats.exchanges`` counts exchanges per rank.

A fast worker should not wait for a slow one: give the run a budget of samples over all workers
and stop when ``global_steps()`` (the workers' steps together, read one-sided from the board)
reaches it, and index the learning-rate schedule by that global progress. Each worker stepping
through its own step-indexed schedule leaves the fast one at a near-zero rate while the slow one
still pushes large steps; on label-skewed shards that pulls z toward the slow worker's classes
(``benchmarks/workload_train.py`` does it the global way).

Needs the MPI controller (``horovodrun --mpi`` or ``mpirun``); under Gloo the
constructor raises RuntimeError before touching MPI. Around an
``hvd_ext.DistributedOptimizer`` the gradient exchange is switched off for the
whole run (local steps only).
"""
from __future__ import annotations

import math
import time
from typing import Any, Dict, Optional

import torch

from ..options import Option, resolve_options
from ._common import (FlatState, average_buffers, check_optimizer_model, exchange_for, is_distributed_optimizer,
                      stats_for)
from .param_server import PS_OPTIONS, ParameterServer, require_mpi_controller
from .local_sgd import check_same_config

STALENESS = ("loss", "inverse", "none")

EVENT_OPTIONS = {
    "sigma": Option(float, 2e-4, accepted="sigma >= 0", check=lambda v: v >= 0,
                    help="relative drift threshold: exchange when ||x-x̂||² > sigma·||x̂||²·rho^k + eps"),
    "rho": Option(float, 1.0, accepted="0 < rho <= 1", check=lambda v: 0 < v <= 1,
                  help="threshold decay per exchange"),
    "eps": Option(float, 0.0, accepted="eps >= 0", check=lambda v: v >= 0, help="absolute threshold floor"),
    "tau_min": Option(int, 5, accepted="integer >= 1", check=lambda v: v >= 1,
                      help="never exchange before this many local steps"),
    "tau_max": Option(int, 16, accepted="integer >= tau_min", check=lambda v: v >= 1,
                      help="always exchange after this many local steps"),
    "staleness": Option(str, "loss", choices=STALENESS, help="push weighting"),
    "gamma": Option(float, 1.0, accepted="gamma >= 0", check=lambda v: v >= 0,
                    help="exponent of the loss-based staleness weight"),
    "sync_buffers": Option(bool, True, help="average floating-point model buffers (BatchNorm stats) in finish()"),
    **PS_OPTIONS,
}


def trigger(drift_sq: float, ref_sq: float, k: int, since: int, sigma: float, rho: float, eps: float,
            tau_min: int, tau_max: int) -> Optional[str]:
    """The event trigger (pure): None, "tau_max" or "threshold"."""
    if since < tau_min:
        return None
    if since >= tau_max:
        return "tau_max"
    if drift_sq > sigma * ref_sq * rho ** k + eps:
        return "threshold"
    return None


def staleness_weight(mode: str, gamma: float = 1.0, loss_global: Optional[float] = None,
                     loss_local: Optional[float] = None, tau: int = 1) -> float:
    """w_s for a push (see module doc). Missing or non-finite losses give weight 1."""
    if mode == "none":
        return 1.0
    if mode == "inverse":
        return 1.0 / max(int(tau), 1)
    if mode == "loss":
        if (loss_global is None or loss_local is None or not math.isfinite(loss_global)
                or not math.isfinite(loss_local) or loss_local <= 0 or loss_global < 0):
            return 1.0
        return min(1.0, loss_global / loss_local) ** gamma
    raise ValueError(f"staleness: bad value {mode!r}; accepted: one of {', '.join(map(repr, STALENESS))}")


class EventTriggeredSGD:
    """Event-triggered asynchronous local SGD on an RMA parameter server (see module doc)."""

    name = "event"
    declared = EVENT_OPTIONS

    def __init__(self, optimizer, model, sigma: float = 2e-4, rho: float = 1.0, eps: float = 0.0,
                 tau_min: int = 5, tau_max: int = 16, staleness: str = "loss", gamma: float = 1.0,
                 sync_buffers: bool = True, progress: str = "auto", progress_interval: float = 0.002, comm=None):
        check_optimizer_model("EventTriggeredSGD", optimizer, model)
        o = resolve_options("EventTriggeredSGD", self.declared,
                    dict(sigma=sigma, rho=rho, eps=eps, tau_min=tau_min, tau_max=tau_max, staleness=staleness,
                         gamma=gamma, sync_buffers=sync_buffers, progress=progress,
                         progress_interval=progress_interval))
        if o["tau_max"] < o["tau_min"]:
            raise ValueError(f"EventTriggeredSGD: bad value {o['tau_max']!r} for 'tau_max': "
                             f"accepted: integer >= tau_min (= {o['tau_min']})")
        require_mpi_controller("EventTriggeredSGD")
        self.o = o
        self.optimizer = optimizer
        self.model = model
        self.state = FlatState(model, optimizer, buffers=False, momentum=False)
        self.distributed = is_distributed_optimizer(optimizer)
        if self.distributed:
            optimizer.set_gradient_exchange(False)
        self.stats = stats_for(optimizer)
        x0 = self.state.params_vector()
        if comm is None:  # the server spans every rank: same configuration everywhere
            check_same_config("EventTriggeredSGD", {"sync": self.describe(), "numel": int(x0.numel())})
        self.comm_is_world = comm is None  # buffers are averaged over Horovod's global set only then
        self.server = ParameterServer(x0.numel(), init=x0.numpy(), comm=comm, progress=o["progress"],
                                      progress_interval=o["progress_interval"])
        self.n = self.server.size
        self.rank = self.server.rank
        self.xhat = x0.clone()
        self.ref_sq = float(x0.dot(x0))
        self.k = 0
        self.since = 0
        self.steps = 0
        self._loss_sum, self._loss_n = 0.0, 0
        self._others_seen = 0.0
        self.reasons = {"threshold": 0, "tau_max": 0, "final": 0}
        self.skipped_pushes = 0
        self.weights: list = []
        self.delays: list = []
        self._publish()

    def describe(self) -> str:
        o = self.o
        return (f"event:sigma={o['sigma']},rho={o['rho']},eps={o['eps']},tau_min={o['tau_min']},"
                f"tau_max={o['tau_max']},staleness={o['staleness']},gamma={o['gamma']}")

    def _publish(self) -> None:
        self.stats.extra.update({"sync": self.describe(), "trigger_reasons": self.reasons, "weights": self.weights,
                                 "delays": self.delays, "local_steps": self.steps, "rma_progress": self.server.progress})

    # ---- per-step --------------------------------------------------------------------------
    def step(self, loss=None, closure=None):
        out = self.optimizer.step(closure) if closure is not None else self.optimizer.step()
        self.steps += 1
        self.since += 1
        if loss is not None:
            lv = float(loss.detach().item() if torch.is_tensor(loss) else loss)
            if math.isfinite(lv):
                self._loss_sum += lv
                self._loss_n += 1
        reason = None
        if self.since >= self.o["tau_min"]:
            x = self.state.params_vector()
            d = x - self.xhat
            reason = trigger(float(d.dot(d)), self.ref_sq, self.k, self.since, self.o["sigma"], self.o["rho"],
                             self.o["eps"], self.o["tau_min"], self.o["tau_max"])
        nbytes, wait = 0, 0.0
        if reason is not None:
            nbytes, wait = self._exchange(x, reason)
        self.stats.record(bytes_sent=nbytes, bytes_received=nbytes, comm_wait_s=wait, compress_s=0.0,
                          skipped=False, exchanged=reason is not None)
        self.stats.extra["local_steps"] = self.steps
        return out

    def _exchange(self, x: torch.Tensor, reason: str, weight: Optional[float] = None):
        t0 = time.perf_counter()
        li = self._loss_sum / self._loss_n if self._loss_n else float("nan")
        board = self.server.post_board(li if math.isfinite(li) else 0.0, self.steps, pushes=self.server.pushes + 1)
        others = float(board[:, 3].sum() - board[self.rank, 3])
        tau = 1 + max(int(round(others - self._others_seen)), 0)
        if weight is None:
            posted = board[board[:, 3] > 0, 0]
            lg = float(posted.mean()) if posted.size and math.isfinite(li) else None
            weight = staleness_weight(self.o["staleness"], self.o["gamma"], lg, li if math.isfinite(li) else None, tau)
        delta = (x - self.xhat) * (weight / self.n)
        if not bool(torch.isfinite(delta).all()):
            # A non-finite value never reaches the server: push nothing, take z (recovers this rank).
            delta = torch.zeros_like(delta)
            self.skipped_pushes += 1
            self.stats.extra["skipped_pushes"] = self.skipped_pushes
        delta = delta.numpy()
        z = torch.from_numpy(self.server.push_pull(delta))
        self._others_seen = others
        self.state.set_params_vector(z)
        self.xhat = z
        self.ref_sq = float(z.dot(z))
        self.k += 1
        self.since = 0
        self._loss_sum, self._loss_n = 0.0, 0
        self.reasons[reason] += 1
        self.weights.append(round(float(weight), 6))
        self.delays.append(tau)
        return 2 * 8 * self.server.numel, time.perf_counter() - t0

    def finish(self) -> None:
        """Push the remaining drift, barrier, pull the common z: all ranks end identical."""
        x = self.state.params_vector()
        nbytes = wait = 0
        if self.since > 0:
            nbytes, wait = self._exchange(x, "final", weight=1.0)
            self.stats.exchanges += 1
            self.stats.bytes_sent += nbytes
            self.stats.bytes_received += nbytes
        self.server.barrier()
        z = torch.from_numpy(self.server.pull())
        self.state.set_params_vector(z)
        self.xhat = z
        self.server.barrier()
        if self.o["sync_buffers"] and self.comm_is_world:
            nb = average_buffers(self.model, exchange=exchange_for(None, self.optimizer))
            self.stats.bytes_sent += nb
            self.stats.bytes_received += nb
        self._publish()
        if self.distributed:
            self.optimizer.set_gradient_exchange(True)

    def close(self) -> None:
        self.server.close()

    @property
    def exchanges(self) -> int:
        return self.k

    def global_steps(self) -> int:
        """Local steps of all workers together, as of each worker's last push (one-sided read of the
        board, no collective). A training loop that gives every method the same total number of
        samples stops when this reaches its budget, and follows it with its learning-rate schedule:
        a fast worker then takes more steps instead of waiting, and both workers sit at the same
        point of the schedule at the same time."""
        board = self.server.read_board()
        mine = self.steps - int(board[self.rank, 1])  # this worker's steps since its last push
        return int(board[:, 1].sum()) + max(mine, 0)

    # ---- checkpoint ----------------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        return {"kind": self.name, "xhat": self.xhat.clone(), "k": self.k, "since": self.since, "steps": self.steps,
                "loss_sum": self._loss_sum, "loss_n": self._loss_n, "others_seen": self._others_seen,
                "reasons": dict(self.reasons), "weights": list(self.weights), "delays": list(self.delays),
                "pushes": self.server.pushes, "pulls": self.server.pulls}

    def load_state_dict(self, sd: Dict[str, Any]) -> None:
        if sd.get("kind") != self.name:
            raise ValueError(f"EventTriggeredSGD.load_state_dict: checkpoint is for sync '{sd.get('kind')}'")
        self.xhat = sd["xhat"].clone().to(torch.float64)
        self.ref_sq = float(self.xhat.dot(self.xhat))
        self.k, self.since, self.steps = int(sd["k"]), int(sd["since"]), int(sd["steps"])
        self._loss_sum, self._loss_n = float(sd["loss_sum"]), int(sd["loss_n"])
        self._others_seen = float(sd["others_seen"])
        self.reasons.clear()
        self.reasons.update(sd["reasons"])
        self.weights[:] = sd["weights"]
        self.delays[:] = sd["delays"]
        self.server.pushes, self.server.pulls = int(sd["pushes"]), int(sd["pulls"])

    def shared_state_dict(self) -> Dict[str, Any]:
        """The parameter server's state (z, board, counters): one-sided, call on one rank at a quiet point."""
        return self.server.state_dict()

    def load_shared_state_dict(self, sd: Dict[str, Any]) -> None:
        """Collective: restore z and the board on their owner ranks."""
        pushes, pulls = self.server.pushes, self.server.pulls
        self.server.load_state_dict(sd)
        self.server.pushes, self.server.pulls = pushes, pulls  # per-rank counters come from state_dict()
