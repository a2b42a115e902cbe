"""Run the real ``GradientPipeline`` on N simulated ranks in one process (tests, cost-model checks).

    out = run_pipeline("qsgd:bits=8,exchange=twophase", grads, size=4)

``grads[step][rank]`` maps parameter names to gradient tensors (every rank the
same names and shapes). Each rank builds its own compressor from the spec, an
``Exchange`` over a :class:`SimulatedTransport` and a pipeline; per step it
sets ``p.grad``, flushes and finishes exactly as the optimizer's hooks and
``synchronize()`` do. Returns one :class:`RankRun` per rank. ``ranks_per_node``
lays the ranks out on nodes (node-aware routes; ``process_sets=False``: the
node process sets cannot be made; ``groups="alltoall"``: node groups over the
world's alltoall, as on Horovod by default; ``node_model``: the node links the
route choice assumes, e.g. those a real run measured). ``warmup``: the dense warm-up the optimizer
asks for under an adaptive optimizer (``hvd_ext.variance_freeze``). ``overlap``: the pipeline's
worker thread compresses the buckets (:mod:`hvd_ext.overlap`); the gradients are then handed in
as backward's hooks do, one parameter at a time in reverse order (``hooks=True`` does so without
the worker too). ``rank_context(rank)``: a context manager entered on each rank's thread around
its whole run (an emulated GPU, :mod:`hvd_ext.testing.device`); ``on_phase(rank, phase)`` is
called with ``"hook"`` before the gradients are handed in and ``"step"`` after.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional

import torch

from ..exchange.core import Exchange
from ..pipeline import GradientPipeline
from ..spec import compression_from_spec
from .simulated import SimulatedWorld


@dataclass
class RankRun:
    rank: int
    results: List[Dict[str, torch.Tensor]] = field(default_factory=list)  # p.grad after each step
    skipped: List[bool] = field(default_factory=list)
    received: List[int] = field(default_factory=list)                   # bytes received per step
    wire: List[float] = field(default_factory=list)                     # modelled wire bytes per step
    routes: List[str] = field(default_factory=list)
    pipeline: Any = None
    exchange: Any = None


def run_pipeline(spec, grads: List[List[Dict[str, torch.Tensor]]], size: int, *, params: Optional[Dict[str, torch.Tensor]] = None,
                 bucket_bytes: int = 25 * 1024 * 1024, op: str = "average", route: Optional[str] = None,
                 before_step: Optional[Callable[[int, int, Any], None]] = None, timeout: float = 120.0,
                 ranks_per_node: int = 0, process_sets: bool = True, groups: str = "subworld",
                 warmup: int = 0, node_model=None, overlap: bool = False, hooks: bool = False,
                 rank_context: Optional[Callable[[int], Any]] = None,
                 on_phase: Optional[Callable[[int, str], None]] = None) -> List[RankRun]:
    world = SimulatedWorld(size, timeout=timeout, ranks_per_node=ranks_per_node, process_sets=process_sets,
                           groups=groups)

    def body(rank, transport):
        if rank_context is None:
            return run_rank(rank, transport)
        with rank_context(rank):
            return run_rank(rank, transport)

    def phase(rank, name):
        if on_phase is not None:
            on_phase(rank, name)

    def run_rank(rank, transport):
        return run_on(transport, spec, grads, rank, params=params, bucket_bytes=bucket_bytes, op=op, route=route,
                      before_step=before_step, warmup=warmup, node_model=node_model, overlap=overlap,
                      hooks=hooks, phase=phase)

    return world.run(body)


def run_on(transport, spec, grads: List[List[Dict[str, torch.Tensor]]], rank: int, *,
           params: Optional[Dict[str, torch.Tensor]] = None, bucket_bytes: int = 25 * 1024 * 1024,
           op: str = "average", route: Optional[str] = None,
           before_step: Optional[Callable[[int, int, Any], None]] = None, warmup: int = 0, node_model=None,
           overlap: bool = False, hooks: bool = False,
           phase: Optional[Callable[[int, str], None]] = None) -> RankRun:
    """One rank of :func:`run_pipeline` over any ``transport`` (a simulated rank, or a real one such as
    :class:`hvd_ext.exchange.torch_transport.TorchDistTransport`): the same steps, the same record."""
    names = list(grads[0][0])
    comp = compression_from_spec(spec) if isinstance(spec, str) else spec(rank)
    ex = Exchange(op=op, transport=transport)
    if node_model is not None:  # the links another run measured (a simulated world measures nothing)
        ex.use_node_model(node_model)
    named = []
    for n in names:
        base = params[n] if params is not None else torch.zeros_like(grads[0][0][n])
        named.append((n, torch.nn.Parameter(base.detach().clone())))
    pipe = GradientPipeline(named, comp, comp.feedback, ex, bucket_bytes, route, warmup=warmup,
                            overlap=overlap)
    run = RankRun(rank, routes=pipe.routes, pipeline=pipe, exchange=ex)
    for step, per_rank in enumerate(grads):
        if before_step is not None:
            before_step(rank, step, pipe)
        for n, p in named:
            p.grad = per_rank[rank][n].detach().clone()
        r0, w0 = ex.stats.bytes_received, ex.stats.wire_bytes
        if overlap or hooks:
            if phase is not None:
                phase(rank, "hook")
            for _, p in reversed(named):
                pipe.mark_ready(p)
            if phase is not None:
                phase(rank, "step")
        pipe.flush()
        run.skipped.append(pipe.finish())
        run.results.append({n: p.grad.detach().clone() for n, p in named})
        run.received.append(ex.stats.bytes_received - r0)
        run.wire.append(ex.stats.wire_bytes - w0)
    pipe.close()
    return run
