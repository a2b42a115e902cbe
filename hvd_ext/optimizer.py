"""``hvd_ext.DistributedOptimizer``: ``hvd.DistributedOptimizer`` with a compressed exchange.

Same signature and behaviour as Horovod's (``horovod/torch/optimizer.py``):
per-parameter hooks start communication while backward is still running,
``synchronize()``, ``skip_synchronize()``, ``backward_passes_per_step``
accumulation, any torch optimizer. The returned object is an instance of the
wrapped optimizer's class (``isinstance(opt, torch.optim.SGD)`` holds) that
shares its parameter groups and state.

Additions: ``compression`` also takes spec strings and hvd_ext compressors,
``bucket_bytes`` sizes the fused collectives, ``stats`` counts bytes and
waiting, a step whose gradient is non-finite on any rank is skipped on every
rank, and ``state_dict()`` carries the feedback memory.

Horovod elastic (``hvd.elastic.run`` with ``hvd.elastic.TorchState(model=...,
optimizer=...)``): under ``horovodrun --min-np/--max-np`` (``HOROVOD_ELASTIC=1``)
the optimizer makes no collective at construction -- a worker that joins a
running job constructs it while the others are resynchronising -- and runs
the configuration check and the state agreement at the first exchange
instead. Before the first exchange after each re-initialisation of Horovod
(detected automatically; ``reset_world()`` forces it) every rank rebuilds
the world-dependent parts in the same way: the gradient pipeline's buckets
and routes for the new size, the owner-side memories of the two-phase and
sparse reduce-scatter routes (dropped: the shard layout belongs to the old
world), the sparse-gradient agreement; then checks the configuration again
and agrees on the shared state (``GradientPipeline.shared_state_dict``: step
counter, compressor state, auto's decisions, shared feedback state; a newly
joined worker takes the most advanced rank's). Worker
residuals are per rank and stay: a surviving worker keeps its own, a newly
joined worker starts from zero; ``TorchState``'s commit/restore carries them
(``state_dict()``), so after a failed step every survivor is back at its
last committed memory.
"""
from __future__ import annotations

import sys
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import torch

from .spec import compression_from_spec, make_feedback
from .compression.base import Compressor
from .exchange import Exchange, calibration
from .ops.device import nonfinite
from .overlap import check_overlap, resolve_overlap
from .pipeline import GradientPipeline
from .sparse_grad import SparseGradients
from .stats import CommStats
from .variance_freeze import VarianceFreeze
from .world import World, agree_on_calibration, config_fingerprint, fingerprint_mismatch

DEFAULT_BUCKET_BYTES = 25 * 1024 * 1024  # PyTorch DDP's default bucket size


class HorovodCodecAdapter(Compressor):
    """Wraps a Horovod-style compressor (``compress(t) -> (t, ctx)``, ``decompress(t, ctx)``)
    as a linear allreduce codec, so custom ``hvd.Compression`` classes keep working."""

    name = "horovod"
    collective = "allreduce"
    lossless = True  # Horovod's codecs (none, fp16) cast; a custom one is taken as such too

    def __init__(self, codec):
        super().__init__()
        self.codec = codec

    def compress(self, tensor, info):
        out, ctx = self.codec.compress(tensor)
        return out.reshape(-1), ctx

    def decompress(self, payload, ctx, info):
        return self.codec.decompress(payload, ctx).reshape(info.shape)

    def spec(self):
        return f"horovod:{getattr(self.codec, '__name__', type(self.codec).__name__)}"


def resolve_compression(compression) -> Compressor:
    """Accept a spec string, an hvd_ext compressor, ``hvd.Compression.none/fp16`` or any
    Horovod-style codec; raise ValueError for anything else."""
    import horovod.torch as hvd

    if compression is None or compression is hvd.Compression.none:
        return compression_from_spec("none")
    if compression is hvd.Compression.fp16:
        return compression_from_spec("fp16")
    if isinstance(compression, str):
        return compression_from_spec(compression)
    if isinstance(compression, Compressor):
        if compression.feedback is None:
            compression.feedback = make_feedback(compression.default_feedback, compression)
        return compression
    if isinstance(compression, type) and issubclass(compression, Compressor):
        raise ValueError(f"compression: pass an instance ({compression.__name__}()) or a spec string, "
                         "not the class")
    if callable(getattr(compression, "compress", None)) and callable(getattr(compression, "decompress", None)):
        return HorovodCodecAdapter(compression)
    raise ValueError(f"compression: unsupported value {compression!r}; accepted: a spec string such as "
                     "'topk:ratio=0.01' (see hvd_ext.list_compressors()), an hvd_ext compressor, "
                     "hvd.Compression.none / hvd.Compression.fp16, or an object with compress/decompress")


def _in_state_broadcast() -> bool:
    """True when ``step()`` is called from ``broadcast_optimizer_state`` (Horovod's, or a copy of it),
    which steps ranks with empty state to create it, on those ranks only."""
    f = sys._getframe(2)
    for _ in range(6):  # the caller, through optimizer/scheduler step wrappers
        if f is None:
            return False
        if f.f_code.co_name == "broadcast_optimizer_state":
            return True
        f = f.f_back
    return False


def _grads_finite(params) -> bool:
    """Every gradient is finite (the local steps of a sync strategy): one read per device for them all."""
    by_device: Dict[Any, list] = {}
    for p in params:
        if p.grad is not None:
            g = p.grad.coalesce()._values() if p.grad.is_sparse else p.grad
            by_device.setdefault(g.device, []).append(g)
    return not any(bool(nonfinite(gs)) for gs in by_device.values())


class _LocalOnly:
    """Stands in for the gradient pipeline on a rank outside the process set: Horovod lets such a
    rank construct the optimizer and step locally without communicating."""

    buckets: list = []
    in_flight = False
    compress_s = 0.0
    step = 0

    routes: list = []
    policies: list = []

    def finish(self) -> bool:
        return False

    def reset(self) -> None:
        pass

    def state_dict(self) -> Dict[str, Any]:
        return {}

    def load_state_dict(self, state) -> None:
        pass


@dataclass(frozen=True)
class _PipelineArgs:
    """What building a gradient pipeline takes besides the world (rebuilt on each new world)."""

    params: List[Tuple[str, torch.Tensor]]   # trainable (name, parameter), in the optimizer's order
    bucket_bytes: int
    warmup: int                               # dense warm-up exchanges (compression.common)
    overlap: Any                              # the user's setting, resolved per world


class _DistributedMixin:
    """Methods placed in front of the wrapped optimizer's class (see ``DistributedOptimizer``).

    Per step, the flags follow Horovod's optimizer: backward's first hook (or ``synchronize()``)
    settles the world (:class:`hvd_ext.world.World`) and sets ``_hooked_since_sync``; each hook
    hands its parameter to the pipeline once ``backward_passes_per_step`` passes are in;
    ``synchronize()`` finishes every exchange, sets ``_synchronized`` and ``_skip_next_step`` (some
    rank's gradient was non-finite); ``step()`` synchronizes unless inside ``skip_synchronize()``
    (``_should_synchronize`` False), then updates unless the step is skipped. A sync strategy turns
    the exchange off between parameter averages (``_exchange_gradients``)."""

    def _hvd_ext_setup(self, named_parameters, compressor: Compressor, backward_passes_per_step: int,
                       op, gradient_predivide_factor: float, process_set, bucket_bytes: int,
                       log_path: Optional[str], sparse_as_dense: bool = False, overlap="auto"):
        import horovod.torch as hvd

        self._compression = compressor
        self.backward_passes_per_step = backward_passes_per_step
        self.op = op
        self.gradient_predivide_factor = gradient_predivide_factor
        self.process_set = process_set
        prescale, postscale = ((1.0 / gradient_predivide_factor, gradient_predivide_factor) if op == hvd.Average
                               else (1.0, 1.0))
        self._exchange = Exchange(op=op, prescale_factor=prescale, postscale_factor=postscale,
                                  process_set=process_set)
        trainable = [(n, p) for n, p in named_parameters if p.requires_grad]
        self._parameter_names = {p: n for n, p in named_parameters}
        included = process_set.included()
        # Adam & co. under a lossy codec: dense warm-up, then the second moment frozen (variance_freeze).
        self._freeze = VarianceFreeze.for_optimizer(self, compressor, self._parameter_names) if included else None
        self._pipeline_args = _PipelineArgs(trainable, bucket_bytes,
                                            compressor.warmup_length(frozen_moment=self._freeze is not None), overlap)
        self._world = World(self._exchange, included)
        # Sparse gradients: Horovod's sparse allgather path unless sparse_as_dense (Adasum: dense).
        self._sparse = SparseGradients(self._exchange, trainable, torch.float16 if compressor.wire_dtype == torch.float16 else None,
                                       bool(sparse_as_dense) or self._exchange.op_name == "adasum",
                                       bool(sparse_as_dense), included)
        self._pipeline = None
        self.overlap = False
        if included:
            if not self._world.elastic:
                agree_on_calibration(self._exchange)  # the routes are priced with it next
            self._rebuild_pipeline()
        else:
            self._pipeline = _LocalOnly()
        self._allreduce_delay = {p: backward_passes_per_step for _, p in trainable}
        self._hook_handles = []
        self._synchronized = False
        self._should_synchronize = True
        self._skip_next_step = False
        self._exchange_gradients = True
        self._hooked_since_sync = False
        self.stats = CommStats(log_path)
        if included:
            if not self._world.elastic:
                self._check_config()
            self._register_hooks()
        self._hand_back_momentum_if_bypassed()

    @property
    def world_changes(self) -> int:
        """Re-initialisations of Horovod this optimizer has followed (elastic)."""
        return self._world.changes

    def _rebuild_pipeline(self, keep_owner_memory: bool = True) -> None:
        """The one place the gradient pipeline is built: buckets and routes for the current world over
        the dense trainable parameters (sparse ones travel apart), an old pipeline's state carried over."""
        import horovod.torch as hvd

        a, old = self._pipeline_args, self._pipeline
        self.overlap = resolve_overlap(a.overlap, a.params[0][1].device if a.params else None,
                                       hvd.local_size())
        state = compress_s = None
        if old is not None:
            state, compress_s = old.state_dict(), old.compress_s
            if not keep_owner_memory:
                state["owner"] = {}
            old.close()
        self._pipeline = GradientPipeline([(n, p) for n, p in a.params if not self._sparse.owns(p)],
                                          self._compression, self._compression.feedback, self._exchange,
                                          a.bucket_bytes, warmup=a.warmup, overlap=self.overlap)
        if state is not None:
            self._pipeline.load_state_dict(state)
            self._pipeline.compress_s = compress_s

    def _check_config(self):
        """One allgather of a small fingerprint (at construction, or under Horovod elastic before the
        first exchange in each world); every rank raises on a mismatch."""
        a = self._pipeline_args
        buckets = [list(b.names) for b in self._pipeline.buckets]
        fp = config_fingerprint(a.params, self._compression, self._exchange.op_name,
                                self.backward_passes_per_step, self.gradient_predivide_factor, a.bucket_bytes,
                                self._sparse.requested_as_dense, buckets,
                                list(self._pipeline.configured_routes))
        msg = fingerprint_mismatch(self._exchange.allgather_object(fp, "hvd_ext.config"))
        if msg is not None:
            raise ValueError(msg)
        calibration.from_env()  # a file no rank can use (elastic: not compared before): every rank raises

    def _before_exchange(self):
        """Before this rank's first collective of a step (first hook, or ``synchronize()``)."""
        w = self._world
        if w.moved():
            self._rebuild_for_world()
        if w.check_due:
            w.check_due = False
            self._check_config()
        if w.agree_due:
            self._agree_state()

    def reset_world(self) -> None:
        """Treat the Horovod world as changed: the next exchange rebuilds the pipeline for it and
        agrees again. Under ``horovodrun`` elastic this happens by itself; this is for other
        launchers (``state.register_reset_callbacks([optimizer.reset_world])``)."""
        if self.process_set.included():
            self._world.forget()

    def _rebuild_for_world(self):
        """Horovod was re-initialised (elastic: a worker left or joined). Every rank rebuilds the same
        way: buckets and routes for the new size and node layout (the pipeline's state carried
        over), owner-side memories dropped (their shards belong to the old layout), the
        sparse-gradient agreement forgotten (it is made again at this step). Worker residuals stay
        with their rank; the step counter and compressor state are agreed next (``_agree_state``)."""
        self._world.enter()
        self._sparse.forget()
        # Node-aware routes cache the per-node process sets of a world (Horovod dropped them on reinit)
        # and the links measured between them.
        self._exchange.forget_nodes()
        self._rebuild_pipeline(keep_owner_memory=False)

    def _agree_state(self):
        """Once, before this optimizer's first gradient exchange: if ranks hold hvd_ext state of
        different steps (the resume recipe loads a checkpoint on rank 0 only), every rank takes the
        most advanced rank's shared state (``GradientPipeline.shared_state_dict``: step, codec state,
        ``auto``'s and the route trial's decisions, owner ranges, e.g. ewma's S), as
        ``broadcast_optimizer_state`` does for the torch state. Error memories stay per rank."""
        self._world.agree_due = False
        pipe, ex = self._pipeline, self._exchange
        steps = ex.allgather_object(int(pipe.step), "hvd_ext.resume.steps")
        if len(set(steps)) == 1:
            return
        root = steps.index(max(steps))
        mine = None
        if ex.rank == root:
            mine = {"pipeline": pipe.shared_state_dict(),
                    "variance": self._freeze.state_dict() if self._freeze is not None else None}
        got = ex.allgather_object(mine, "hvd_ext.resume.state")[root]
        if ex.rank != root and steps[ex.rank] != steps[root]:
            pipe.load_shared_state_dict(got["pipeline"])
            if self._freeze is not None:
                self._freeze.load_state_dict(got.get("variance"))

    # ---- hooks -----------------------------------------------------------------------------
    def _register_hooks(self):
        for p in self._allreduce_delay:
            self._hook_handles.append(p.register_post_accumulate_grad_hook(self._make_hook(p)))

    def _make_hook(self, p):
        def hook(param):
            if not self._exchange_gradients:
                return
            if not self._hooked_since_sync:
                if self._world.elastic and self._world.unsettled():
                    # The first exchange in a new world waits for synchronize(): by then every rank,
                    # a joining one too, has finished backward and agreed on the mode (sync strategies).
                    return
                self._before_exchange()
            self._hooked_since_sync = True
            if self._allreduce_delay[p] <= 0:
                raise AssertionError("Gradients were computed more than backward_passes_per_step times "
                                     "before call to step(). Increase backward_passes_per_step to "
                                     "accumulate gradients locally.")
            self._allreduce_delay[p] -= 1
            self._sparse.saw(self._parameter_names[p], param.grad)
            if self._allreduce_delay[p] == 0:
                if self._sparse.owns(p):
                    self._sparse.start(self._parameter_names[p], p)
                else:
                    self._pipeline.mark_ready(p)
        return hook

    # ---- Horovod API ------------------------------------------------------------------------
    def set_backward_passes_per_step(self, passes: int):
        if not isinstance(passes, int) or isinstance(passes, bool) or passes < 1:
            raise ValueError(f"backward_passes_per_step must be an int >= 1, got {passes!r}")
        self.backward_passes_per_step = passes
        for p in self._allreduce_delay:
            self._allreduce_delay[p] = passes

    def synchronize(self):
        """Finish this step's exchange: ``p.grad`` then holds the averaged gradient."""
        if not self.process_set.included() or not self._exchange_gradients:
            self._synchronized = True
            return
        if not self._hooked_since_sync:
            self._before_exchange()
        if not self._sparse.learnt:  # hooks skipped (first step in a new world): look at the gradients
            for n, p in self._pipeline_args.params:
                self._sparse.saw(n, p.grad)
        nonfinite = self._pipeline.finish()
        nonfinite = self._sparse.finish() or nonfinite
        if not self._sparse.learnt and self._sparse.learn(self._exchange.allgather_object):
            self._rebuild_pipeline()  # without the sparse parameters, its state carried over
        for p in self._allreduce_delay:
            self._allreduce_delay[p] = self.backward_passes_per_step
            if not p.requires_grad:
                # Frozen after construction (fine-tuning): the exchange still ran identically on every
                # rank, but the parameter gets no update -- not even feedback memory or momentum.
                p.grad = None
        self._hooked_since_sync = False
        self._synchronized = True
        self._skip_next_step = nonfinite
        self._record(skipped=nonfinite, exchanged=True)

    def _record(self, skipped: bool, exchanged: bool):
        ex = self._exchange.stats
        self.stats.record_totals(bytes_sent=ex.bytes_sent, bytes_received=ex.bytes_received, comm_wait_s=ex.wait_s,
                                 compress_s=self._pipeline.compress_s, skipped=skipped, exchanged=exchanged)
        extra = self.stats.extra
        extra["routes"] = self._pipeline.routes
        extra["overlap"] = bool(self.overlap)
        extra["wire_by_link"] = dict(getattr(ex, "wire_by_link", {}) or {})
        if getattr(self._exchange, "node_links", None):  # multi-node: the links the routes were chosen for
            extra["node_links"] = self._exchange.node_links
        for policy in self._pipeline.policies:  # what auto and the route trial decided, measured
            if policy.key:
                extra[policy.key] = policy.report()

    @contextmanager
    def skip_synchronize(self):
        """Use after an explicit ``synchronize()`` so ``step()`` does not exchange again."""
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def step(self, closure=None):
        if self._should_synchronize and not self._hooked_since_sync and _in_state_broadcast():
            # hvd.broadcast_optimizer_state creates empty state by stepping (zero gradients) on the
            # ranks that have none -- maybe rank 1 only: a local step, as Horovod's own optimizer does,
            # and the parameters are put back (weight decay, ASGD's decay would move them).
            params = [p for g in self.param_groups for p in g["params"]]
            saved = [p.detach().clone() for p in params]
            out = super().step(closure) if closure is not None else super().step()
            with torch.no_grad():
                for p, v in zip(params, saved):
                    p.copy_(v)
            return out
        if self._should_synchronize:
            if self._synchronized:
                warnings.warn("optimizer.step() called without optimizer.skip_synchronize() context after "
                              "optimizer.synchronize(). This can cause training slowdown. You may want to "
                              "consider using optimizer.skip_synchronize() context if you use "
                              "optimizer.synchronize() in your code.")
            self.synchronize()
        self._synchronized = False
        if not self._exchange_gradients and not _grads_finite(self._allreduce_delay):
            # Local steps (a sync strategy between averages): keep NaN/Inf out of the parameters.
            self.stats.skipped_steps += 1
            return None
        if self._skip_next_step:
            # Some rank had a NaN/Inf gradient: every rank skips this update.
            self._skip_next_step = False
            return None
        if self._freeze is not None:
            self._freeze.before_step(self, self._pipeline.step)
        return super().step(closure) if closure is not None else super().step()

    def zero_grad(self, *args, **kwargs):
        if self._pipeline.in_flight or self._sparse.in_flight:
            raise AssertionError("optimizer.zero_grad() was called after loss.backward() but before "
                                 "optimizer.step() or optimizer.synchronize(). This is prohibited as it "
                                 "can cause a race condition.")
        return super().zero_grad(*args, **kwargs)

    # ---- hvd_ext additions ----------------------------------------------------------------
    @property
    def compression(self) -> Compressor:
        return self._compression

    @property
    def exchange(self) -> Exchange:
        return self._exchange

    def set_gradient_exchange(self, enabled: bool) -> None:
        """Turn the per-step gradient exchange on or off (sync strategies use this between
        parameter averages). Must be called identically on every rank."""
        if self._pipeline.in_flight or self._sparse.in_flight:
            raise AssertionError("set_gradient_exchange() called while gradients are being exchanged")
        self._exchange_gradients = bool(enabled)
        self._hand_back_momentum_if_bypassed()

    def _hand_back_momentum_if_bypassed(self) -> None:
        """A feedback that took the optimizer's momentum over does not run in steps that bypass it (the
        gradient exchange off, the dense warm-up): the optimizer applies the momentum itself there, and
        the next step through the feedback takes it over again (``MomentumTakeover.hand_back_momentum``;
        Signum's compressor holds its momentum itself: ``MajorityVote.hand_back_momentum``)."""
        warm = getattr(self._pipeline, "warmup_policy", None)
        bypassed = (not self._exchange_gradients or isinstance(self._pipeline, _LocalOnly)   # outside the set
                    or (warm is not None and warm.active()))
        for holder in (self._compression.feedback, self._compression):
            hand = getattr(holder, "hand_back_momentum", None)
            if hand is not None and bypassed:
                hand()

    def state_dict(self):
        sd = super().state_dict()
        sd["hvd_ext"] = self._pipeline.state_dict()
        if self._freeze is not None:
            sd["hvd_ext"]["variance"] = self._freeze.state_dict()
        return sd

    def load_state_dict(self, state_dict):
        state_dict = dict(state_dict)
        ext = state_dict.pop("hvd_ext", None)
        self._pipeline.reset()
        self._sparse.exchange.reset()
        self._synchronized = False
        self._should_synchronize = True
        self._skip_next_step = False
        self._hooked_since_sync = False
        for p in self._allreduce_delay:
            self._allreduce_delay[p] = self.backward_passes_per_step
        super().load_state_dict(state_dict)
        if ext is not None:
            self._pipeline.load_state_dict(ext)
            if self._freeze is not None:
                self._freeze.load_state_dict(ext.get("variance"))
        self._hand_back_momentum_if_bypassed()


def _check_named_parameters(optimizer, named_parameters):
    all_params = [p for g in optimizer.param_groups for p in g["params"]]
    if named_parameters is None:
        return [(f"allreduce.noname.{i}.{j}", p)
                for i, g in enumerate(optimizer.param_groups) for j, p in enumerate(g["params"])]
    named_parameters = list(named_parameters)
    if any(not isinstance(x, tuple) or len(x) != 2 for x in named_parameters):
        raise ValueError("named_parameters should be a sequence of tuples (name, parameter), "
                         "usually produced by model.named_parameters().")
    names = [n for n, _ in named_parameters]
    dups = sorted({n for n in names if names.count(n) > 1})
    if dups:
        raise ValueError("Parameter names in named_parameters must be unique. Found duplicates: "
                         + ", ".join(dups))
    named_ids = {id(p) for _, p in named_parameters}
    unnamed = [p for p in all_params if id(p) not in named_ids]
    if unnamed:
        raise ValueError("named_parameters was specified, but one or more model parameters were not named. "
                         "Python object ids: " + ", ".join(str(id(p)) for p in unnamed))
    opt_ids = {id(p) for p in all_params}
    # Keep only parameters the optimizer updates, in the order given.
    return [(n, p) for n, p in named_parameters if id(p) in opt_ids]


def _check_arguments(hvd, optimizer, op, backward_passes_per_step, gradient_predivide_factor, bucket_bytes,
                     overlap, num_groups, groups) -> float:
    """Horovod's argument rules, checked before any collective; returns the predivide factor."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ValueError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if isinstance(optimizer, _DistributedMixin):
        raise ValueError("optimizer is already a DistributedOptimizer; wrap the plain torch optimizer once")
    if op not in (hvd.Average, hvd.Sum, hvd.Adasum):
        raise ValueError(f"op must be one of hvd.Average, hvd.Sum, hvd.Adasum; got {op!r}")
    if (not isinstance(backward_passes_per_step, int) or isinstance(backward_passes_per_step, bool)
            or backward_passes_per_step < 1):
        raise ValueError(f"backward_passes_per_step must be an int >= 1, got {backward_passes_per_step!r}")
    try:
        gradient_predivide_factor = float(gradient_predivide_factor)
    except (TypeError, ValueError):
        raise ValueError(f"gradient_predivide_factor must be a positive number, got {gradient_predivide_factor!r}")
    if not gradient_predivide_factor > 0 or gradient_predivide_factor == float("inf"):
        raise ValueError(f"gradient_predivide_factor must be a positive finite number, got {gradient_predivide_factor!r}")
    if gradient_predivide_factor != 1.0 and op != hvd.Average:
        raise ValueError("gradient_predivide_factor not supported with op != Average")
    if not isinstance(bucket_bytes, int) or isinstance(bucket_bytes, bool) or bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be an int >= 1, got {bucket_bytes!r}")
    check_overlap(overlap)
    if num_groups and groups is not None:
        raise ValueError("num_groups and groups are mutually exclusive")
    if num_groups or groups is not None:
        warnings.warn("hvd_ext.DistributedOptimizer: num_groups/groups are accepted for compatibility; "
                      "collectives are fused by bucket_bytes instead")
    return gradient_predivide_factor


def DistributedOptimizer(optimizer, named_parameters=None, compression=None, backward_passes_per_step=1,
                         op=None, gradient_predivide_factor=1.0, num_groups=0, groups=None,
                         sparse_as_dense=False, process_set=None, *, bucket_bytes=DEFAULT_BUCKET_BYTES,
                         log_path=None, overlap="auto"):
    """Wrap ``optimizer`` so gradients are exchanged (compressed) across Horovod ranks.

    Arguments are Horovod's (``hvd.DistributedOptimizer``) plus:
      compression: spec string (``"topk:ratio=0.01"``), hvd_ext compressor, or
        ``hvd.Compression.none/fp16`` (default: none).
      bucket_bytes: dense bytes of gradients fused into one collective (default 25 MiB).
      log_path: append one JSON line of stats per step to this file.
      overlap: ``True`` compresses each bucket on a worker thread while backward goes on
        (``hvd_ext.overlap``); ``"auto"`` (default) does so for a CPU model with at least two
        cores per local rank; ``False`` compresses inside the backward hooks.

    ``num_groups``/``groups`` are accepted for compatibility; hvd_ext fuses by
    ``bucket_bytes`` instead. Sparse gradients (``nn.Embedding(sparse=True)``) are exchanged as
    indices + values and handed back sparse; ``sparse_as_dense=True`` exchanges them dense and, as
    Horovod does, hands them back sparse (``SparseAdam`` works either way; see ``sparse_grad``).
    Every argument is checked before any collective starts.
    """
    import horovod.torch as hvd

    op = hvd.Average if op is None else op
    gradient_predivide_factor = _check_arguments(hvd, optimizer, op, backward_passes_per_step,
                                                 gradient_predivide_factor, bucket_bytes, overlap, num_groups, groups)
    compressor = resolve_compression(compression)
    bf16 = compressor.wire_dtype == torch.bfloat16
    if op == hvd.Adasum and (compressor.collective != "allreduce" or bf16):
        raise ValueError(f"op=hvd.Adasum needs a linear (allreduce) compressor that Horovod can reduce, such as "
                         f"none or fp16; '{compressor.name}' uses "
                         + ("bfloat16, which Horovod has no collective for" if bf16
                            else compressor.collective))
    process_set = hvd.global_process_set if process_set is None else process_set
    named = _check_named_parameters(optimizer, named_parameters)

    base = optimizer.__class__
    cls = type(base.__name__, (_DistributedMixin, base), {"__doc__": base.__doc__})
    dist = cls.__new__(cls)
    # Share the optimizer's groups and state; drop instance-level wrappers of its bound
    # methods (an LR scheduler built earlier wraps ``optimizer.step``) so ours are used.
    dist.__dict__.update({k: v for k, v in optimizer.__dict__.items()
                          if not (callable(v) and getattr(v, "__self__", None) is optimizer)
                          and k not in ("step", "zero_grad")})
    compressor.bind_optimizer(dist)  # e.g. dgc takes over SGD momentum; may raise, before any hook exists
    dist._hvd_ext_setup(named, compressor, backward_passes_per_step, op, gradient_predivide_factor,
                        process_set, bucket_bytes, log_path, bool(sparse_as_dense), overlap)
    return dist
