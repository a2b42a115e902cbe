"""Count the host-device syncs of the real gradient pipeline on N simulated ranks with an emulated GPU.

    rep = count_syncs("qsgd:bits=8", size=4, route="twophase")
    rep.per_step, rep.in_hooks, rep.buckets, rep.budget, rep.sites

Every rank runs :func:`hvd_ext.testing.harness.run_pipeline` on its own thread inside an
:class:`~hvd_ext.testing.device.EmulatedDevice`, its gradients handed in one parameter at a
time as backward's hooks do; syncs are counted from step ``warm`` on (the first steps may
build buffers and plans), separately inside the hooks and in the rest of the step.

The budget (``docs/gpu.md``): at most 2 per bucket per step plus 2 per step, whatever N and the
number of tensors; at most 1 per step for the lossless allreduce codecs (none, fp16, bf16); none
inside a backward hook.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

import torch

from .device import EmulatedDevice, SyncCounter, to_device, to_host
from .harness import run_pipeline

# The model: 20 tensors of 64 to 131k elements.
DEFAULT_SHAPES = [(64,), (128, 512), (512,), (256, 256), (1024, 128), (64, 64), (131072,), (300,), (96, 96),
                  (4096, 8), (2048,), (77, 130), (1000, 100), (10,), (512, 100), (256,), (333, 33), (64, 1024),
                  (65536,), (200, 200)]
LOSSLESS = ("none", "fp16", "bf16")


@dataclass
class SyncReport:
    spec: str
    size: int
    route: Optional[str]
    steps: int                       # counted steps
    buckets: int
    routes: List[str]
    per_step: float                  # the largest rank's syncs per counted step (hooks included)
    in_hooks: int                    # syncs inside the hooks, all ranks, all counted steps
    budget: float
    sites: List[str] = field(default_factory=list)   # where the largest rank's syncs came from
    results: List[Dict[str, torch.Tensor]] = field(default_factory=list)  # rank 0's last p.grad (CPU)

    @property
    def ok(self) -> bool:
        return self.per_step <= self.budget and self.in_hooks == 0


def budget_for(spec: str, buckets: int) -> float:
    name = spec.split(":")[0]
    return 1.0 if name in LOSSLESS else 2.0 * buckets + 2.0


def make_grads(shapes: Sequence[tuple], size: int, steps: int, seed: int = 0) -> List[List[Dict[str, torch.Tensor]]]:
    g = torch.Generator().manual_seed(seed)
    names = [f"layer{i}.w" for i in range(len(shapes))]
    return [[{n: torch.randn(*s, generator=g) * (1 + i % 3) for i, (n, s) in enumerate(zip(names, shapes))}
             for _ in range(size)] for _ in range(steps)]


def count_syncs(spec: str, size: int, *, route: Optional[str] = None, shapes: Sequence[tuple] = DEFAULT_SHAPES,
                steps: int = 5, warm: int = 2, bucket_bytes: int = 25 * 1024 * 1024, ranks_per_node: int = 0,
                seed: int = 0, timeout: float = 300.0, **kw) -> SyncReport:
    """Run ``spec`` on ``size`` emulated-GPU ranks for ``steps`` steps; count from step ``warm`` on."""

    grads = make_grads(shapes, size, steps, seed)
    grads = [[{n: to_device(t) for n, t in per.items()} for per in step] for step in grads]
    counters = [SyncCounter() for _ in range(size)]

    def before_step(rank, step, pipe):
        if step == warm:
            counters[rank].reset()

    def on_phase(rank, phase):
        counters[rank].phase = phase

    runs = run_pipeline(spec, grads, size, route=route, bucket_bytes=bucket_bytes, ranks_per_node=ranks_per_node,
                        before_step=before_step, hooks=True, on_phase=on_phase, timeout=timeout,
                        rank_context=lambda rank: EmulatedDevice(counters[rank]), **kw)
    counted = steps - warm
    worst = max(range(size), key=lambda r: counters[r].total())
    buckets = len(runs[0].pipeline.buckets)
    return SyncReport(
        spec=spec, size=size, route=route, steps=counted, buckets=buckets, routes=list(runs[0].routes),
        per_step=counters[worst].total() / counted, in_hooks=sum(c.total("hook") for c in counters),
        budget=budget_for(spec, buckets), sites=counters[worst].where(),
        results=[{n: to_host(t) for n, t in runs[0].results[-1].items()}])


def table(reports: Sequence[SyncReport]) -> str:
    """A text table: spec, route, N, buckets, syncs per step (worst rank), in hooks, budget."""
    lines = [f"{'spec':36} {'route':12} {'N':>2} {'buckets':>7} {'per step':>8} {'in hooks':>8} {'budget':>6}"]
    for r in reports:
        lines.append(f"{r.spec:36} {(r.routes[0] if r.routes else '-'):12} {r.size:>2} {r.buckets:>7} "
                     f"{r.per_step:>8.1f} {r.in_hooks:>8} {r.budget:>6.0f}" + ("" if r.ok else "  OVER"))
    return "\n".join(lines)
