"""Measured links: the alpha-beta constants of :mod:`.cost` fitted to timed collectives.

Hockney's model gives one collective of ``b`` wire bytes ``t = alpha + b / bandwidth``.
Two sizes fit it: a small allgather gives the fixed cost, a large one the
bandwidth (the fastest of a few tries, so one late rank does not read as a slow
link).

:func:`measure_node_model` measures the two links of a multi-node job once,
for the route choice of the node-aware exchange (:func:`.routes.choose_route`,
``hierarchy=auto``) -- the defaults of :class:`.cost.NodeModel` (10 Gbit/s
between nodes, shared memory inside) are right for one cluster and wrong for
the next:

* **intra** -- every node's ranks allgather among themselves at once (each
  node's link carries only its own traffic, as in the exchange's dense
  reduce-scatter / allgather inside the node);
* **inter** -- every local rank allgathers with its peers on the other nodes,
  all L groups at once: they share the node's NIC, as the L shards of the
  node-aware exchange do, so the NIC bandwidth is ``L`` x the per-group rate.

The ranks' measurements are averaged in one allreduce, so every rank holds the
same :class:`.cost.NodeModel` and takes the same routes. ``HVD_EXT_NODE_LINKS=
default`` skips the measurement and keeps the model's defaults (the only
choice in an in-process simulated world, whose "links" are thread hand-offs).
"""
from __future__ import annotations

import os
import time
from typing import Callable, Dict

import torch

from . import cost

SMALL = 256                             # floats per rank: the fixed cost of a collective
LARGE = (64 * 1024, 256 * 1024, 1024 * 1024)  # floats per rank tried for the bandwidth, smallest first
SPREAD = 8.0                            # a large probe counts once it takes SPREAD x the small one
LINK_SETTINGS = ("measure", "default")
MEASURED: Dict[int, Dict[str, object]] = {}  # id(process set) -> measure_node_model's result, for this world


def node_links_setting() -> str:
    """``HVD_EXT_NODE_LINKS``: ``measure`` (the default) or ``default``."""
    v = os.environ.get("HVD_EXT_NODE_LINKS", "measure").strip().lower() or "measure"
    if v not in LINK_SETTINGS:
        raise ValueError(f"HVD_EXT_NODE_LINKS must be one of {', '.join(LINK_SETTINGS)}, got {v!r}")
    return v


def best_time(run: Callable[[], object], reps: int) -> float:
    """The fastest of ``reps`` timed calls of ``run`` (seconds)."""
    best = None
    for _ in range(reps):
        t0 = time.perf_counter()
        run()
        dt = time.perf_counter() - t0
        best = dt if best is None else min(best, dt)
    return float(best)


def time_allgather(transport, numel: int, name: str, reps: int, device=None) -> float:
    """Seconds of the fastest of ``reps`` allgathers of ``numel`` floats per rank over ``transport``."""
    t = torch.zeros(numel, device=device)
    return best_time(lambda: transport.wait(transport.allgather_async(t, name)), reps)


def fit(t_small: float, t_large: float, wire_small: float, wire_large: float, messages: float,
        codec: float = cost.LinkModel.codec) -> cost.LinkModel:
    """The :class:`cost.LinkModel` through two timed collectives (``messages`` per collective)."""
    bw = (wire_large - wire_small) / max(t_large - t_small, 1e-7)
    alpha = max(t_small - wire_small / bw, 1e-7) / max(messages, 1.0)
    return cost.LinkModel(alpha=alpha, bandwidth=bw, codec=codec)


def measure_node_model(exchange, device=None, reps: int = 3) -> Dict[str, object]:
    """Measure the intra- and inter-node links of ``exchange``'s nodes (collective: every rank calls
    it, in the same order). The large probe grows (``LARGE``) until its time is ``SPREAD`` x the small
    one's: on a fast link a small transfer hides in the noise of a collective's fixed cost, on a slow one
    a big transfer costs seconds. Every size step is agreed in one allreduce of the ranks' mean times,
    so every rank takes the same steps and ends with the same model. Returns ``{"model": NodeModel, "seconds": wall time spent}``."""
    t0 = time.perf_counter()
    topo = exchange.topology()
    L, M = topo.local_size, topo.cross_size
    local, cross = exchange.node_exchanges()
    top = exchange.transport

    def agreed(values):
        t = torch.tensor(values, dtype=torch.float32, device=device)
        top.wait(top.allreduce_async(t, f"hvd_ext.links.mean.{len(values)}", op="average"))
        return [float(v) for v in t.cpu()]

    agreed([0.0])  # start together
    groups = {"intra": local.transport, "inter": cross.transport}
    small = dict(zip(groups, agreed([time_allgather(g, SMALL, f"hvd_ext.links.{k}.small", reps, device)
                                     for k, g in groups.items()])))
    large: Dict[str, tuple] = {}
    for n in LARGE:
        todo = [k for k in groups if k not in large or large[k][1] < SPREAD * small[k]]
        if not todo:
            break
        got = agreed([time_allgather(groups[k], n, f"hvd_ext.links.{k}.{n}", reps, device) for k in todo])
        large.update({k: (n, t) for k, t in zip(todo, got)})
    # ring allgather: (G-1) blocks leave each rank; the inter groups of a node share its NIC (x L).
    share = {"intra": (L - 1, 1), "inter": (M - 1, L)}
    links = {}
    for k, (blocks, per_nic) in share.items():
        n, t = large[k]
        links[k] = fit(small[k], t, 4.0 * SMALL * blocks * per_nic, 4.0 * n * blocks * per_nic, blocks)
    return {"model": cost.NodeModel(intra=links["intra"], inter=links["inter"]),
            "seconds": time.perf_counter() - t0}


def describe(model: cost.NodeModel) -> Dict[str, Dict[str, float]]:
    """The node model in the units a user reads (``opt.stats``, the main job's output)."""
    out = {}
    for name in ("intra", "inter"):
        link = getattr(model, name)
        out[name] = {"MB_per_s": round(link.bandwidth / 1e6, 2), "latency_us": round(link.alpha * 1e6, 1)}
    return out

