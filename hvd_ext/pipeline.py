"""The gradient pipeline of one step, bucket by bucket.

    Feedback.compensate -> Route.start (Compressor.compress, first collective)
    -> Route.progress (second phase of two-phase routes) -> Route.finish (decode, average)
    -> Feedback.adjust / update -> p.grad

Buckets are fixed at construction from the parameter list alone (reverse
registration order, roughly the order backward produces gradients, filled up
to ``bucket_bytes`` dense bytes -- the first up to 1 MiB -- as PyTorch DDP
does), and so is each
bucket's route (:mod:`hvd_ext.exchange.routes`: allreduce, allgather,
two-phase, sparse reduce-scatter, chosen from the compressor, the
``exchange=`` mode, N and the cost model). Every rank therefore builds the
same buckets and names the same collectives. A bucket's first collective
starts as soon as its last gradient is ready -- during backward -- and the
rest start at ``flush()``. With ``overlap`` (:mod:`hvd_ext.overlap`) the hook
hands the bucket to a worker thread that compresses and starts it while
backward goes on; ``finish`` waits for the worker first.

On a GPU (``docs/gpu.md``) nothing here reads the device inside a hook: the non-finite test
and every check stay on the device, and ``finish`` reads them once for the whole step
(``ops.device.read_step``; :func:`finish_together`: once for several pipelines, a DDP model's). A bucket whose codec or route must read a size from the device
to start (a data-dependent payload) is started by ``flush()`` after backward -- or by the
overlap worker, which may wait without holding backward up.
"""
from __future__ import annotations

import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import torch

from .compression.base import Compressor, TensorInfo
from .compression.none import NoneCompressor
from .exchange import Exchange
from .auto import AutoCompression, AutoTuner
from .exchange.routes import (OwnerMemory, Route, TensorRecord, fastest_option, flat_record, make_route,
                              route_options, split_flat)
from .feedback.base import Feedback, NoFeedback
from .ops.device import Checks, deferred_checks, nonfinite as nonfinite_flag, on_host, read_step
from .overlap import CodeWorker
from .policy import DenseWarmup, Policy
from .route_trial import RouteTrial


@dataclass
class _Bucket:
    index: int
    names: List[str]
    params: List[torch.Tensor]
    route: Route
    comp: Compressor
    ready: set = field(default_factory=set)
    started: bool = False
    deferred: bool = False  # complete, but left for flush(): starting it would read the device in a hook
    parts: Optional[List[TensorRecord]] = None  # the per-tensor records when the bucket went as one


# Like PyTorch DDP's first bucket: the gradients backward produces first (the last layers) travel
# in a small bucket (about this size), so their exchange overlaps the rest of backward even when
# the whole model would fit in one ``bucket_bytes`` bucket.
FIRST_BUCKET_BYTES = 1024 * 1024


def plan_buckets(named_params: List[Tuple[str, torch.Tensor]], bucket_bytes: int,
                 first_bucket_bytes: Optional[int] = None) -> List[List[int]]:
    """Greedy buckets over ``named_params`` in reverse order, each up to ``bucket_bytes`` dense bytes;
    the first one closes as soon as it holds ``first_bucket_bytes`` (when given), so the tensor that
    crosses that size goes in it, as in DDP's bucket assignment (closed before the crossing tensor,
    the first bucket of a small model can be tiny, and then nothing of the exchange overlaps
    backward)."""
    buckets: List[List[int]] = []
    cur: List[int] = []
    cur_bytes = 0
    for i in reversed(range(len(named_params))):
        p = named_params[i][1]
        nb = p.numel() * p.element_size()
        full = cur_bytes + nb > bucket_bytes
        if not buckets and first_bucket_bytes is not None:
            full = full or cur_bytes >= first_bucket_bytes  # the first one closes once it holds that much
        if cur and full:
            buckets.append(cur)
            cur, cur_bytes = [], 0
        cur.append(i)
        cur_bytes += nb
    if cur:
        buckets.append(cur)
    return buckets


class GradientPipeline:
    def __init__(self, named_params: List[Tuple[str, torch.Tensor]], compressor: Compressor,
                 feedback: Optional[Feedback], exchange: Exchange, bucket_bytes: int, route: Optional[str] = None,
                 warmup: int = 0, overlap: bool = False):
        self.compressor = compressor
        self.feedback = feedback if feedback is not None else NoFeedback()
        self.exchange = exchange
        self.step = 0  # exchanges completed; identical on every rank
        self.compress_s = 0.0
        self.owner_memory = OwnerMemory()
        self._route_mode = route
        self.rank = exchange.rank
        self.size = exchange.size
        self.buckets: List[_Bucket] = []
        self.bucket_of: Dict[int, _Bucket] = {}
        self._priced: Dict[tuple, Dict[str, Any]] = {}  # route_options per codec and bucket layout
        # compression="auto": every bucket starts dense; an AutoTuner re-chooses its codec (hvd_ext.auto).
        is_auto = isinstance(compressor, AutoCompression)
        if is_auto and exchange.op_name == "adasum":
            raise ValueError("compression='auto' needs op=Average or Sum (Adasum is not linear across codecs); "
                             "pick a fixed compression with Adasum")
        # The policies (hvd_ext.policy) decide, between steps, each bucket's codec and route.
        self.warmup = int(warmup)  # dense warm-up exchanges (compression.common; auto runs its own)
        self.warmup_policy = DenseWarmup(self, self.warmup) if self.warmup > 0 and not is_auto else None
        first = compressor.candidates[AutoTuner.dense_index(compressor)] if is_auto else compressor
        if self.warmup_policy is not None:  # step 0: inside the warm-up
            first = self.warmup_policy.codec
        for bi, idxs in enumerate(plan_buckets(named_params, bucket_bytes, min(bucket_bytes, FIRST_BUCKET_BYTES))):
            params = [named_params[i][1] for i in idxs]
            b = _Bucket(bi, [named_params[i][0] for i in idxs], params, None, first)
            b.route = self._make_route(b, first)
            self.buckets.append(b)
            for p in b.params:
                self.bucket_of[id(p)] = b
        self.auto: Optional[AutoTuner] = AutoTuner(compressor, self) if is_auto else None
        # hierarchy=auto on a multi-node job: flat against node-aware, measured (hvd_ext.route_trial)
        self.route_trial: Optional[RouteTrial] = RouteTrial.plan(self)
        self.policies: List[Policy] = [p for p in (self.warmup_policy, self.auto, self.route_trial) if p is not None]
        # the routes as built, before any step or state moves them: what the ranks' configuration check
        # compares (a rank joining an elastic job is at step 0; the others' routes follow their decisions)
        self.configured_routes: List[str] = self.routes
        self._step_code_s = 0.0
        self._checks = Checks()  # device-side checks of the step in progress (read by finish)
        self._flat = None  # this step's exchange of a caller's flat buffer (start_flat)
        self.overlap = bool(overlap)
        self._worker: Optional[CodeWorker] = CodeWorker() if self.overlap else None
        if self._worker is not None:  # the thread ends with the pipeline (close() ends it sooner)
            weakref.finalize(self, self._worker.close)

    def set_step(self, step: int) -> None:
        """Take the step counter of another rank (the resume recipe, a joining elastic worker): the
        buckets' codec follows it (dense warm-up or not), so every rank makes the same collectives."""
        self.step = int(step)
        if self.warmup_policy is not None:
            self.follow_step()

    def route_mode(self, comp: Compressor) -> str:
        """The route mode for a bucket under ``comp``: the one every bucket is held to (a test
        harness's), else the codec's ``route=``."""
        return self._route_mode if self._route_mode is not None else comp.route

    def follow_step(self) -> None:
        """Every bucket takes the codec the dense warm-up calls for at this step (the codec once past it)."""
        want = self.warmup_policy.codec_now(self.compressor)
        for b in self.buckets:
            if b.comp is not want:
                self.set_bucket_compressor(b, want)
        if self.route_trial is not None and self.route_trial.done and want is self.compressor:
            self.route_trial.apply(self.route_trial.choice)  # the measured routes again

    def route_options(self, b: _Bucket, comp: Compressor) -> Dict[str, Any]:
        """Bucket ``b``'s routes under codec ``comp``, priced (:func:`hvd_ext.exchange.routes.route_options`;
        same inputs on every rank, same answer), once per codec and bucket layout: a model's repeated
        layers share the price."""
        shapes = tuple(tuple(p.shape) for p in b.params)
        key = (comp, self.route_mode(comp), shapes, str(b.params[0].device), self.size)
        if key not in self._priced:
            self._priced[key] = route_options(comp, self.route_mode(comp), list(shapes), self.size,
                                              exchange=self.exchange, device=b.params[0].device)
        return self._priced[key]

    def _make_route(self, b: _Bucket, comp: Compressor) -> Route:
        """The route of bucket ``b`` under codec ``comp``: the fastest of :meth:`route_options`."""
        return make_route(fastest_option(self.route_options(b, comp)), comp, self.exchange, f"b{b.index}",
                          self.owner_memory)

    def set_bucket_compressor(self, b: _Bucket, comp: Compressor, kind: Optional[str] = None) -> None:
        """Switch bucket ``b`` to codec ``comp`` between steps (``compression="auto"``); what the old
        codec left in the error-feedback memory is carried over (see ``AutoTuner.release``).
        ``kind``: the route, when the caller chose it (auto, from the measured link); else the
        cost model's default choice."""
        if b.started or b.ready:
            raise RuntimeError("hvd_ext: a bucket's codec can change only between steps")
        b.comp = comp
        b.route = (self._make_route(b, comp) if kind is None
                   else make_route(kind, comp, self.exchange, f"b{b.index}", self.owner_memory))

    def _local_flag(self, comp: Compressor) -> bool:
        # The non-finite test of the allreduce route reads the reduced buffer (a NaN/Inf on any rank
        # makes the sum non-finite), so only the other routes need a local test.
        return comp.collective != "allreduce" or self.exchange.op_name == "adasum"

    @property
    def routes(self) -> List[str]:
        """The route of each bucket (the same on every rank)."""
        return [b.route.name for b in self.buckets]

    @property
    def in_flight(self) -> bool:
        return any(b.started or b.ready for b in self.buckets)

    # ---- called from the backward hooks --------------------------------------------------
    def mark_ready(self, p: torch.Tensor) -> None:
        b = self.bucket_of[id(p)]
        if b.started:
            raise AssertionError("hvd_ext: gradient computed again after its bucket was sent; "
                                 "call step()/synchronize() between backward passes or raise "
                                 "backward_passes_per_step")
        b.ready.add(id(p))
        if len(b.ready) == len(b.params):
            self._launch(b, in_hook=True)

    def flush(self) -> None:
        """Start every bucket not started yet (parameters without gradients send zeros)."""
        for b in self.buckets:
            if not b.started:
                self._launch(b)

    def _reads_to_start(self, b: _Bucket) -> bool:
        """Starting ``b`` reads from the device (a GPU bucket whose codec or route needs a size)."""
        return not on_host(b.params[0]) and (b.comp.reads_device or b.route.reads_on_start)

    # ---- launch and finish -------------------------------------------------------------------
    def _launch(self, b: _Bucket, in_hook: bool = False) -> None:
        """Compress bucket ``b`` and start its first collective: here, on the worker thread, or -- when
        that would read the device inside a backward hook -- at ``flush()``."""
        if in_hook and self._worker is None and self._reads_to_start(b):
            b.deferred = True
            return
        b.started = True
        b.deferred = False
        if self._worker is None:
            self._start(b)
            return
        dev = b.params[0].device
        if dev.type == "cuda":  # the worker issues its kernels on the stream that produced the gradients
            stream = torch.cuda.current_stream(dev)

            def job():
                with torch.cuda.stream(stream):
                    self._start(b)
            self._worker.submit(job)
        else:
            self._worker.submit(lambda: self._start(b))

    def _start(self, b: _Bucket) -> None:
        with deferred_checks(self._checks):
            self._start_checked(b)

    def _start_checked(self, b: _Bucket) -> None:
        t0 = time.perf_counter()
        comp, fb = b.comp, self.feedback
        scale = self.exchange.scale()
        dense_codec = comp.collective == "allreduce"
        local_flag = self._local_flag(comp)
        records, flags = [], []
        for name, p in zip(b.names, b.params):
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            g = p.grad
            if g.is_sparse:
                g = g.to_dense()
            info = TensorInfo(name=name, shape=g.shape, step=self.step, rank=self.rank, size=self.size,
                              param=p.detach(), scale=scale)
            if self.auto is not None:
                g = self.auto.release(name, g)  # a share of what an earlier codec left (see AutoTuner)
            u = g if self._in_warmup(comp) else fb.compensate(name, g if dense_codec else g.float(), info)
            if local_flag:
                flags.append(u)
            records.append(TensorRecord(name, p, info, u))
        nonfinite = nonfinite_flag(flags, b.params[0].device)
        flat = flat_record(comp, b.route.name, records, f"\x00bucket{b.index}")  # one payload per bucket?
        b.parts = records if flat is not None else None
        if flat is not None:
            records = [flat]
        b.route.start(records, nonfinite)
        dt = time.perf_counter() - t0
        self.compress_s += dt
        self._step_code_s += dt

    # ---- the bucket as the caller's one flat buffer (a DDP bucket) ---------------------------
    def takes_flat(self, buf: torch.Tensor) -> bool:
        """A caller holding every gradient in the one float32/float64 ``buf`` (a DDP bucket's buffer, of
        which the pipeline's parameters' gradients are views) may hand the step over as that buffer
        (:meth:`start_flat`) instead of tensor by tensor: when the pipeline has one bucket whose codec
        this step is ``elementwise`` (none, fp16, bf16: fixed, a dense warm-up's, or ``auto``'s choice)
        on the allreduce route and keeps no error feedback for it. The result is the same, element for
        element."""
        if len(self.buckets) != 1 or self._worker is not None or buf.dtype not in (torch.float32, torch.float64):
            return False
        b = self.buckets[0]
        if not b.comp.elementwise or b.route.name != "allreduce" or self.exchange.op_name == "adasum":
            return False
        return (isinstance(self.feedback, NoFeedback) or self._in_warmup(b.comp)
                or (self.auto is not None and not self.compressor.uses_memory(b.comp)))

    def start_flat(self, buf: torch.Tensor) -> None:
        """Start the step's exchange on ``buf`` (only when :meth:`takes_flat` says so): ``none`` reduces
        it where it lies, as DDP's own allreduce hook does; a cast codec sends it as one tensor.
        ``auto``'s share of an earlier codec's memory is added into the gradients (views of ``buf``)
        first. :meth:`finish` writes the average back into ``buf``."""
        t0 = time.perf_counter()
        b = self.buckets[0]
        b.started = True
        if self.auto is not None and not self.auto.adds_nothing(b.names):
            for name, p in zip(b.names, b.params):
                if p.grad is not None:
                    g = self.auto.release(name, p.grad)  # g + this step's share (and the guard's sample)
                    if g is not p.grad:
                        p.grad.copy_(g)
        flat, name = buf.reshape(-1), f"hvd_ext.ar.{b.route.tag}"
        if isinstance(b.comp, NoneCompressor):
            self._flat = (self.exchange.start_reduce_in_place(name, flat), flat, None, None)
        else:
            info = TensorInfo(name=f"\x00flat{b.index}", shape=flat.shape, step=self.step, rank=self.rank,
                              size=self.size, param=None, scale=self.exchange.scale())
            payload, ctx = b.comp.compress(flat, info)
            pending = self.exchange.start_allreduce(name, [payload], False, reuse=b.comp.transient_results)
            self._flat = (pending, flat, ctx, info)
        self._step_code_s += time.perf_counter() - t0

    def finish(self) -> bool:
        """Wait for every bucket, write the averaged gradients into ``p.grad``.

        Returns True when some rank had a non-finite gradient (same answer on
        every rank); the feedback and owner memories are then left as they were. The step's
        flags and device-side checks are read here, once."""
        return finish_together([self])

    def _progress(self) -> None:
        """Start every bucket, then each bucket's next phase (``Route.progress``: a two-phase route's
        second collective, PowerSGD's second round), in bucket order, before any bucket is finished;
        a route waits here only for the phase its next one needs. Repeating it does nothing."""
        with deferred_checks(self._checks):
            if self._flat is not None:
                return
            self.flush()
            if self._worker is not None:
                try:
                    self._worker.drain()  # every bucket compressed and started
                except BaseException:  # a codec's error, raised here as it would have been in backward
                    self.reset()
                    raise
            for b in self.buckets:
                b.route.progress()

    def _unread_flags(self) -> List[torch.Tensor]:
        """Wait for every bucket and write the averages (after :meth:`_progress`, which
        :func:`finish_together` runs on every pipeline first); the step's non-finite flags, unread
        (device values), its device-side checks left in ``self._checks``."""
        with deferred_checks(self._checks):
            if self._flat is not None:
                return [self._finish_flat()]
            return [self._finish_bucket(b) for b in self.buckets]

    def _finish_flat(self) -> torch.Tensor:
        (pending, flat, ctx, info), self._flat = self._flat, None
        b = self.buckets[0]
        if info is None:
            flag = self.exchange.finish_reduce_in_place(pending)
        else:
            reduced, flag = self.exchange.finish_allreduce(pending)
            flat.copy_(b.comp.decompress(reduced[0], ctx, info))
        if not isinstance(self.feedback, NoFeedback):  # auto on a lossless codec: no memory kept
            for name in b.names:
                self.feedback.forget(name)
        b.started = False
        b.ready.clear()
        return flag

    def _end_step(self, nonfinite: bool, wait_s: float) -> None:
        """The step's staged state kept or dropped (on every rank alike), the step counted, the
        policies told (its exchange took ``wait_s`` in finishing plus what starting it took)."""
        for part in self._participants():  # staged state: kept on a finite step, dropped on every rank else
            if nonfinite:
                part.discard()
            else:
                part.commit()
        self.step += 1
        exchange_s = wait_s + self._step_code_s
        for policy in self.policies:
            policy.after_step(exchange_s)
        self._step_code_s = 0.0

    def _finish_bucket(self, b: _Bucket):
        """Wait for bucket ``b``, let the feedback see what was sent, write the averages into the
        gradients. Returns the route's non-finite flag (a device value, read once per step)."""
        code0 = b.route.code_s
        results, supports, nf = b.route.finish()
        t0 = time.perf_counter()
        fb = self.feedback
        use_fb = not isinstance(fb, NoFeedback)
        # auto choosing a codec that runs without error feedback when fixed (none, fp16, bf16: lossless;
        # qsgd: unbiased) runs it as fixed: memory cleared, no per-step residual to keep.
        lossless = use_fb and self.auto is not None and not self.compressor.uses_memory(b.comp)
        warm = self._in_warmup(b.comp)
        records, sents = b.route.records, None
        if b.parts is not None:  # one flat record: split the result back into the bucket's tensors
            records = b.parts
            results = split_flat(results[0], records)
            supports = split_flat(supports[0], records) if supports[0] is not None else [None] * len(records)
            if use_fb and not (warm or lossless):  # a bucket_flat codec's contribution ignores the result
                sents = split_flat(b.route.sent(0, None), records)
        for i, (rec, res, sup) in enumerate(zip(records, results, supports)):
            if warm:
                pass
            elif lossless:
                fb.forget(rec.name)
            elif use_fb:
                res = fb.adjust(rec.name, res, rec.info, sup)
                sent = b.route.sent(i, res) if sents is None else sents[i]
                fb.update(rec.name, rec.u, sent.reshape(rec.u.shape), rec.info)
            _write_grad(rec.param, res)
        self.compress_s += time.perf_counter() - t0 + (b.route.code_s - code0)
        b.started = False
        b.ready.clear()
        b.route.records = []
        b.parts = None
        return nf

    def _participants(self) -> list:
        """What keeps staged per-step state: committed on a finite step, discarded otherwise."""
        return [self.feedback, self.compressor, self.owner_memory] + self.policies

    def _in_warmup(self, comp: Compressor) -> bool:
        return self.warmup_policy is not None and comp is self.warmup_policy.codec

    def _drop_step(self) -> None:
        """A check failed (a corrupt payload, ranks that disagree): nothing of this step is kept."""
        for part in self._participants():
            part.discard()

    def reset(self) -> None:
        """Forget a step in progress (``load_state_dict``)."""
        if self._worker is not None:
            try:
                self._worker.drain()
            except Exception:  # the step is dropped anyway
                pass
        for b in self.buckets:
            b.started = False
            b.deferred = False
            b.ready.clear()
            b.route.records = []
            b.parts = None
        self._checks.take()
        self._flat = None
        self._step_code_s = 0.0

    def close(self) -> None:
        """Stop the worker thread (the optimizer replaced this pipeline)."""
        if self._worker is not None:
            self.reset()
            self._worker.close()

    # ---- checkpoint --------------------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        return {**self._state(shared=False), "spec": self.compressor.spec()}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self._load_state(state, shared=False)

    def shared_state_dict(self) -> Dict[str, Any]:
        """What a rank resuming behind the others takes from the most advanced one: everything every
        rank must hold alike (step, codec state, the policies' decisions, sparse reduce-scatter's owner
        ranges, the feedback's shared entries); never an error memory, which is each rank's own."""
        return self._state(shared=True)

    def load_shared_state_dict(self, state: Dict[str, Any]) -> None:
        self._load_state(state, shared=True)

    def _state(self, shared: bool) -> Dict[str, Any]:
        """The checkpoint (``shared``: only what every rank holds alike) of the step, the codec, the
        feedback, the owner memories and every policy with a key."""
        part = (lambda x: x.shared_state_dict()) if shared else (lambda x: x.state_dict())
        return {"step": self.step, "compressor": self.compressor.state_dict(), "routes": self.routes,
                "feedback": part(self.feedback), "owner": part(self.owner_memory),
                **{p.key: part(p) for p in self.policies if p.key}}

    def _load_state(self, state: Dict[str, Any], shared: bool) -> None:
        self.set_step(int(state.get("step", 0)))
        self.compressor.load_state_dict(state.get("compressor", {}))
        load = (lambda x, sd: x.load_shared_state_dict(sd)) if shared else (lambda x, sd: x.load_state_dict(sd))
        load(self.feedback, state.get("feedback", {}))
        for p in self.policies:
            if p.key:
                load(p, state.get(p.key) or {})
        # Owner memories belong to this world's layout; a checkpoint from another layout drops them.
        if list(state.get("routes", self.routes)) == self.routes:
            load(self.owner_memory, state.get("owner", {}))
        elif not shared:
            self.owner_memory.load_state_dict({})


def finish_together(pipes: List[GradientPipeline]) -> bool:
    """Finish the step of ``pipes`` (one, or a DDP model's one per DDP bucket) in order, every
    pipeline's next phases started before any is finished (``GradientPipeline._progress``), with ONE
    read of all their flags and device-side checks (``ops.device.read_step``). Returns True when some
    rank had a non-finite gradient in any of them: then every pipeline drops its staged state
    (feedback, codec, policies), on every rank alike, as the whole step is skipped."""
    flags: List[torch.Tensor] = []
    own = [0.0] * len(pipes)  # each pipeline's own finishing time
    try:
        for i, pipe in enumerate(pipes):
            t0 = time.perf_counter()
            pipe._progress()
            own[i] += time.perf_counter() - t0
        for i, pipe in enumerate(pipes):
            t0 = time.perf_counter()
            flags += pipe._unread_flags()
            own[i] += time.perf_counter() - t0
        t0 = time.perf_counter()
        checks = Checks()
        for pipe in pipes:
            for item in pipe._checks.take():
                checks.add(*item)
        nonfinite = read_step(flags, checks)  # the step's one read
        read_s = time.perf_counter() - t0
    except BaseException:  # every pipeline forgets the step: none finishes the next with this one's buckets
        for pipe in pipes:
            pipe._drop_step()
            pipe.reset()
        raise
    for pipe, s in zip(pipes, own):
        pipe._end_step(nonfinite, s + read_s)
    return nonfinite


def _write_grad(p: torch.Tensor, res: torch.Tensor) -> None:
    """The averaged gradient into ``p.grad``, in place; a sparse gradient (``sparse_as_dense``) is
    handed back sparse, as Horovod does (``SparseAdam`` needs it)."""
    g = p.grad
    res = res.reshape(g.shape)
    if g.is_sparse:
        p.grad = res.to(g.dtype, copy=True).to_sparse(g.sparse_dim())
    else:
        g.copy_(res)
