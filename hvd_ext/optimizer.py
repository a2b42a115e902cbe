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
and agrees on the step counter, compressor state and rank-shared feedback
state (a newly joined worker takes the most advanced rank's). Worker
residuals are per rank and stay: a surviving worker keeps its own, a newly
joined worker starts from zero; ``TorchState``'s commit/restore carries them
(``state_dict()``), so after a failed step every survivor is back at its
last committed memory.
"""
from __future__ import annotations

import os
import sys
import warnings
from contextlib import contextmanager
from typing import Any, Dict, List, Optional

import torch

from .spec import compression_from_spec, make_feedback
from .compression.base import Compressor
from .exchange import Exchange
from .ops.device import nonfinite
from .overlap import check_overlap, resolve_overlap
from .pipeline import GradientPipeline
from .sparse_grad import SparseExchange
from .stats import CommStats
from .variance_freeze import VarianceFreeze

DEFAULT_BUCKET_BYTES = 25 * 1024 * 1024  # PyTorch DDP's default bucket size


class HorovodCodecAdapter(Compressor):
    """Wraps a Horovod-style compressor (``compress(t) -> (t, ctx)``, ``decompress(t, ctx)``)
    as a linear allreduce codec, so custom ``hvd.Compression`` classes keep working."""

    name = "horovod"
    exchange = "allreduce"
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
        "routes": list(routes or []),
    }


def _short(v, limit: int = 160) -> str:
    r = repr(v)
    return r if len(r) <= limit else r[:limit - 3] + "..."


def fingerprint_mismatch(fingerprints: List[Dict[str, Any]], what: str = "hvd_ext.DistributedOptimizer") -> Optional[str]:
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
                    f"the same configuration (checked once, at construction; under Horovod elastic at the "
                    f"first exchange after each reset)")
    extra = sorted({k for fp in fingerprints for k in fp} - set(ref))
    if extra:
        return f"{what}: ranks are configured differently (keys {extra} set on some ranks only)"
    return None


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


def horovod_elastic() -> bool:
    """True when this process runs under an elastic ``horovodrun`` (``--min-np``/``--max-np``,
    host discovery): workers may join later, so no collective may run at construction."""
    return os.environ.get("HOROVOD_ELASTIC", "0").strip() not in ("", "0")


def world_of(exchange) -> tuple:
    """What identifies the Horovod world this rank is in: (initialisation, size, rank). The first
    item is the table of pending handles that ``horovod.torch`` replaces on every ``hvd.init()``
    (so a re-initialisation with an unchanged size is seen too); compare with :func:`same_world`."""
    mpi_ops = sys.modules.get("horovod.torch.mpi_ops")
    return (getattr(mpi_ops, "_handle_map", None), exchange.size, exchange.rank)


def same_world(a: Optional[tuple], b: Optional[tuple]) -> bool:
    return a is not None and b is not None and a[0] is b[0] and a[1:] == b[1:]


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

    def finish(self) -> bool:
        return False

    def reset(self) -> None:
        pass

    def state_dict(self) -> Dict[str, Any]:
        return {}

    def load_state_dict(self, state) -> None:
        pass


class _DistributedMixin:
    """Methods placed in front of the wrapped optimizer's class (see ``DistributedOptimizer``)."""

    def _hvd_ext_setup(self, named_parameters, compressor: Compressor, backward_passes_per_step: int,
                       op, gradient_predivide_factor: float, process_set, bucket_bytes: int,
                       log_path: Optional[str], sparse_as_dense: bool = False, overlap="auto"):
        import horovod.torch as hvd

        self._hvd = hvd
        self._compression = compressor
        self.backward_passes_per_step = backward_passes_per_step
        self.op = op
        self.gradient_predivide_factor = gradient_predivide_factor
        self.process_set = process_set
        if op == hvd.Average:
            prescale, postscale = 1.0 / gradient_predivide_factor, gradient_predivide_factor
        else:
            prescale = postscale = 1.0
        self._exchange = Exchange(op=op, prescale_factor=prescale, postscale_factor=postscale,
                                  process_set=process_set)
        trainable = [(n, p) for n, p in named_parameters if p.requires_grad]
        self._parameter_names = {p: n for n, p in named_parameters}
        included = process_set.included()
        self._overlap_setting = overlap
        self.overlap = included and resolve_overlap(overlap, trainable[0][1].device if trainable else None,
                                                    hvd.local_size())
        # Adam & co. under a lossy codec: dense warm-up, then the second moment frozen (variance_freeze).
        self._freeze = VarianceFreeze.for_optimizer(self, compressor, self._parameter_names) if included else None
        self._dense_steps = self._freeze.warmup if self._freeze is not None else 0
        if included:
            self._pipeline = GradientPipeline(trainable, compressor, compressor.feedback, self._exchange,
                                              bucket_bytes, dense_steps=self._dense_steps, overlap=self.overlap)
        else:
            self._pipeline = _LocalOnly()
        self._state_agreed = not included
        # Collectives every rank makes at the same point: the configuration check (at construction,
        # or under Horovod elastic before the first exchange) and the state agreement (before the
        # first exchange). Under elastic both are repeated after each change of world.
        self._elastic = included and horovod_elastic()
        self._world = world_of(self._exchange) if included else None
        self._config_pending = False
        self._config_args = (op, gradient_predivide_factor, bucket_bytes, bool(sparse_as_dense))
        self.world_changes = 0
        # Sparse gradients (Horovod's sparse allgather path unless sparse_as_dense): which parameters
        # are sparse is learnt at the first exchange and agreed once; they then leave the pipeline.
        self._trainable, self._bucket_bytes = trainable, bucket_bytes
        self._sparse_as_dense = bool(sparse_as_dense) or self._exchange.op_name == "adasum"
        self._sparse_seen: Dict[str, int] = {}          # name -> sparse_dim seen in a hook
        self._sparse: List[tuple] = []                  # agreed: (name, param, sparse_dim)
        self._sparse_ids: set = set()
        self._sparse_dim: Dict[int, int] = {}
        self._sparse_probed = not included or self._sparse_as_dense
        self._sparse_ex = SparseExchange(self._exchange, torch.float16 if compressor.name == "fp16" else None)
        self._allreduce_delay = {p: backward_passes_per_step for _, p in trainable}
        self._requires_update = {p for _, p in trainable}
        self._hook_handles = []
        self._synchronized = False
        self._should_synchronize = True
        self._skip_next_step = False
        self._exchange_gradients = True
        self._hooked_since_sync = False
        self.stats = CommStats(log_path)
        self._last_counts = (0, 0, 0.0, 0.0)
        if included:
            if self._elastic:
                self._config_pending = True
            else:
                self._check_config()
            self._register_hooks()

    def _check_config(self):
        """One allgather of a small fingerprint (at construction, or under Horovod elastic before the
        first exchange in each world); every rank raises on a mismatch."""
        _, gradient_predivide_factor, bucket_bytes, sparse_as_dense = self._config_args
        buckets = [list(getattr(b, "names", [])) for b in getattr(self._pipeline, "buckets", [])]
        fp = config_fingerprint(self._trainable, self._compression, self._exchange.op_name,
                                self.backward_passes_per_step, gradient_predivide_factor, bucket_bytes,
                                sparse_as_dense, buckets, list(getattr(self._pipeline, "routes", []) or []))
        msg = fingerprint_mismatch(self._exchange.allgather_object(fp, "hvd_ext.config"))
        if msg is not None:
            raise ValueError(msg)

    def _new_world(self) -> bool:
        return (self._config_pending or not self._state_agreed
                or not same_world(self._world, world_of(self._exchange)))

    def _before_exchange(self):
        """Before this rank's first collective of a step (first hook, or ``synchronize()``)."""
        if self._elastic and not same_world(self._world, world_of(self._exchange)):
            self._rebuild_for_world()
        if self._config_pending:
            self._config_pending = False
            self._check_config()
        if not self._state_agreed:
            self._agree_state()

    def reset_world(self) -> None:
        """Treat the Horovod world as changed: the next exchange rebuilds the pipeline for it and
        agrees again. Under ``horovodrun`` elastic this happens by itself; this is for other
        launchers (``state.register_reset_callbacks([optimizer.reset_world])``)."""
        if self.process_set.included():
            self._elastic = True
            self._world = None

    def _rebuild_for_world(self):
        """Horovod was re-initialised (elastic: a worker left or joined). Every rank rebuilds the same
        way: buckets and routes for the new size and node layout (the pipeline's state carried
        over), owner-side memories dropped (their shards belong to the old layout), the
        sparse-gradient agreement forgotten (it is made again at this step). Worker residuals stay with their rank; the step
        counter and compressor state are agreed next (``_agree_state``)."""
        self._world = world_of(self._exchange)
        self.world_changes += 1
        old = self._pipeline
        state, compress_s = old.state_dict(), old.compress_s
        state["owner"] = {}
        self._sparse_ex.reset()
        self._sparse, self._sparse_ids, self._sparse_dim = [], set(), {}
        self._sparse_seen = {}
        self._sparse_probed = self._sparse_as_dense
        # Node-aware routes cache the per-node process sets of a world (Horovod dropped them on reinit)
        # and the links measured between them.
        self._exchange.forget_nodes()
        old.close()
        self.overlap = resolve_overlap(self._overlap_setting,
                                       self._trainable[0][1].device if self._trainable else None,
                                       self._hvd.local_size())
        self._pipeline = GradientPipeline(self._trainable, self._compression, self._compression.feedback,
                                          self._exchange, self._bucket_bytes, dense_steps=self._dense_steps,
                                          overlap=self.overlap)
        self._pipeline.load_state_dict(state)
        self._pipeline.compress_s = compress_s
        self._config_pending = True
        self._state_agreed = False

    def _agree_state(self):
        """Once, before this optimizer's first gradient exchange: if ranks hold hvd_ext state of
        different steps (the resume recipe loads a checkpoint on rank 0 only), every rank takes the
        most advanced rank's step, compressor state and rank-shared feedback state (e.g. ewma's S),
        as ``broadcast_optimizer_state`` does for the torch state. Residual memories stay per rank."""
        self._state_agreed = True
        pipe, ex = self._pipeline, self._exchange
        steps = ex.allgather_object(int(pipe.step), "hvd_ext.resume.steps")
        if len(set(steps)) == 1:
            return
        root = steps.index(max(steps))
        mine = None
        if ex.rank == root:
            fb = pipe.feedback
            shared = getattr(fb, "shared_state_dict", None)
            fb_state = shared() if callable(shared) else {
                "memory": {k: v.clone() for k, v in fb.memory.items() if "\x00" in k}}
            mine = {"step": int(pipe.step), "compressor": self._compression.state_dict(), "feedback": fb_state,
                    "variance": self._freeze.state_dict() if self._freeze is not None else None}
        got = ex.allgather_object(mine, "hvd_ext.resume.state")[root]
        if ex.rank != root and steps[ex.rank] != steps[root]:
            pipe.set_step(int(got["step"]))
            self._compression.load_state_dict(got["compressor"])
            load_shared = getattr(pipe.feedback, "load_shared_state_dict", None)
            (load_shared or pipe.feedback.load_state_dict)(got["feedback"])
            if self._freeze is not None:
                self._freeze.load_state_dict(got.get("variance"))

    # ---- hooks -----------------------------------------------------------------------------
    def _register_hooks(self):
        for p in self._requires_update:
            self._hook_handles.append(p.register_post_accumulate_grad_hook(self._make_hook(p)))

    def _make_hook(self, p):
        def hook(param):
            if not self._exchange_gradients:
                return
            if not self._hooked_since_sync:
                if self._elastic and self._new_world():
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
            if not self._sparse_probed and param.grad is not None and param.grad.is_sparse:
                self._sparse_seen[self._parameter_names[p]] = param.grad.sparse_dim()
            if self._allreduce_delay[p] == 0:
                if id(p) in self._sparse_ids:
                    self._sparse_ex.start(self._parameter_names[p], p, self._sparse_dim[id(p)])
                else:
                    self._pipeline.mark_ready(p)
        return hook

    def _probe_sparse(self, dense_written) -> None:
        """Once, after the first exchange: agree on the parameters whose gradients are sparse (union
        over ranks), hand this step's averages of them back sparse, and rebuild the pipeline without
        them (its state carried over) so later steps send them as indices + values."""
        self._sparse_probed = True
        seen = self._exchange.allgather_object(sorted(self._sparse_seen.items()), "hvd_ext.sparse.names")
        dims = {n: d for per_rank in seen for n, d in per_rank}
        if not dims:
            return
        self._sparse = [(n, p, dims[n]) for n, p in self._trainable if n in dims]
        self._sparse_ids = {id(p) for _, p, _ in self._sparse}
        self._sparse_dim = {id(p): d for _, p, d in self._sparse}
        for n, p, d in self._sparse:
            if dense_written and p.grad is not None and not p.grad.is_sparse:
                p.grad = p.grad.to_sparse(d)
        state, compress_s = self._pipeline.state_dict(), self._pipeline.compress_s
        self._pipeline.close()
        self._pipeline = GradientPipeline([(n, p) for n, p in self._trainable if id(p) not in self._sparse_ids],
                                          self._compression, self._compression.feedback, self._exchange,
                                          self._bucket_bytes, dense_steps=self._dense_steps, overlap=self.overlap)
        self._pipeline.load_state_dict(state)
        self._pipeline.compress_s = compress_s

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
        if not self._sparse_probed:  # hooks skipped (first step in a new world): look at the gradients
            for n, p in self._trainable:
                if p.grad is not None and p.grad.is_sparse:
                    self._sparse_seen[n] = p.grad.sparse_dim()
        nonfinite = self._pipeline.finish()
        if self._sparse:
            nonfinite = self._sparse_ex.finish(self._sparse) or nonfinite
        if not self._sparse_probed:
            self._probe_sparse(dense_written=True)
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
        now = (ex.bytes_sent, ex.bytes_received, ex.wait_s, self._pipeline.compress_s)
        last = self._last_counts
        self._last_counts = now
        self.stats.record(bytes_sent=now[0] - last[0], bytes_received=now[1] - last[1],
                          comm_wait_s=now[2] - last[2], compress_s=now[3] - last[3],
                          skipped=skipped, exchanged=exchanged)
        extra = self.stats.extra
        extra["routes"] = self._pipeline.routes if hasattr(self._pipeline, "routes") else []
        extra["overlap"] = bool(self.overlap)
        extra["wire_by_link"] = dict(getattr(ex, "wire_by_link", {}) or {})
        if getattr(self._exchange, "node_links", None):  # multi-node: the links the routes were chosen for
            extra["node_links"] = self._exchange.node_links
        trial = getattr(self._pipeline, "route_trial", None)
        if trial is not None:  # hierarchy=auto: flat against node-aware, measured
            extra["route_trial"] = trial.report()
        auto = getattr(self._pipeline, "auto", None)
        if auto is not None:  # compression="auto": its choice, link and predicted vs measured times
            extra["auto"] = auto.report()

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
        if not self._exchange_gradients and not _grads_finite(self._requires_update):
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
        if self._pipeline.in_flight or self._sparse_ex.in_flight:
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
        if self._pipeline.in_flight or self._sparse_ex.in_flight:
            raise AssertionError("set_gradient_exchange() called while gradients are being exchanged")
        self._exchange_gradients = bool(enabled)

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
        self._sparse_ex.reset()
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

    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ValueError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if isinstance(optimizer, _DistributedMixin):
        raise ValueError("optimizer is already a DistributedOptimizer; wrap the plain torch optimizer once")
    op = hvd.Average if op is None else op
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
    compressor = resolve_compression(compression)
    if op == hvd.Adasum and (compressor.exchange != "allreduce" or compressor.name == "bf16"):
        raise ValueError(f"op=hvd.Adasum needs a linear (allreduce) compressor that Horovod can reduce, such as "
                         f"none or fp16; '{compressor.name}' uses "
                         + ("bfloat16, which Horovod has no collective for" if compressor.name == "bf16"
                            else compressor.exchange))
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
