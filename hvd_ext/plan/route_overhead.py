"""What a bucket's route costs on the host beyond its codec's passes, measured on the job's exchange.

The model prices a bucket's exchange as its collectives' fixed costs, its bytes over the link and its
codec's passes (:func:`hvd_ext.exchange.routes.route_cost`). A route does more on the host than its
codec's passes: the pipeline's checks and the error feedback of each tensor, cutting, framing and
joining payloads, the owner's sum, copies and re-selection (the sparse reduce-scatter, Shi et al.
ICDCS 2019) -- small device operations with a cost per call (Li et al., "PyTorch Distributed", VLDB
2020, on bucketing) and dense passes no codec timing covers. On a CPU they run on the core that
computes, so they lengthen the step.

:func:`measure_route_overhead` runs each codec's flat routes through the real gradient pipeline on the
job's exchange, on a bucket of one tiny tensor, on one of the same elements in ``TENSORS`` tensors
and on one of a ``LARGE`` tensor, in the codec's steady state; given the job's training step, each
timed exchange runs right after one, untimed, as in training, where a bucket's host work finds the
caches as backward left them (on a CPU it costs more so). Of each it keeps a step's median
seconds outside the collectives' waits (the exchange's ``wait_s``: a collective's cost is the
link's, measured apart), less what the codec's passes over that bucket are priced at; the three
buckets give ``[seconds per bucket, per tensor, per element]``, the ranks' mean. On a GPU the
device's unfinished work is waited for inside the collectives' waits, so the figure is the host's
share only (its kernels are priced by the codec's passes). The file keeps them
per codec and route (``route_overhead_s``); the planner, a job's route choice and ``auto`` add them
to a bucket's codec seconds in that world.
"""
from __future__ import annotations

import statistics
import time
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch

from ..exchange.calibration import CodecTiming
from ..exchange.cost import route_wire_and_code
from ..exchange.routes import STEADY_STEP, flat_routes, pass_seconds
from ..pipeline import GradientPipeline
from ..spec import compression_from_spec

ELEMENTS = 2048     # of the small buckets: small enough that the elements' own cost is a sliver
TENSORS = 8         # the second bucket cuts the same elements into this many tensors
LARGE = 256 * 1024  # of the third bucket, one tensor (1 MiB of float32: DDP's first bucket)
WARM, REPS = 3, 15  # steps of each bucket before timing (allocations, compiles), and timed steps
STEP_REPS = 9       # timed steps where each follows a training step (which takes longer)


def measure_route_overhead(job: Any, specs: Sequence[str], timings: Dict[str, CodecTiming],
                           draw: Callable[[int, Any], torch.Tensor],
                           step: Optional[Callable[[], Any]] = None) -> Dict[str, Dict[str, List[float]]]:
    """``{spec: {route: [seconds per bucket, per tensor, per element]}}`` of each codec ``spec`` on each
    flat route it may take in this world (module doc); ``timings``: each spec's pass as just timed;
    ``draw(numel, device)``: a gradient to code; ``step``: the job's training step, run untimed before
    each exchange (every rank gives one or none). Every rank runs the same pipelines, so the same
    collectives; none below two ranks (no route sends)."""
    if job.N < 2:
        return {}
    layouts = ([ELEMENTS], [ELEMENTS // TENSORS] * TENSORS, [LARGE])
    keys, extra = [], []
    for spec in specs:
        comp = compression_from_spec(spec)
        for route in flat_routes(comp, None, job.N):
            keys.append((spec, route))
            for sizes, host in zip(layouts, host_seconds(job, spec, route, layouts, draw, step)):
                passes = pass_seconds(comp, [(n,) for n in sizes], route, job.N, 1, timings[spec])
                extra.append(host - route_wire_and_code(route, job.N, 0.0, passes, passes)[1])
    extra = job.mean(extra)
    out: Dict[str, Dict[str, List[float]]] = {}
    for i, (spec, route) in enumerate(keys):
        one, many, large = extra[3 * i:3 * i + 3]
        per_tensor = max((many - one) / (TENSORS - 1), 0.0)
        per_element = max((large - one) / (LARGE - ELEMENTS), 0.0)
        out.setdefault(spec, {})[route] = [max(one - per_tensor - ELEMENTS * per_element, 0.0), per_tensor,
                                           per_element]
    return out


def host_seconds(job: Any, spec: str, route: str, layouts: Sequence[Sequence[int]],
                 draw: Callable[[int, Any], torch.Tensor], step: Optional[Callable[[], Any]] = None) -> List[float]:
    """Median seconds of a step of one bucket of tensors of each layout's sizes under ``spec`` on the
    flat ``route`` (the gradient pipeline's flush and finish over the job's exchange) outside its
    waits, each right after an untimed ``step()`` where given; each layout's steps in a block, on
    buffers of its own size."""
    out = []
    reps = REPS if step is None else STEP_REPS
    for j, sizes in enumerate(layouts):
        comp = compression_from_spec(flat_only(spec))  # no node-aware trial takes the bucket elsewhere
        named = [(f"route_overhead.{j}.{i}", torch.nn.Parameter(torch.zeros(n, device=job.device)))
                 for i, n in enumerate(sizes)]
        grads = [draw(n, job.device) for n in sizes]
        pipe = GradientPipeline(named, comp, comp.feedback, job.ex, bucket_bytes=1 << 30)
        for b in pipe.buckets:
            pipe.set_bucket_compressor(b, comp, kind=route)
        pipe.step = STEADY_STEP  # past every codec's warm-up, as the planner prices it
        times, stats = [], job.ex.stats
        for s in range(WARM + reps):
            if step is not None:
                job.run_step(step)
            for (_, p), g in zip(named, grads):
                p.grad = g.clone()
            waited, t0 = stats.wait_s, time.perf_counter()
            pipe.flush()
            pipe.finish()
            if job.device.type == "cuda":
                torch.cuda.synchronize(job.device)
            if s >= WARM:
                times.append(time.perf_counter() - t0 - (stats.wait_s - waited))
        pipe.close()
        out.append(statistics.median(times))
    return out


def flat_only(spec: str) -> str:
    """``spec`` with ``hierarchy=flat``: its buckets stay on the route they are given."""
    return f"{spec}{',' if ':' in spec else ':'}hierarchy=flat"
