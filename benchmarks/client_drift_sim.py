#!/usr/bin/env python
"""Client drift on label-skewed shards, simulated in one process (no Horovod): N workers take K local
SGD steps from the common model, then their models are averaged (synchronous local SGD), with or
without SCAFFOLD's control variates (Karimireddy et al., ICML 2020: every local step uses
g - c_i + c, c_i the worker's mean raw gradient of its last round, c their mean).

    python benchmarks/client_drift_sim.py --workers 4 --local-steps 5 --correction scaffold
    python benchmarks/client_drift_sim.py --workers 4 --local-steps 5 --correction none --lr-scale 0.25

The MNIST-1D workload of the benchmarks (hvd_ext/examples/workloads.py), label skew 0.9, batch 16
per worker, SGD momentum 0.9 and weight decay 5e-4, a one-cycle-like learning rate (peak 0.2 x
``--lr-scale``). docs/techniques.md (technique 1, "Limit") quotes its final accuracies: it separates
the drift correction from the asynchrony of ``event``.
"""
from __future__ import annotations

import argparse
import copy
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hvd_ext.examples.workloads import get_workload, label_skew_shards  # noqa: E402


def lr_at(t: int, total: int, peak: float) -> float:
    f = t / total
    if f < 0.3:
        return peak * (0.04 + 0.96 * f / 0.3)
    return peak * 0.5 * (1 + math.cos(math.pi * (f - 0.3) / 0.7)) + 1e-5


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--local-steps", type=int, default=5)
    ap.add_argument("--correction", choices=("none", "scaffold"), default="none")
    ap.add_argument("--lr-scale", type=float, default=1.0)
    ap.add_argument("--momentum", type=float, default=0.9)
    ap.add_argument("--batch", type=int, default=16)
    a = ap.parse_args(argv)
    torch.manual_seed(0)
    w = get_workload("mnist1d-noniid-slow")
    xtr, ytr, xte, yte = w.load()
    N, K = a.workers, a.local_steps
    shards = label_skew_shards(ytr, N, 0.9, seed=0)
    per_epoch = min(len(s) for s in shards) // a.batch
    total = w.epochs * per_epoch
    z = w.model()
    models = [copy.deepcopy(z) for _ in range(N)]
    opts = [torch.optim.SGD(m.parameters(), lr=w.lr, momentum=a.momentum, weight_decay=5e-4) for m in models]
    zeros = lambda: [torch.zeros_like(p) for p in z.parameters()]  # noqa: E731
    c_local, c = [zeros() for _ in range(N)], zeros()
    g = torch.Generator().manual_seed(0)
    order = [s[torch.randperm(len(s), generator=g)] for s in shards]
    t = 0
    while t < total:
        start = [p.detach().clone() for p in z.parameters()]
        new_c = []
        for i in range(N):
            with torch.no_grad():
                for p, q in zip(models[i].parameters(), start):
                    p.copy_(q)
            sums = zeros()
            for k in range(K):
                for grp in opts[i].param_groups:
                    grp["lr"] = lr_at(t + k, total, w.lr * a.lr_scale)
                j = (t + k) % per_epoch
                idx = order[i][j * a.batch:(j + 1) * a.batch]
                opts[i].zero_grad()
                w.loss(models[i], xtr[idx], ytr[idx]).backward()
                for p, s, ci, cc in zip(models[i].parameters(), sums, c_local[i], c):
                    s.add_(p.grad)
                    if a.correction == "scaffold":
                        p.grad.add_(cc - ci)
                opts[i].step()
            new_c.append([s / K for s in sums])
        with torch.no_grad():
            for j, p in enumerate(z.parameters()):
                p.copy_(sum(list(m.parameters())[j] for m in models) / N)
            if a.correction == "scaffold":
                c = [cj + sum(new_c[i][j] - c_local[i][j] for i in range(N)) / N for j, cj in enumerate(c)]
                c_local = new_c
        t += K
    print(f"workers {N} local steps {K} correction {a.correction} lr x{a.lr_scale}: "
          f"final accuracy {w.evaluate(z, xte, yte):.4f}")


if __name__ == "__main__":
    main()
