"""Every hvd_ext codec as a PyTorch DDP communication hook, over ``torch.distributed``.

    state, hook = hvd_ext.ddp.comm_hook("qsgd:bits=8")
    model.register_comm_hook(state, hook)          # or: hvd_ext.ddp.register(model, "qsgd:bits=8")

DDP hands the hook one gradient bucket at a time (``dist.GradBucket``: a flat buffer and views of
it per parameter). Each DDP bucket gets its own :class:`hvd_ext.pipeline.GradientPipeline` -- the
same codecs, feedback memories, routes (allreduce, allgather, two-phase, sparse reduce-scatter,
node-aware) and ``auto`` as the Horovod path -- over a
:class:`hvd_ext.exchange.torch_transport.TorchDistTransport` on the hook's process group. The
averaged gradient is written back into the bucket, as DDP's own hooks do (PyTorch's
``ddp_comm_hooks``: ``fp16_compress_hook``, ``powerSGD_hook``).

State. :class:`HookState` holds the pipelines, so error-feedback and compressor state (PowerSGD's
Q, ``auto``'s choices) live there; ``state_dict()`` / ``load_state_dict()`` checkpoint them, by
DDP bucket index (load before the first backward: the pipelines are made at their bucket's first
call). A pipeline orders its parameters by name, not by DDP's buffer, so DDP's rebuild of its
buckets after the first iteration keeps a bucket's pipeline when the bucket keeps its parameters.

Momentum. A codec that applies momentum itself (dgc's momentum correction, Signum) cannot take the
optimizer's momentum over here, as ``DistributedOptimizer`` does: create the optimizer with
``momentum=0``. Given ``optimizer=``, the hook raises at construction when it has momentum; without
it, the hook warns.

Agreement. At the first bucket every rank's spec, bucket layout and dtypes are compared in one
allgather: a rank configured differently raises ``ValueError`` on every rank, naming the
difference. A non-finite gradient on any rank is known to every rank (the exchange carries the
flag): the hook then leaves every bucket's gradient at zero on every rank, keeps nothing of the
step (feedback, codec state) and sets ``state.skip_step``, which the training loop checks before
``optimizer.step()`` (a DDP hook cannot skip the step itself). The flags of all buckets are read
once per step, in the last bucket's hook.

Overlap. Each bucket's hook compresses it and starts its first collective (asynchronous work
handles of :class:`~hvd_ext.exchange.torch_transport.TorchDistTransport`) and returns a pending
future, so DDP's backward goes on computing the next buckets while this one is on the wire. The
hook of the last bucket (``bucket.is_last()``) finishes every started bucket in the order they
started -- second phases of the two-phase and node-aware routes included -- so every rank makes
the same collectives in the same order, as ``synchronize()`` does under Horovod.

Flat buffer. When a bucket's codec this step acts element by element with no memory (``none``,
``fp16``, ``bf16``; a codec's dense warm-up; ``auto`` on one of them, its release of an earlier
codec's memory added into the buffer), the bucket goes as its one flat buffer instead of tensor by tensor
(:meth:`~hvd_ext.pipeline.GradientPipeline.takes_flat`): ``none`` is reduced where it lies, as DDP's
own ``allreduce_hook`` does. The same average, element for element; the decision depends on the step
and the spec alone, so every rank takes it alike.
"""
from __future__ import annotations

import warnings
from typing import Any, Dict, List, Tuple

import torch

from .exchange import calibration
from .exchange.core import Exchange
from .exchange.torch_transport import TorchDistTransport
from .pipeline import GradientPipeline, finish_together
from .spec import compression_from_spec
from .world import fingerprint_mismatch

BIG = 1 << 62  # one hvd_ext bucket per DDP bucket: DDP already chose the buckets


class HookState:
    """The hook's state: the spec, the exchange over ``process_group``, one pipeline per DDP bucket."""

    def __init__(self, spec: str, process_group=None, optimizer=None):
        comp = compression_from_spec(spec)  # a bad spec fails here, before any collective
        check_momentum(spec, comp, optimizer)
        self.spec = spec
        self.exchange = Exchange(op="average", transport=TorchDistTransport(process_group))
        self.pipelines: Dict[tuple, Tuple[GradientPipeline, List[torch.nn.Parameter]]] = {}  # by layout
        self._names: Dict[int, str] = {}
        self.skip_step = False
        self.skipped_steps = 0
        self._pending: Dict[int, Dict[str, Any]] = {}
        self._agreed = False
        self.layout: Dict[int, List[int]] = {}  # bucket index -> id() of its parameters, in the pipeline's order
        self._orders: Dict[tuple, Tuple[tuple, List[int]]] = {}  # bucket layout -> (pipeline key, buffer positions)
        self.waiting: List[Tuple[GradientPipeline, torch.Tensor, Any]] = []  # started, not finished, in order

    # ---- checkpoint ----------------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        out = {i: self.pipelines[tuple(ids)][0].state_dict() for i, ids in self.layout.items()}
        out.update({i: sd for i, sd in self._pending.items() if i not in out})
        return {"spec": self.spec, "buckets": out, "skipped_steps": self.skipped_steps}

    def load_state_dict(self, sd: Dict[str, Any]) -> None:
        if sd.get("spec") != self.spec:
            raise ValueError(f"hvd_ext.ddp: checkpoint is for spec {sd.get('spec')!r}, this hook runs {self.spec!r}")
        self.skipped_steps = int(sd.get("skipped_steps", 0))
        for i, bsd in sd["buckets"].items():
            if int(i) in self.layout:
                self.pipelines[tuple(self.layout[int(i)])][0].load_state_dict(bsd)
            else:
                self._pending[int(i)] = bsd

    # ---- per bucket ------------------------------------------------------------------------
    def finish_waiting(self) -> None:
        """Finish every started bucket in the order they started (the same on every rank), with one
        read of all their non-finite flags (:func:`~hvd_ext.pipeline.finish_together`), write the
        averages into DDP's buffers and complete their futures. When some rank had a non-finite
        gradient in any bucket, every bucket is left at zero on every rank, nothing of the step is kept
        and ``skip_step`` is set."""
        waiting, self.waiting = self.waiting, []
        try:
            nonfinite = finish_together([pipe for pipe, _, _ in waiting])
            if nonfinite:
                self.skipped_steps += 0 if self.skip_step else 1
                self.skip_step = True
            for _, buf, fut in waiting:
                if nonfinite:
                    buf.zero_()
                fut.set_result(buf)
        except BaseException as e:
            for _, _, fut in waiting:
                if not fut.done():
                    fut.set_exception(e)
            raise

    def _agree(self, bucket) -> None:
        mine = {"spec": self.spec, "index": bucket.index(),
                "tensors": [(tuple(g.shape), str(g.dtype)) for g in bucket.gradients()],
                "calibration": calibration.env_digest()}  # the routes follow it
        msg = fingerprint_mismatch(self.exchange.allgather_object(mine, "hvd_ext.ddp.config"), "hvd_ext.ddp hook",
                                   "checked at the first bucket: register the same spec on the same model")
        if msg is not None:
            raise ValueError(msg)
        calibration.from_env()  # a file no rank can use: every rank raises its error here, together
        self._agreed = True

    def pipeline(self, bucket) -> Tuple[GradientPipeline, List[torch.nn.Parameter], List[torch.Tensor]]:
        """The pipeline of this bucket's parameters, its shadow parameters and the bucket's gradient
        views, both in the pipeline's order. The pipeline orders the parameters by their names (the
        order the hook first met them), not by the buffer: when DDP rebuilds its buckets after the
        first iteration, a bucket that keeps its parameters keeps its pipeline and what it holds,
        and a resumed run orders them as the run that saved the checkpoint. The order is worked out
        once per bucket layout (the parameters and the shapes in the buffer)."""
        i, params, grads = bucket.index(), bucket.parameters(), bucket.gradients()
        seen = (i, tuple(map(id, params)), tuple(g.shape for g in grads))
        if seen not in self._orders:
            self._orders[seen] = self._order(i, params, grads)
        key, order = self._orders[seen]
        self.layout[i] = list(key)
        pipe, shadows = self.pipelines[key]
        return pipe, shadows, [grads[k] for k in order]

    def _order(self, i: int, params, grads) -> Tuple[tuple, List[int]]:
        """(the pipeline's key, the buffer position of each of its tensors) for a bucket layout; the
        pipeline is made at its first layout."""
        aligned = aligned_parameters(params, grads)
        for p in aligned:
            self.name_of(p)
        order = sorted(range(len(aligned)), key=lambda k: int(self.name_of(aligned[k])[1:]))
        ps = [aligned[k] for k in order]
        key = tuple(id(p) for p in ps)
        if key not in self.pipelines:
            shadows = [torch.nn.Parameter(p.detach(), requires_grad=p.requires_grad) for p in ps]
            comp = compression_from_spec(self.spec)
            named = [(self.name_of(p), s) for p, s in zip(ps, shadows)]
            pipe = GradientPipeline(named, comp, comp.feedback, self.exchange, BIG, warmup=comp.warmup_length())
            if i in self._pending:
                pipe.load_state_dict(self._pending.pop(i))
            self.pipelines[key] = (pipe, shadows)
        return key, order

    def name_of(self, p) -> str:
        """A parameter's name in the pipeline (its feedback memory, its codec state): the order in which
        the hook first met it, the same on every rank as DDP's buckets are."""
        return self._names.setdefault(id(p), f"p{len(self._names)}")


def check_momentum(spec: str, comp, optimizer=None) -> None:
    """A codec that applies momentum itself (:func:`own_momentum`) next to an optimizer with momentum
    would apply it twice: ValueError when ``optimizer`` is given and has momentum (SGD's ``momentum``,
    Adam's ``betas[0]``), a warning when no optimizer is given, nothing otherwise. ``optimizer`` not an
    optimizer: ValueError, whatever the codec."""
    if optimizer is not None and not isinstance(getattr(optimizer, "param_groups", None), list):
        raise ValueError(f"hvd_ext.ddp: bad optimizer {type(optimizer).__name__}; accepted: None or a "
                         "torch.optim.Optimizer (the training loop's, with param_groups)")
    momentum = own_momentum(comp)
    if not momentum:
        return
    fix = ("create the optimizer with momentum=0, or set the codec's to 0 in the spec (momentum=0; signum: beta=0). "
           "hvd_ext.DistributedOptimizer takes the optimizer's momentum over instead; a DDP hook does not")
    if optimizer is None:
        warnings.warn(f"hvd_ext.ddp: {spec!r} applies momentum {momentum} itself before it compresses: "
                      f"{fix}. Pass optimizer= to have this checked", stacklevel=4)
        return
    theirs = sorted({float(g["betas"][0]) if "betas" in g else float(g.get("momentum", 0) or 0)
                     for g in optimizer.param_groups} - {0.0})
    if theirs:
        raise ValueError(f"hvd_ext.ddp: {spec!r} applies momentum {momentum} itself, and the optimizer "
                         f"{type(optimizer).__name__} has momentum {theirs}: it would apply twice; {fix}")


def own_momentum(comp) -> float:
    """The momentum a codec applies to the gradient before compressing it: its feedback's momentum
    correction (dgc, ``dgc_momentum``) or Signum's ``beta``; 0 when it applies none."""
    return max(float(getattr(comp.feedback, "momentum", 0.0) or 0.0), float(getattr(comp, "beta", 0.0) or 0.0))


def aligned_parameters(params, grads) -> List[torch.Tensor]:
    """A bucket's parameters in the order of its gradients (the buffer's layout). ``GradBucket``
    lists them in the model's order and the gradients in the bucket's; pair them by shape."""
    params, grads = list(params), list(grads)
    shape = lambda t: (tuple(t.shape), t.dtype)  # noqa: E731
    for cand in (params, params[::-1]):
        if [shape(p) for p in cand] == [shape(g) for g in grads]:
            return cand
    left, out = list(params), []
    for g in grads:
        k = next(k for k, p in enumerate(left) if shape(p) == shape(g))
        out.append(left.pop(k))
    return out


def hook(state: HookState, bucket):  # unannotated: DDP checks a return annotation literally
    """The DDP communication hook (see module doc): compresses the bucket and starts its exchange,
    returning a pending ``torch.futures.Future``; the last bucket of the backward pass finishes every
    pending one, in bucket order, and completes their futures."""
    if not state._agreed:
        state._agree(bucket)
    if bucket.index() == 0:
        state.skip_step = False
    pipe, shadows, grads = state.pipeline(bucket)
    for s, g in zip(shadows, grads):
        s.grad = g  # views of the bucket's buffer: the pipeline writes the average into them
    buf = bucket.buffer()
    if pipe.takes_flat(buf):
        pipe.start_flat(buf)  # none, fp16, bf16: the buffer as one tensor (none: reduced where it lies)
    else:
        pipe.flush()  # compressed, first collective started (asynchronous): backward goes on meanwhile
    fut: torch.futures.Future = torch.futures.Future()
    state.waiting.append((pipe, bucket.buffer(), fut))
    if bucket.is_last():
        state.finish_waiting()
    return fut


def comm_hook(spec: str, process_group=None, optimizer=None) -> Tuple[HookState, Any]:
    """``(state, hook)`` for ``model.register_comm_hook(state, hook)``. ``optimizer``: the training
    loop's, checked against a codec that applies momentum itself (:func:`check_momentum`)."""
    return HookState(spec, process_group, optimizer), hook


def register(model, spec: str, process_group=None, optimizer=None) -> HookState:
    """Register the hook for ``spec`` on a ``DistributedDataParallel`` model; returns its state."""
    state, fn = comm_hook(spec, process_group, optimizer)
    model.register_comm_hook(state, fn)
    return state
