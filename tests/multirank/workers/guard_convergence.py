"""Convergence guard rails: every compressor at its *default* options, inside
an ordinary user loop, must drive the loss down.

One Horovod job (2 ranks) runs, one after the other, a short training per (compressor,
optimizer): a small MLP on MNIST-1D (generated locally, cached), batch 64 per rank, the
user's own optimizer wrapped by ``hvd_ext.DistributedOptimizer(opt, compression=NAME)``:

* ``sgd``:  ``torch.optim.SGD(lr=0.05, momentum=0.9)`` -- the loop in which the old defaults
  of dgc (momentum applied twice), the sign family (+-1 steps) and efsignsgd/onebit diverged;
* ``adam``: ``torch.optim.Adam(lr=1e-3)``, one compressor per family (``--adam-specs``), with
  a dense warm-up of 30 exchanges (``warmup=``; default 0, 200 for efsignsgd and onebit) so the frozen second
  moment of ``hvd_ext.variance_freeze`` is exercised within the short run.

Each rank prints one RESULT line: per run the mean cross-entropy on a fixed held-out set
before and after training, the train loss over the last steps, whether the final
parameters are identical on both ranks, and the warnings emitted at construction; and its named
checks (run here, on each rank): per optimizer, the uncompressed loop learns and every run's held-out
cross-entropy falls by at least FRACTION of the uncompressed run's decrease; every run ends with the
same parameters on both ranks. tests/multirank/test_convergence_guard.py asserts them.

    horovodrun -np 2 --gloo python tests/multirank/workers/guard_convergence.py [--steps 150] [--specs a;b] [--optims sgd,adam]
"""
import argparse
import os
import sys
import time
import math
import warnings

sys.path.insert(0, os.path.dirname(__file__))

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import horovod.torch as hvd  # noqa: E402

import hvd_ext  # noqa: E402
from hvd_ext.examples.mnist1d import load_mnist1d  # noqa: E402
from common import Checks  # noqa: E402


FRACTION = 0.5  # of none's loss decrease that every compressor must reach

# Known not to converge at default options in this loop; reported, not checked (they warn at
# construction with the fix: see their bind_optimizer). {(optimizer, spec): why}
KNOWN: dict = {}


def model_for(seed):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(40, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 10))


def make_opt(kind, params):
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    if kind == "adam":
        return torch.optim.Adam(params, lr=1e-3)
    raise ValueError(kind)


def held_out_loss(model, x, y):
    with torch.no_grad():
        return float(F.cross_entropy(model(x), y))


def run(spec, kind, steps, data, batch, adam_warmup):
    x, y, xt, yt = data
    rank, size = hvd.rank(), hvd.size()
    model = model_for(0)
    used = spec
    if kind == "adam":  # a guard of 150 steps: the sign codecs' warm-up (200) would cover all of it
        used = spec + ("," if ":" in spec else ":") + f"warmup={adam_warmup}"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt = hvd_ext.DistributedOptimizer(make_opt(kind, model.parameters()),
                                           named_parameters=model.named_parameters(), compression=used)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    before = held_out_loss(model, xt, yt)
    gen = torch.Generator().manual_seed(1)
    per_epoch = len(x) // (batch * size)
    tail, t0 = [], time.perf_counter()
    perm = None
    for step in range(steps):
        i = step % per_epoch
        if i == 0:
            perm = torch.randperm(len(x), generator=gen)
        idx = perm[(i * size + rank) * batch:(i * size + rank + 1) * batch]
        opt.zero_grad()
        loss = F.cross_entropy(model(x[idx]), y[idx])
        loss.backward()
        opt.step()
        if step >= steps - 20:
            tail.append(float(loss.detach()))
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    g = hvd.allgather(flat.reshape(1, -1), name=f"guard.params.{spec}.{kind}")
    return {"spec": spec, "optimizer": kind, "before": before, "after": held_out_loss(model, xt, yt),
            "train_tail": sum(tail) / len(tail), "agree": bool(torch.equal(g[0], g[-1])),
            "finite": bool(torch.isfinite(flat).all()), "resolved": opt.compression.spec(),
            "warnings": sorted({str(w.message)[:200] for w in caught}),
            "seconds": round(time.perf_counter() - t0, 2)}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--specs", default="", help="';'-separated specs (default: every registered compressor)")
    p.add_argument("--optims", default="sgd,adam")
    p.add_argument("--adam-warmup", type=int, default=30,
                   help="warmup= of the adam runs (dense exchanges before the second moment is frozen)")
    p.add_argument("--adam-specs", default="none;dgc;topk;randomk;sig;qsgd;signsgd;efsignsgd;onebit;powersgd;terngrad",
                   help="';'-separated specs run with adam (default: one per family); 'all' = --specs")
    a = p.parse_args()
    hvd.init()
    torch.set_num_threads(1)
    if hvd.rank() == 0:
        load_mnist1d()
    hvd.barrier()
    x, y, xt, yt = load_mnist1d()
    data = (x, y, xt[:1000], yt[:1000])
    specs = [s for s in a.specs.split(";") if s] or hvd_ext.list_compressors()
    adam = specs if a.adam_specs == "all" else [s for s in a.adam_specs.split(";") if s in specs]
    runs = [run(s, k, a.steps, data, a.batch, a.adam_warmup) for k in a.optims.split(",") if k
            for s in (adam if k == "adam" else specs)]
    checks = Checks(hvd.rank())
    known = check_runs(checks, runs)
    checks.emit(steps=a.steps, runs=runs, known=known)


def check_runs(checks, runs):
    """Named checks of this rank's runs; returns ``[optimizer, report line]`` of the KNOWN runs."""
    known = []
    for r in runs:
        checks.expect(f"agree: {r['optimizer']} {r['spec']}: ranks ended with identical parameters", r["agree"])
    for kind in sorted({r["optimizer"] for r in runs}):
        mine = sorted((r for r in runs if r["optimizer"] == kind), key=lambda r: r["spec"])
        ref = next((r for r in mine if r["spec"] == "none"), None)
        if ref is None:  # no uncompressed run to bound against (a --specs without none)
            continue
        checks.expect(f"converge {kind}: the uncompressed loop itself learns (held-out loss from above 2.0, "
                      "down by more than 0.5)", ref["before"] > 2.0 and ref["after"] < ref["before"] - 0.5,
                      (ref["before"], ref["after"]))
        bound = ref["before"] - FRACTION * (ref["before"] - ref["after"])
        for r in mine:
            ok = r["finite"] and math.isfinite(r["after"]) and r["after"] < bound
            line = (f"held-out loss {r['before']:.3f} -> {r['after']:.3f} (bound {bound:.3f}; none "
                    f"{ref['after']:.3f}; {r['resolved']})")
            if (kind, r["spec"]) in KNOWN:
                known.append([kind, f"{r['spec']}: {line} [known: {KNOWN[(kind, r['spec'])]}; "
                             f"{'passes now' if ok else 'still fails'}]"])
            else:
                checks.expect(f"converge {kind}: {r['spec']} at default options stays finite and its held-out "
                              f"loss falls by {FRACTION} of none's decrease", ok, line)
    return known


if __name__ == "__main__":
    main()
