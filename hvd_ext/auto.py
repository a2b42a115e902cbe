"""``compression="auto"``: per bucket, the most accurate candidate codec whose predicted step time is
within ``slack`` of the fastest's.

Compression pays only when the link is slow relative to the codec (Agarwal et al., "On the utility
of gradient compression in distributed training systems", MLSys 2022), so ``auto`` measures both
where it runs. One decision (:meth:`AutoTuner.evaluate`) is measure -> predict -> choose -> agree:

* **measure** -- the link from its own exchanges (a small and a 1 MB allreduce give the fixed cost
  ``lat`` and the bandwidth ``bw``, :mod:`hvd_ext.exchange.cost`); every candidate's encode and
  decode time on each bucket's current gradient; compute as the median step period minus the
  median exchange time. The ranks' mean of all of it, in one allreduce.
* **predict** -- for bucket b and candidate c on each route r it may take (flat, and across nodes
  node-aware), priced as the planner prices it (:mod:`hvd_ext.exchange.bucket_cost`)::

      t(b, c, r) = fixed cost of r's collectives + bytes on the busiest link / bandwidth + codec time

  (each collective's fixed cost a calibration file's where it timed them, else ``lat``; across
  nodes the node links); the fastest route, scaled by what chosen codecs measured against their
  prediction (``AutoTuner.calibration``).
* **choose** -- candidates are listed most accurate first; a bucket takes the first whose time is
  within ``slack`` of the fastest's share of the predicted step. A change needs ``margin`` over the
  current choice (hysteresis against measurement noise).
* **agree** -- rank 0's choice is broadcast, so every rank uses the same codec for every bucket.
  When the model cannot separate candidates (predicted within ``CONTEND`` x of the fastest), each
  contender runs ``trial`` exchanges in two interleaved rounds and the measured step periods decide
  (successive halving cuts the slow ones early: Jamieson and Talwalkar 2016).

**Accuracy guard** (``accuracy=strict``, the default): a lossy candidate is eligible on a bucket
only if its error ratio with error feedback, measured on that bucket's own warm-up gradients, is
within ``bound`` (:mod:`hvd_ext.accuracy_guard`). The verdict depends on the gradients alone, not on
timing. Under an adaptive optimizer with a live second moment, candidates with an error-feedback
memory are not eligible (:mod:`hvd_ext.variance_freeze`); ``variance=freeze`` allows them.
``accuracy=relaxed`` chooses by speed alone (warned).

**Memory:** candidates whose own feedback is residual (top-k, the sign codecs) share one residual
error feedback (Seide et al. 2014; Karimireddy et al. 2019); lossless and unbiased ones (none, fp16,
qsgd) run without one, as they do fixed. When a bucket's codec changes, what the old codec had not
sent is released evenly over the next ``release`` exchanges: nothing is lost, and each step gets a
small share (a top-k memory holds up to about 1/ratio steps of gradient; a short release after the
trial jolts momentum SGD, docs/auto.md).

Until the first decision (``warmup`` exchanges) every bucket is sent dense. A decision is re-taken
every ``every`` exchanges, ``check`` exchanges after a codec that has not run before is chosen (to
calibrate the model with its measured cost), and when the measured exchange time leaves [0.5x, 2x]
of the prediction. A candidate is timed and sized at the step it would run from: one still in its
own dense warm-up (``powersgd`` before its ``warmup=`` exchanges) is priced dense, as it would send,
and the decision is taken again at the exchange its warm-up ends (right after a trial that ran past
it), where the guard leaves it some bucket; that decision learns no calibration from the exchanges
before it, nor does a trial contender that ran that candidate past that exchange. The default
candidates stop at 8 bits and 3%: coarser codecs only when listed.
Measurements behind these defaults: ``docs/auto.md`` and ``benchmarks/auto_trust.py``.

Spec: ``auto:every=1000,warmup=5,accuracy=strict,bound=0.5,candidates=none,fp16,topk:ratio=0.01``
(``candidates=`` comes last; an item with a ``:`` or without ``=`` starts a new candidate, other
``key=value`` items belong to the candidate before it; parsed by :mod:`hvd_ext.spec`).
"""
from __future__ import annotations

import dataclasses
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from .accuracy_guard import DEFAULT_BOUND, AccuracyGuard
from .feedback.residual import ResidualFeedback
from .compression.base import Compressor, Continue, TensorInfo
from .compression.common import COMMON_ALIASES, COMMON_OPTIONS
from .exchange import calibration, cost
from .exchange.probe import best_time
from .exchange.bucket_cost import Network
from .exchange.routes import (TensorRecord, bucket_routes, fastest_route, flat_record, node_aware_reason, node_links,
                              route_cost)
from .ops.device import Timer
from .options import Option, resolve_options
from .policy import CONTEND, SETTLE, Policy, median, ranks_mean
from .variance_freeze import adaptive_kind

DEFAULT_CANDIDATES = ("none", "fp16", "qsgd:bits=8", "topk:ratio=0.03")
_PROBE_SMALL = 256                 # floats
_PROBE_LARGE = 256 * 1024          # floats (1 MB)
_PROBE_ENOUGH = 10.0  # one large probe suffices once it takes this x the small one (bandwidth-bound)
_CUT = 1.3      # a trial contender this x (1 + slack) slower than the shortest so far stops early
_ROUNDS = 2     # a trial's contenders take turns in this many rounds (ABC CBA)
WARMED_UP = "candidate warm-up over"  # the reason of a decision at the end of a candidate's own warm-up

AUTO_OPTIONS = {
    # of the options every codec takes, auto takes these two; route and hierarchy are its candidates'
    "variance": COMMON_OPTIONS["variance"],
    "warmup": Option(int, None, "int >= 2", lambda v: v >= 2,
                     help="dense exchanges before the first decision (default 5)"),
    "every": Option(int, 1000, "int >= 1", lambda v: v >= 1, help="exchanges between two decisions"),
    "check": Option(int, 50, "int >= 1", lambda v: v >= 1,
                    help="exchanges between two checks of measured against predicted time"),
    "slack": Option(float, 0.05, "0 <= slack <= 10", lambda v: 0 <= v <= 10,
                    help="step time a more accurate candidate may cost over the fastest (fraction)"),
    "release": Option(int, 128, "int >= 1", lambda v: v >= 1,
                      help="exchanges over which a replaced codec's memory is sent"),
    "margin": Option(float, 0.15, "0 <= margin < 1", lambda v: 0 <= v < 1,
                     help="predicted gain a new choice needs over the current one"),
    "accuracy": Option(str, "strict", "strict or relaxed", choices=("strict", "relaxed"),
                       help="strict: a lossy candidate is used on a bucket only if the accuracy guard finds its "
                            "error within 'bound' (hvd_ext.accuracy_guard); relaxed: by speed alone"),
    "bound": Option(float, DEFAULT_BOUND, "0 < bound <= 10", lambda v: 0 < v <= 10,
                    help="the guard's largest error ratio q of an eligible codec (hvd_ext.accuracy_guard)"),
    "trial": Option(int, 20, "int >= 0", lambda v: v >= 0,
                    help="exchanges each contender runs when the model cannot separate them (0: trust the model)"),
}


def fastest_candidate(times: Sequence[float], dense: int) -> int:
    """The fastest candidate for one bucket, the ``dense`` one unless another is more than 0.1% faster
    (a near tie stays dense): ``auto``'s, and the planner's."""
    best = dense
    for ci, t in enumerate(times):
        if t < times[best] * (1 - 1e-3):
            best = ci
    return best


def most_accurate_within(times: Sequence[float], fastest: int, allowance: float) -> int:
    """The first candidate (candidates are listed most accurate first) whose predicted time is within
    ``allowance`` seconds of the fastest's: ``auto``'s choice for one bucket, and the planner's."""
    return next(ci for ci, t in enumerate(times) if t <= times[fastest] + allowance)


class AutoCompression(Compressor):
    """Holds the candidate compressors and the shared residual feedback; the decisions live in
    :class:`AutoTuner`, one per gradient pipeline."""

    name = "auto"
    collective = "allreduce"
    options = AUTO_OPTIONS
    default_feedback = "residual"

    def __init__(self, candidates: Sequence[Tuple[str, Compressor]], **kwargs):
        """``candidates``: (spec, compressor) pairs, most accurate first, built by
        :func:`hvd_ext.spec.compression_from_spec`; ``kwargs``: the options above."""
        self.opts = resolve_options("compressor 'auto'", self.options, kwargs,
                                    aliases={k: v for k, v in COMMON_ALIASES.items() if v in self.options})
        self.common = {}
        for k, v in self.opts.items():
            setattr(self, k, v)
        if not candidates:
            raise ValueError("auto: candidates must be a non-empty list of compression specs")
        self.candidate_specs = [s for s, _ in candidates]
        self.candidates: List[Compressor] = []
        self.memory: List[bool] = []  # per candidate: runs under the shared residual (else none, as fixed)
        self.live_second_moment = False  # set by bind_optimizer
        self.feedback = ResidualFeedback()
        self.feedback.shared_by_candidates = True
        for s, c in candidates:
            if c.name == "auto":
                raise ValueError(f"auto: a candidate cannot be 'auto' (candidates: {', '.join(self.candidate_specs)})")
            if c.feedback is not None and c.feedback.name not in ("none", "residual"):
                raise ValueError(f"auto: candidate {s!r} uses feedback={c.feedback.name!r}; candidates share one "
                                 "residual error feedback (accepted: feedback=none or residual)")
            self.memory.append(not c.lossless and c.feedback is not None and c.feedback.name == "residual")
            c.feedback = self.feedback
            self.candidates.append(c)
        if len(set(c.spec() for c in self.candidates)) != len(self.candidates):
            raise ValueError(f"auto: candidates listed twice in {', '.join(self.candidate_specs)}")
        self.route = "auto"

    def default_warmup(self, frozen_moment: bool) -> int:
        return 5  # dense exchanges before the first decision: enough timed steps to measure

    def uses_memory(self, comp: Compressor) -> bool:
        """Does candidate ``comp`` run under the shared residual? Those whose own feedback is
        ``residual`` (top-k, the sign codecs) do; lossless and unbiased codecs (qsgd) run without one,
        exactly as they run fixed."""
        return any(c is comp and m for c, m in zip(self.candidates, self.memory))

    def allowed(self, candidate: int) -> bool:
        """Not ruled out by the optimizer: under an adaptive one with a live second moment only
        candidates without a memory; under a momentum optimizer no codec that needs its own memory to
        compress the momentum (``compress_momentum``: the shared one keeps the optimizer's momentum)."""
        c = self.candidates[candidate]
        return not ((self.live_second_moment and self.memory[candidate])
                    or getattr(c, "needs_compressed_momentum", False))

    # The pipeline calls these on the compressor it was given: pass them on to every candidate.
    def bind_optimizer(self, optimizer) -> None:
        # An adaptive optimizer's live second moment squares the delayed bursts of error feedback
        # (hvd_ext.variance_freeze): with it live, candidates with a memory are not eligible.
        self.live_second_moment = adaptive_kind(optimizer) is not None and self.variance != "freeze"
        super().bind_optimizer(optimizer)  # the shared feedback
        for c in self.candidates:
            bind = getattr(type(c), "bind_optimizer", None)
            if bind is not None and bind is not Compressor.bind_optimizer:
                bind(c, optimizer)
        if not any(self.allowed(i) for i in range(len(self.candidates))):
            raise ValueError(f"auto: no candidate can run under {type(optimizer).__name__} (candidates: "
                             f"{', '.join(self.candidate_specs)}); accepted: a list with one that keeps no "
                             "error-feedback memory, e.g. none, fp16 or qsgd:bits=8")

    def compress(self, tensor, info):  # pragma: no cover - the pipeline uses the candidates
        raise RuntimeError("auto is a selector: the pipeline compresses with the chosen candidate")

    def commit(self) -> None:
        for c in self.candidates:
            c.commit()

    def discard(self) -> None:
        for c in self.candidates:
            c.discard()

    def state_dict(self) -> Dict[str, Any]:
        return {s: c.state_dict() for s, c in zip(self.candidate_specs, self.candidates)}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        for s, c in zip(self.candidate_specs, self.candidates):
            if s in (state or {}):
                c.load_state_dict(state[s])

    def spec(self) -> str:
        items = [f"{k}={v}" for k, v in self.opts.items() if v != self.options[k].default]
        if self.candidate_specs != list(DEFAULT_CANDIDATES):
            items.append("candidates=" + ",".join(self.candidate_specs))
        return "auto" + (":" + ",".join(items) if items else "")


@dataclass
class Measurement:
    """The ranks' mean of one decision's measurements."""

    lat: float                       # seconds of one collective's fixed cost
    bw: float                        # wire bytes per second
    compute: float                   # median step period minus median exchange time
    ran: float                       # median exchange time of the codecs chosen until now
    codec: List[List[Tuple[float, float, float]]]  # [bucket][candidate] = (encode s, decode s, bytes)


@dataclass
class Forecast:
    """One bucket's predicted exchange time per candidate, on the route each would take."""

    numel: int
    times: List[float]
    routes: List[str]
    fastest: int = 0                 # the fastest eligible candidate


@dataclass
class Contender:
    """One configuration a trial measures: a candidate per bucket, their routes, the prediction."""

    label: str
    choice: List[int]
    routes: List[str]
    predicted: float


@dataclass
class Trial:
    """Contenders measured in turns: ``_ROUNDS`` rounds of ``window`` exchanges each (ABC CBA)."""

    contenders: List[Contender]
    order: List[int]                 # by prediction, fastest first
    start: int                       # step the current window began
    window: int
    round: int = 0
    i: int = 0                       # position in the current round's order
    periods: Dict[int, List[float]] = field(default_factory=dict)
    exchange_s: Dict[int, List[float]] = field(default_factory=dict)
    first: Dict[int, float] = field(default_factory=dict)  # first-round median period (ranks' mean)
    cut: List[int] = field(default_factory=list)           # contenders stopped early

    def round_order(self) -> List[int]:
        """This round's contenders in running order: the first round by prediction, later rounds
        reversed and without those cut early."""
        if self.round == 0:
            return self.order
        return list(reversed([ci for ci in self.order if ci not in self.cut]))


class AutoTuner(Policy):
    """Per-pipeline decisions of :class:`AutoCompression` (see the module docstring): the policy
    (:mod:`hvd_ext.policy`) that picks each bucket's codec."""

    key = "auto"

    def __init__(self, auto: AutoCompression, pipeline):
        self.auto = auto
        self.pipe = pipeline
        self.choice: List[int] = [self.dense_index(auto)] * len(pipeline.buckets)
        self.last_eval: Optional[int] = None
        self.priced_at: Optional[int] = None  # the step at which the candidates' codecs were last timed
        self.predicted_s: Optional[float] = None
        self.link: Dict[str, float] = {}
        self.network: Optional[Network] = None  # what the last decision priced the routes on
        self.decisions: List[Dict[str, Any]] = []
        self._measured: List[float] = []
        self._check_every = auto.check
        self._periods: List[float] = []
        self._last_end: Optional[float] = None
        self.debt: Dict[str, torch.Tensor] = {}   # memory of a replaced codec, released over steps
        self.debt_left: Dict[str, int] = {}
        self._released: Dict[str, torch.Tensor] = {}
        self.calib: Dict[int, float] = {}  # candidate -> measured / predicted exchange time, when it ran
        self._probe: Optional[Dict[str, float]] = None  # this rank's last link probe
        self._codec_rows: Optional[tuple] = None  # (bucket sizes, this rank's last codec timings)
        self._trial: Optional[Trial] = None  # contenders being measured (see _contenders)
        self._strikes = 0  # drift checks in a row outside [0.5x, 2x] of the prediction
        # accuracy=strict: which lossy candidates each bucket may use, from its warm-up gradients
        self.guard: Optional[AccuracyGuard] = None
        if auto.accuracy == "strict" and any(not c.lossless for c in auto.candidates):
            self.guard = AccuracyGuard(auto.candidates, auto.bound, memory=auto.memory)
        elif auto.accuracy == "relaxed" and pipeline.rank == 0:
            warnings.warn("hvd_ext auto: accuracy=relaxed: candidates are chosen by speed alone, so a coarse "
                          "codec can cost accuracy against compression='none' (top-k at 1% lost points in "
                          "benchmarks/auto_trust.py); the default accuracy=strict uses a lossy codec only "
                          "where its measured error is within 'bound'", RuntimeWarning, stacklevel=4)

    @staticmethod
    def dense_index(auto: AutoCompression) -> int:
        """The candidate used before the first decision: ``none`` if listed, else the first."""
        for i, c in enumerate(auto.candidates):
            if c.name == "none":
                return i
        return 0

    # ---- called by the pipeline --------------------------------------------------------
    def exchange_time(self, seconds: float) -> None:
        """This rank's time spent in the exchange of the step that just finished (and the step period)."""
        self._measured.append(seconds)
        now = time.perf_counter()
        if self._last_end is not None:
            self._periods.append(now - self._last_end)
        self._last_end = now

    def after_step(self, exchange_s: float) -> None:
        self.exchange_time(exchange_s)
        step, a = self.pipe.step, self.auto
        if self.guard is not None and self.guard.ratio is None and self.guard.kept():
            self.guard.measure(self.pipe.buckets, self._roundtrip)
        if step < max(a.warmup_length(), self.pipe.warmup):  # the dense warm-up (compression.common)
            return
        if self._trial is not None:
            t, ran = self._trial, step - self._trial.start
            if ran >= SETTLE + t.window:
                self._trial_window_done()
            elif ran == SETTLE + max(3, a.trial // 4) and t.round == 0 and t.first:
                self._trial_window_done(early=True)
            return
        if self.last_eval is None:
            self.evaluate("warmup")
        elif self._warm_up_ended(step):
            self.evaluate(WARMED_UP)  # a candidate priced dense in its own warm-up: price it as it now sends
        elif step - self.last_eval >= a.every:
            self.evaluate("scheduled")
        elif step - self.last_eval >= a.check and self._measured and any(ci not in self.calib for ci in self.choice):
            self.evaluate("calibrate")  # a newly chosen codec has run `check` exchanges: learn its real cost
        elif (step - self.last_eval) % self._check_every == 0 and self._measured:
            self._check_drift()

    def _warm_up_ended(self, step: int) -> bool:
        """A candidate some bucket may use ended its own dense warm-up (``Compressor.own_warmup``) since
        the codecs were last timed (a trial ran past it too): the same on every rank (step, candidates,
        the guard's agreed verdict, the agreed state)."""
        buckets = range(len(self.pipe.buckets))
        return any(self._warmed_up_since_priced(ci, step) and any(self.eligible(bi, ci) for bi in buckets)
                   for ci in range(len(self.auto.candidates)))

    def _warmed_up_since_priced(self, candidate: int, step: int) -> bool:
        """``candidate`` ended its own dense warm-up after the codecs were last timed, by ``step``: its
        exchanges since then were priced as it sent before."""
        priced = self.priced_at if self.priced_at is not None else self.last_eval
        return priced < self.auto.candidates[candidate].own_warmup() <= step

    def _learn_from_trial(self, measured: float, contender: Contender) -> None:
        """Calibrate ``contender``'s candidates from its trial exchanges (the last of them ran at the
        step before this one), unless one of its candidates ended its own dense warm-up between the
        pricing and that exchange: some exchanges it measured then ran otherwise than they were priced,
        and none of its candidates learns from them (the decision right after the trial prices that
        candidate again, :meth:`_warm_up_ended`)."""
        if not any(self._warmed_up_since_priced(ci, self.pipe.step - 1) for ci in set(contender.choice)):
            self._calibrate(measured, [contender.predicted], ran=contender.choice)

    # ---- carrying a replaced codec's memory over -------------------------------------------
    def switched(self, b) -> None:
        """Bucket ``b`` changes codec: its committed memory becomes a debt paid over ``release`` steps."""
        fb = self.pipe.feedback
        for name in b.names:
            mem = fb.memory.pop(name, None)
            if mem is None:
                continue
            old = self.debt.get(name)
            self.debt[name] = mem.clone() if old is None else old + mem
            self.debt_left[name] = self.auto.release

    def adds_nothing(self, names: Sequence[str]) -> bool:
        """:meth:`release` would hand these gradients back unchanged this step (no debt, no guard sample)."""
        return (self.guard is None or self.guard.ratio is not None) and not any(n in self.debt for n in names)

    def release(self, name: str, g: torch.Tensor) -> torch.Tensor:
        """``g`` plus this step's share of ``name``'s debt (staged until ``commit``)."""
        if self.guard is not None and self.guard.ratio is None:
            self.guard.keep(name, g)  # the warm-up's local gradient, for the accuracy guard
        d = self.debt.get(name)
        if d is None:
            return g
        share = d / self.debt_left[name]
        self._released[name] = share
        return g + share.to(g.dtype).reshape(g.shape)

    def commit(self) -> None:
        for name, share in self._released.items():
            self.debt_left[name] -= 1
            if self.debt_left[name] <= 0:
                del self.debt[name], self.debt_left[name]
            else:
                self.debt[name] = self.debt[name] - share
        self._released = {}

    def discard(self) -> None:
        self._released = {}
        if self.guard is not None:
            self.guard.forget_step()  # a skipped (non-finite) step is not measured

    # ---- measuring -----------------------------------------------------------------------
    def _allreduce(self, values: torch.Tensor, name: str) -> torch.Tensor:
        """Mean over the ranks (one allreduce)."""
        return ranks_mean(self.pipe.exchange, values, name)

    def _probe_link(self) -> Dict[str, float]:
        N = self.pipe.size
        cal = calibration.from_env()
        given = calibration.flat_link(cal, N)
        if given is not None:  # HVD_EXT_CALIBRATION: the link python -m hvd_ext.plan --measure found
            wire = cost.allreduce_wire(4.0 * (_PROBE_LARGE - _PROBE_SMALL), N)
            world = calibration.node_layout(self.pipe.exchange.topology())
            return {"lat": given["lat"], "large": given["lat"] + wire / given["bandwidth"], "wire": wire,
                    "by_kind": calibration.collective_latencies(cal, N, *world)}

        dev = self.pipe.buckets[0].params[0].device if self.pipe.buckets else "cpu"  # the gradients' link
        small, large = torch.zeros(_PROBE_SMALL, device=dev), torch.zeros(_PROBE_LARGE, device=dev)
        self._allreduce(small, "hvd_ext.auto.sync")  # start together
        t_small = best_time(lambda: self._allreduce(small, "hvd_ext.auto.probe.small"), 5)
        t_large = best_time(lambda: self._allreduce(large, "hvd_ext.auto.probe.large"), 1)
        # More large tries only where one is cheap and noisy: the ranks' mean times (one small
        # allreduce, so every rank runs the same collectives) say whether the transfer dominates.
        # On a slow link a try is all bandwidth, and each costs a step or more.
        agreed = self._allreduce(torch.tensor([t_small, t_large]), "hvd_ext.auto.probe.agree")
        if float(agreed[1]) < _PROBE_ENOUGH * float(agreed[0]):
            t_large = min(t_large, best_time(lambda: self._allreduce(large, "hvd_ext.auto.probe.large"), 2))
        wire = cost.allreduce_wire(4.0 * (_PROBE_LARGE - _PROBE_SMALL), N)
        return {"lat": t_small, "large": t_large, "wire": wire}

    def _bucket_grads(self, b) -> List[torch.Tensor]:
        out = []
        for p in b.params:
            g = p.grad if p.grad is not None else torch.zeros_like(p)
            out.append(g.to_dense() if g.is_sparse else g)
        return out

    def _time_codec(self, c: Compressor, b, grads: List[torch.Tensor]) -> Dict[str, float]:
        """Seconds to compress and decode bucket ``b`` with ``c`` (the fastest of three tries: the first
        may pay one-time allocations, and the other ranks' work shares this machine's cores), and its
        payload bytes."""
        tries = [self._time_codec_once(c, b, grads) for _ in range(3)]
        return {"enc": min(t["enc"] for t in tries), "dec": min(t["dec"] for t in tries),
                "bytes": tries[-1]["bytes"]}

    def _time_codec_once(self, c: Compressor, b, grads: List[torch.Tensor]) -> Dict[str, float]:
        _, enc, dec, nbytes = self._code(c, b, [g if c.collective == "allreduce" else g.float() for g in grads])
        return {"enc": enc, "dec": dec, "bytes": nbytes}

    def _roundtrip(self, c: Compressor, b, us: List[torch.Tensor]) -> List[torch.Tensor]:
        """``us`` coded and decoded by ``c`` as this rank alone would once ``c`` compresses, past its own
        warm-up (the accuracy guard's shadow: a codec's error, not its dense start's)."""
        return self._code(c, b, us, max(self.pipe.step, c.own_warmup()))[0]

    def _code(self, c: Compressor, b, us: List[torch.Tensor], step: Optional[int] = None):
        """Code bucket ``b``'s tensors ``us`` with ``c`` as the pipeline would at ``step`` (default: its
        own), nothing sent and nothing staged kept: (decoded tensors, flat; encode s; decode s; payload
        bytes)."""
        pipe = self.pipe
        step = pipe.step if step is None else step
        infos = [TensorInfo(name=n, shape=u.shape, step=step, rank=pipe.rank, size=pipe.size,
                            param=p.detach(), scale=pipe.exchange.scale()) for n, p, u in zip(b.names, b.params, us)]
        sizes = [u.numel() for u in us]
        timer = Timer(us[0].device if us else "cpu")  # CUDA events on a GPU: the work, not its launches
        timer.mark()
        # as the pipeline codes it: a bucket_flat codec (topk scope=model, sig) one payload per bucket
        flat = flat_record(c, "allgather", [TensorRecord(i.name, None, i, u) for u, i in zip(us, infos)],
                           f"\x00trial{b.index}")
        if flat is not None:
            us, infos = [flat.u], [flat.info]
        c.prepare_bucket(list(zip(us, infos)))
        pays = [c.compress(u, info) for u, info in zip(us, infos)]
        timer.mark()
        nbytes, outs = 0, []
        for (payload, ctx), info in zip(pays, infos):
            nbytes += payload.numel() * payload.element_size()
            if c.collective == "allreduce":
                out = c.decompress(payload, ctx, info)
                if isinstance(out, Continue):  # multi-round: count the next round's payload too
                    nbytes += out.payload.numel() * out.payload.element_size()
                while isinstance(out, Continue):
                    out = c.decompress(out.payload, out.ctx, info)
            else:
                out = c.aggregate([payload], ctx, info)
            outs.append(out.reshape(-1))
        timer.mark()
        enc, dec = timer.seconds()
        c.discard()  # nothing staged by a trial compression may survive
        if flat is not None:
            outs = list(torch.split(outs[0], sizes))
        return outs, enc, dec, float(nbytes)

    # ---- deciding --------------------------------------------------------------------------
    def predict(self, c: Compressor, kind: str, shapes: List[tuple], payload: float, enc: float, dec: float,
                device_type: str) -> float:
        """Candidate ``c``'s exchange seconds on route ``kind`` for a bucket of ``shapes`` over
        :attr:`network`, priced as the planner prices it (:func:`hvd_ext.exchange.routes.route_cost`):
        its collectives one after another, the bytes on the busiest link, the codec passes and, where
        the calibration file timed this world, the route's host work beyond the passes."""
        net = self.network or self.probe_network()
        cal, extra = calibration.from_env(), 0.0
        if cal is not None:  # the file's world: its ranks, and its nodes where the job has them
            nodes, local = calibration.node_layout(self.pipe.exchange.topology())
            timed = calibration.codec_timing(cal, c.spec(), c.codec_spec(), c.name, ranks=self.pipe.size,
                                             nodes=nodes, local=local)
            extra = timed.overhead_seconds(kind, shapes, net.local) if timed is not None else 0.0
        return route_cost(c, kind, shapes, payload, enc, dec, net, device_type, self.pipe.step,
                          overhead=extra).seconds

    def probe_network(self) -> Network:
        """One flat link: the probe's (or the calibration's) latency and bandwidth, each collective's
        fixed cost the calibration's where it timed them, else the probe's allreduce latency."""
        first, then = self.link.get("by_kind") or ({k: self.link["lat"] for k in calibration.COLLECTIVES}, {})
        return Network.one_link(self.pipe.size, self.link["lat"], self.link["bw"], first, then)

    def node_network(self, device) -> Optional[Network]:
        """Across nodes, where a candidate's node-aware route can run
        (:func:`hvd_ext.exchange.routes.node_links`): the node links the exchange measured once (or
        the calibration's) with each collective's fixed cost, as the planner's cluster; else None."""
        pipe = self.pipe
        if all(node_aware_reason(c, pipe.exchange) is not None for c in self.auto.candidates):
            return None  # (hierarchy=flat, one node, an elastic job...: no node groups made)
        links = node_links(pipe.exchange, device)
        if links is None:
            return None
        if pipe.exchange.node_links_assumed:  # (HVD_EXT_NODE_LINKS=default, a transport not timed)
            # a flat ring allreduce across nodes is bound by the NIC: it moves what the probe measured
            links = dataclasses.replace(links, inter=dataclasses.replace(links.inter, bandwidth=self.link["bw"]))
        base, topo = self.probe_network(), pipe.exchange.topology()
        M, L = topo.cross_size, topo.local_size
        return Network(M, L, links.intra, links.inter, base.collective_lat, base.idle_lat,
                       calibration.node_latencies(calibration.from_env(), pipe.size, M, L), links.tree)

    def network_report(self) -> Dict[str, Any]:
        """What the last decision priced the routes on: nodes x ranks and each link's MB/s."""
        net = self.network
        if net is None:
            return {}
        out = {"nodes": net.nodes, "local": net.local, "MB_per_s": round(net.link().bandwidth / 1e6, 2)}
        if net.nodes > 1:
            out["intra_MB_per_s"] = round(net.intra.bandwidth / 1e6, 2)
        return out

    def evaluate(self, reason: str) -> None:
        """One decision: measure (link, codecs, compute: the ranks' mean) -> predict every candidate on
        every bucket -> choose (the most accurate within the slack, with hysteresis) -> agree (rank 0's
        choice for all; a trial when the model cannot separate the contenders)."""
        m = self._measure(reason)
        forecasts, table = self._predict(m)
        choice, routes, predicted = self._choose(forecasts, m.compute)
        self._agree(reason, m, forecasts, table, choice, routes, predicted)

    def _measure(self, reason: str) -> Measurement:
        """The link probe, every candidate's codec timings on every bucket, compute and exchange
        medians: this rank's, averaged over the ranks in one allreduce (the guard's verdict rides on it)."""
        pipe, cands = self.pipe, self.auto.candidates
        # A "calibrate" re-decision only learns the chosen codec's real cost: the link and the codec
        # timings measured at the decision before still hold (every rank takes the same branch:
        # same reason, same step).
        layout = [sum(p.numel() for p in b.params) for b in pipe.buckets]
        if reason != "calibrate" or self._probe is None:
            self._probe = self._probe_link()
        probe = self._probe
        if reason == "calibrate" and self._codec_rows is not None and self._codec_rows[0] == layout:
            rows = self._codec_rows[1]
        else:
            rows = []
            for b in pipe.buckets:
                grads = self._bucket_grads(b)
                for c in cands:
                    r = self._time_codec(c, b, grads)
                    rows += [r["enc"], r["dec"], r["bytes"]]
            self._codec_rows = (layout, rows)
            self.priced_at = pipe.step
        periods, meas = self._periods[-50:], self._measured[-50:]
        # Medians: a pause between two steps (evaluation, a checkpoint, other work in the loop) must not
        # read as compute, or every exchange would look cheap next to the step.
        compute = (median(periods) - median(meas)) if periods and meas else 0.0
        # median exchange time of the codecs chosen until now; none learnt at a candidate's warm-up end,
        # where what ran may have been that candidate still dense, against its price from now on
        ran = median(meas) if meas and reason != WARMED_UP else 0.0
        guard = self.guard is not None and self.guard.ratio is None
        qs = self.guard.local_ratios(len(pipe.buckets)) if guard else []
        local = torch.tensor([probe["lat"], probe["large"], max(compute, 0.0), ran] + rows + qs, dtype=torch.float64)
        mean = self._allreduce(local.float(), f"hvd_ext.auto.measure.{pipe.step}").double().tolist()
        if guard:
            self.guard.decide(mean[len(mean) - len(qs):], len(pipe.buckets))
        lat, large = mean[0], mean[1]
        self.link = {"lat": lat, "bw": probe["wire"] / max(large - lat, 1e-6), "by_kind": probe.get("by_kind")}
        n = len(cands)
        codec = [[tuple(mean[4 + 3 * (bi * n + ci): 7 + 3 * (bi * n + ci)]) for ci in range(n)]
                 for bi in range(len(pipe.buckets))]
        return Measurement(lat=lat, bw=self.link["bw"], compute=mean[2], ran=mean[3], codec=codec)

    def _predict(self, m: Measurement) -> Tuple[List[Forecast], List[Dict[str, float]]]:
        """Every candidate's predicted exchange time on every bucket, on the route the cost model would
        give it, calibrated by what chosen codecs measured; ineligible ones infinitely slow."""
        pipe, cands = self.pipe, self.auto.candidates
        forecasts, table = [], []
        dev = pipe.buckets[0].params[0].device if pipe.buckets else torch.device("cpu")
        self.network = self.node_network(dev) or self.probe_network()  # from the link just measured
        for b, row in zip(pipe.buckets, m.codec):
            numel = sum(p.numel() for p in b.params)
            times, kinds, per = [], [], {}
            for ci, (c, measured) in enumerate(zip(cands, row)):
                kind, t = self._route(c, b, *measured)
                kinds.append(kind)
                times.append(t)
                per[self.auto.candidate_specs[ci]] = round(t * 1e3, 4)
            forecasts.append(Forecast(numel=numel, times=times, routes=kinds))
            table.append(per)
        self._calibrate(m.ran, [f.times[self.choice[b.index]] for b, f in zip(pipe.buckets, forecasts)])
        factor = self.calibration()
        for i, f in enumerate(forecasts):
            f.times = [t * k if self.eligible(i, ci) else float("inf")
                       for ci, (t, k) in enumerate(zip(f.times, factor))]
            f.fastest = fastest_candidate(f.times, self.dense_index(self.auto))
        return forecasts, table

    def _route(self, c: Compressor, b, enc: float, dec: float, nbytes: float) -> Tuple[str, float]:
        """Candidate ``c``'s route on bucket ``b`` and its predicted seconds there: of the routes it may
        take (:func:`hvd_ext.exchange.routes.bucket_routes`: node-aware ones where they can run), the one
        :meth:`predict` finds fastest (the first listed on ties), as the planner's ``auto`` row takes it
        (:func:`hvd_ext.plan.auto_row`)."""
        pipe = self.pipe
        shapes, dev = [tuple(p.shape) for p in b.params], b.params[0].device
        node = self.network.nodes > 1 and node_aware_reason(c, pipe.exchange) is None
        times = {kind: self.predict(c, kind, shapes, nbytes, enc, dec, dev.type)
                 for kind in bucket_routes(c, pipe.size, node)}
        best = fastest_route(times)
        return best, times[best]

    def _choose(self, forecasts: List[Forecast], compute: float) -> Tuple[List[int], List[str], float]:
        """Per bucket the most accurate candidate within ``slack`` of the predicted step (candidates are
        listed most accurate first), kept from flipping by ``margin``; with the routes and the total."""
        total = sum(f.numel for f in forecasts) or 1
        step_time = compute + sum(f.times[f.fastest] for f in forecasts)
        choice, routes, predicted = [], [], 0.0
        for b, f in zip(self.pipe.buckets, forecasts):
            times, fastest = f.times, f.fastest
            allowance = self.auto.slack * step_time * f.numel / total
            best = most_accurate_within(times, fastest, allowance)
            cur = self.choice[b.index]
            if self.last_eval is not None and best != cur and times[cur] < float("inf"):
                # hysteresis: a less accurate codec must be `margin` faster than the current one; a more
                # accurate one must lie `margin` inside the slack
                if best > cur and times[best] > (1 - self.auto.margin) * times[cur]:
                    best = cur
                elif best < cur and times[best] > times[fastest] + (1 - self.auto.margin) * allowance:
                    best = cur
            choice.append(best)
            routes.append(f.routes[best])
            predicted += times[best]
        return choice, routes, predicted

    def _agree(self, reason: str, m: Measurement, forecasts: List[Forecast], table: List[Dict[str, float]],
               choice: List[int], routes: List[str], predicted: float) -> None:
        """Rank 0's decision for everyone (identical inputs already; this makes it certain), applied,
        or a trial of the contenders when the model cannot separate them (:meth:`_contenders`)."""
        pipe = self.pipe
        contenders = self._contenders(forecasts, choice) if self.auto.trial > 0 else []
        agreed, routes, contenders = pipe.exchange.broadcast_object([choice, routes, contenders], 0,
                                                                    f"hvd_ext.auto.choice.{pipe.step}")
        if len(contenders) > 1:
            # the predicted fastest first, so that the others can be cut early against it
            order = sorted(range(len(contenders)), key=lambda i: contenders[i].predicted)
            first = contenders[order[0]]
            agreed, routes, predicted = first.choice, first.routes, first.predicted
            reason += f"; trying {len(contenders)} contenders"
            self._trial = Trial(contenders=contenders, order=order, start=pipe.step,
                                window=max(1, self.auto.trial // _ROUNDS))
        changed = self._apply(agreed, routes)
        # A re-decision that changes nothing (measurement noise, ranks out of step): check less often.
        planned = reason.split(";")[0] in ("warmup", "scheduled", WARMED_UP)
        self._check_every = self.auto.check if changed or planned else min(2 * self._check_every, self.auto.every)
        self.predicted_s = predicted
        self.last_eval = pipe.step
        measured = sum(self._measured) / len(self._measured) if self._measured else None
        self._measured, self._periods = [], []
        self.decisions.append({"step": pipe.step, "reason": reason,
                               "choice": [self.auto.candidate_specs[ci] for ci in agreed],
                               "predicted_ms": round(predicted * 1e3, 3),
                               "measured_before_ms": None if measured is None else round(measured * 1e3, 3),
                               "link": {"latency_ms": round(m.lat * 1e3, 4), "MB_per_s": round(m.bw / 1e6, 2)},
                               "network": self.network_report(),
                               "compute_ms": round(m.compute * 1e3, 3),
                               "predicted_ms_per_candidate": table,
                               "calibration": self._calibration_report(),
                               "guard": self.guard_report()})
        del self.decisions[:-20]

    def eligible(self, bucket: int, candidate: int) -> bool:
        """May bucket ``bucket`` use candidate ``candidate`` (the accuracy guard's verdict)?"""
        return self.auto.allowed(candidate) and (self.guard is None or self.guard.eligible(bucket, candidate))

    def guard_report(self) -> Optional[Dict[str, Any]]:
        if self.guard is None or self.guard.ratio is None:
            return None
        return {"bound": self.guard.bound, "error_ratio": self.guard.report(self.auto.candidate_specs),
                "eligible": [[s for ci, s in enumerate(self.auto.candidate_specs) if self.eligible(bi, ci)]
                             for bi in range(len(self.guard.ratio))]}

    def _apply(self, agreed: List[int], routes: List[str]) -> bool:
        """Every bucket to its agreed candidate and route (the old codec's memory carried over)."""
        changed = False
        for b, ci, kind in zip(self.pipe.buckets, agreed, routes):
            if self.choice[b.index] != ci:
                self.switched(b)
                changed = True
            if self.choice[b.index] != ci or b.route.name != kind:
                self.pipe.set_bucket_compressor(b, self.auto.candidates[ci], kind)
        self.choice = list(agreed)
        return changed

    # ---- measuring the contenders the model cannot separate ------------------------------
    def _contenders(self, forecasts: List[Forecast], choice: List[int]) -> List[Contender]:
        """Configurations worth measuring: for each candidate c predicted within ``CONTEND`` x the
        fastest on some bucket, c on those buckets and the model's choice elsewhere; most accurate
        first. The model's errors on a busy machine reach 2-3x, so auto measures the step period of
        each contender (Horovod's autotuner, too, measures configurations rather than predicting them)."""
        out, seen = [], set()
        for c in range(len(self.auto.candidates)):
            cfg = [c if f.times[c] <= CONTEND * f.times[f.fastest] else None for f in forecasts]
            if all(x is None for x in cfg):
                continue
            fill = [x if x is not None else model for x, model in zip(cfg, choice)]
            if tuple(fill) in seen:
                continue
            seen.add(tuple(fill))
            out.append(Contender(label=self.auto.candidate_specs[c], choice=fill,
                                 routes=[f.routes[ci] for ci, f in zip(fill, forecasts)],
                                 predicted=sum(f.times[ci] for ci, f in zip(fill, forecasts))))
        return out if len(out) > 1 else []

    def _trial_window_done(self, early: bool = False) -> None:
        """One contender's window is over: its step periods and exchange times are kept (after the
        ``SETTLE`` periods of the switch), then the next contender runs. The contenders take turns in
        ``_ROUNDS`` (2) rounds of ``trial / 2`` exchanges, the second round in reverse order (ABC CBA:
        a machine's speed drifts between blocks of steps, and interleaving spreads a drift over every
        contender). After the last
        window each contender's median period over both rounds (the ranks' mean, one allreduce) gives
        the choice: the most accurate within ``slack`` of the shortest, its candidates calibrated.

        ``early`` (first round only): a contender after a quarter of its ``trial`` (at least 3
        exchanges past the settle periods) whose median period is over ``_CUT`` x (1 + slack) x the
        shortest first-round window cannot be chosen, and stops (successive halving's rule, Jamieson
        and Talwalkar 2016)."""
        t, pipe = self._trial, self.pipe
        order = t.round_order()
        ci = order[t.i]
        periods = self._periods[SETTLE:] or self._periods
        meas = self._measured[SETTLE:] or self._measured
        if t.round == 0:  # the ranks' mean of this window, for the early cut
            got = self._allreduce(torch.tensor([median(periods) if periods else 0.0, median(meas) if meas else 0.0]),
                                  f"hvd_ext.auto.trial.{pipe.step}")
            if early:
                if float(got[0]) <= _CUT * (1 + self.auto.slack) * min(t.first.values()):
                    return  # a contender still: it runs its whole window
                t.cut.append(ci)
                self._learn_from_trial(float(got[1]), t.contenders[ci])
            t.first[ci] = float(got[0])
        t.periods.setdefault(ci, []).extend(periods)
        t.exchange_s.setdefault(ci, []).extend(meas)
        self._measured, self._periods = [], []
        t.i += 1
        if t.i >= len(order) and t.round + 1 < _ROUNDS and len(t.order) - len(t.cut) > 1:
            t.round, t.i = t.round + 1, 0
            order = t.round_order()
        if t.i < len(order):
            nxt = t.contenders[order[t.i]]
            self._apply(nxt.choice, nxt.routes)  # (the last of a round opens the next: no change)
            t.start = pipe.step
            return
        self._trial_decide()

    def _trial_decide(self) -> None:
        """Every window has run: the choice from the contenders' medians over both rounds."""
        t, pipe = self._trial, self.pipe
        alive = [ci for ci in t.order if ci not in t.cut]
        mine = []
        for ci in alive:
            mine += [median(t.periods[ci]) if t.periods[ci] else 0.0,
                     median(t.exchange_s[ci]) if t.exchange_s[ci] else 0.0]
        got = self._allreduce(torch.tensor(mine), f"hvd_ext.auto.trial.decide.{pipe.step}")
        period = {ci: float(got[2 * k]) for k, ci in enumerate(alive)}
        exchange = {ci: float(got[2 * k + 1]) for k, ci in enumerate(alive)}
        for ci in alive:
            self._learn_from_trial(exchange[ci], t.contenders[ci])
        shortest = min(period.values())
        pick = next(ci for ci in range(len(t.contenders)) if ci in period and period[ci] <= (1 + self.auto.slack) * shortest)
        cfg = t.contenders[pick]
        self._trial = None
        self._apply(cfg.choice, cfg.routes)
        self.predicted_s = exchange[pick]  # the drift check's reference: what this choice measured
        self.last_eval = pipe.step
        self._check_every = self.auto.check
        measured = {t.contenders[ci].label: round(period.get(ci, t.first.get(ci, 0.0)) * 1e3, 3) for ci in t.order}
        self.decisions.append({"step": pipe.step, "reason": "trial",
                               "choice": [self.auto.candidate_specs[c] for c in self.choice],
                               "predicted_ms": round(self.predicted_s * 1e3, 3),
                               "link": self.decisions[-1].get("link") if self.decisions else None,
                               "measured_period_ms": measured,
                               "cut_early": [t.contenders[ci].label for ci in t.cut],
                               "calibration": self._calibration_report(), "guard": self.guard_report()})
        del self.decisions[:-20]

    def _calibration_report(self) -> Dict[str, float]:
        return {self.auto.candidate_specs[ci]: round(r, 3) for ci, r in sorted(self.calib.items())}

    def _calibrate(self, measured: float, predicted: List[float], ran: Optional[List[int]] = None) -> None:
        """Learn how far the model's prediction is from this machine: the codecs that ran since the last
        decision (the dense warm-up's ``none`` at first) took ``measured`` seconds per exchange (the
        ranks' mean) against ``predicted`` (per bucket, this decision's model); that ratio, clamped to
        [0.5, 10] (the model leaves costs out, it rarely counts too many: a much faster exchange means a
        disturbed probe) and smoothed geometrically, multiplies their predictions from now on. Untried
        candidates take the smallest ratio seen until they run (``calibration``). Measured on the main
        job (2 ranks, 100 Mbit/s - 1 Gbit/s): exchanges took 2.5-4x the uncalibrated prediction."""
        pred = sum(predicted)
        if measured <= 0 or pred <= 0:
            return
        r = min(max(measured / pred, 0.5), 10.0)
        for ci in set(self.choice if ran is None else ran):
            old = self.calib.get(ci)
            self.calib[ci] = r if old is None else (old * r) ** 0.5

    def calibration(self) -> List[float]:
        """The factor on each candidate's predicted time: its own measured ratio once it has run, else
        the smallest ratio measured so far. What the model misses on this machine (Python, the
        collectives' software, CPU contention) is partly common to all candidates; taking the
        smallest keeps an untried candidate worth trying, so a codec whose real cost the model
        underestimates is replaced once it has run."""
        prior = min(self.calib.values()) if self.calib else 1.0
        return [self.calib.get(ci, prior) for ci in range(len(self.auto.candidates))]

    def _check_drift(self) -> None:
        mine = median(self._measured)  # as the trials measure: one slow exchange (a pause) is not drift
        got = float(self._allreduce(torch.tensor([mine]), f"hvd_ext.auto.check.{self.pipe.step}")[0])
        pred = max(self.predicted_s or 0.0, 1e-3)
        if got > 2.0 * pred + 1e-3 or got < 0.5 * pred - 1e-3:
            # Two checks in a row: a burst of load on a shared machine (another job, a test) must not
            # start a re-decision -- and a trial -- by itself (seen: three trials in 450 steps).
            self._strikes += 1
            if self._strikes >= 2:
                self._strikes = 0
                self.evaluate(f"measured {got * 1e3:.2f} ms vs predicted {pred * 1e3:.2f} ms")
                return
        else:
            self._strikes = 0
        if self.decisions:   # none on a rank that resumed (the decisions' log is not kept)
            self.decisions[-1]["measured_ms"] = round(got * 1e3, 3)
        self._measured = []

    def report(self) -> Dict[str, Any]:
        last = self.decisions[-1] if self.decisions else None
        return {"choice": [self.auto.candidate_specs[ci] for ci in self.choice],
                "decisions": len(self.decisions), "last": last,
                "history": [{k: d[k] for k in ("step", "reason", "choice", "predicted_ms", "predicted_ms_per_candidate",
                                               "measured_period_ms", "cut_early", "calibration", "guard")
                                     if k in d}
                            for d in self.decisions]}

    def state_dict(self) -> Dict[str, Any]:
        return {"choice": list(self.choice), "routes": [b.route.name for b in self.pipe.buckets],
                "size": self.pipe.size, "last_eval": self.last_eval, "priced_at": self.priced_at,
                "calib": dict(self.calib),
                "predicted_s": self.predicted_s,
                "debt": {k: v.clone() for k, v in self.debt.items()}, "debt_left": dict(self.debt_left),
                "guard": None if self.guard is None else self.guard.ratio}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        ch = list((state or {}).get("choice", []))
        if len(ch) == len(self.pipe.buckets) and all(0 <= c < len(self.auto.candidates) for c in ch):
            kinds = list(state.get("routes") or [None] * len(ch))
            if len(kinds) != len(ch) or self.pipe.size != int(state.get("size", self.pipe.size)):
                kinds = [None] * len(ch)
            for b, ci, kind in zip(self.pipe.buckets, ch, kinds):
                if self.choice[b.index] != ci or (kind is not None and b.route.name != kind):
                    self.pipe.set_bucket_compressor(b, self.auto.candidates[ci], kind)
            self.choice = ch
            self.last_eval = state.get("last_eval")
            self.priced_at = state.get("priced_at", self.last_eval)
            self.predicted_s = state.get("predicted_s")   # what the drift checks compare with
            self.calib = {int(k): float(v) for k, v in (state.get("calib") or {}).items()}
            ratio = state.get("guard")
            if self.guard is not None and ratio is not None and len(ratio) == len(self.pipe.buckets):
                self.guard.decide([q for row in ratio for q in row], len(ratio))
        self.debt = {k: v.clone() for k, v in (state or {}).get("debt", {}).items()}
        self.debt_left = dict((state or {}).get("debt_left", {}))
        self._released = {}

    def shared_state_dict(self) -> Dict[str, Any]:
        """The decisions without the debt (a replaced codec's memory: this rank's own, like a residual)."""
        return {k: v for k, v in self.state_dict().items() if k not in ("debt", "debt_left")}

    def load_shared_state_dict(self, state: Dict[str, Any]) -> None:
        self.load_state_dict({**(state or {}), "debt": self.debt, "debt_left": self.debt_left})


