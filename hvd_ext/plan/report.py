"""The planner's plot: predicted step time against the inter-node bandwidth, one line per method."""
from __future__ import annotations

import numpy as np


def plot_bandwidth_sweep(p, path: str, lo_gbps: float = 0.1, hi_gbps: float = 1000.0, points: int = 25) -> None:
    """Draw ``p.sweep`` over [lo_gbps, hi_gbps] Gbit/s (log scale) into ``path`` (PNG); the plan's own
    bandwidth is marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    gbps = np.logspace(np.log10(lo_gbps), np.log10(hi_gbps), points)
    curves = p.sweep([g * 1e9 / 8 for g in gbps])
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    for label, steps in sorted(curves.items()):
        style = "-" if label.startswith("horovod") else "--" if label == "auto" else ":"
        ax.plot(gbps, np.asarray(steps) * 1e3, style, label=label, linewidth=2 if label.startswith("horovod") else 1.3)
    mark = (p.cluster.inter if p.cluster.nodes > 1 else p.cluster.intra).bandwidth * 8 / 1e9
    ax.axvline(mark, color="grey", linewidth=0.8)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("inter-node bandwidth, Gbit/s" if p.cluster.nodes > 1 else "link bandwidth, Gbit/s")
    ax.set_ylabel("predicted step time, ms")
    i = p.inputs
    ax.set_title(f"{i['params'] / 1e6:.1f}M params, {i['nodes']}x{i['gpus_per_node']} ranks, "
                 f"compute {i['compute_s'] * 1e3:.0f} ms")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
