#!/usr/bin/env python
"""Bytes per rank as the number of ranks grows: allgather against the scalable routes.

Launches ``horovodrun -np N --gloo`` (N = 2, 4, 8 by default) on a 1M-parameter
MLP; every spec runs a few steps with the real DistributedOptimizer, once
with ``exchange=allgather`` and once with its default (``auto``: two-phase or
sparse reduce-scatter from N = 3 on). Reported per rank per step, divided by
the dense fp32 gradient's bytes: payload bytes received, and modelled wire
bytes (hvd_ext.exchange.cost; a dense ring allreduce is 2(N-1)/N). Plain
``hvd.allreduce`` of the dense gradient (Horovod's own DistributedOptimizer
path) is measured in the same run as the reference. The alpha-beta model
then projects wire bytes and step time to N = 1024.

    python benchmarks/scale.py                 # N = 2, 4, 8
    python benchmarks/scale.py --sizes 2 4     # quicker
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import RESULTS, ROOT, child_env, machine_info, write_json  # noqa: E402

SPECS = ["qsgd:bits=8", "qdist:bits=3", "efsignsgd", "topk:ratio=0.01", "powersgd:rank=2"]

WORKER = r'''
import json, sys, time, torch, horovod.torch as hvd, hvd_ext
hvd.init(); torch.set_num_threads(1)
specs = json.loads(sys.argv[1])
def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 768),
                               torch.nn.ReLU(), torch.nn.Linear(768, 10))
STEPS = 4
out = {}
dense = sum(p.numel() for p in model().parameters()) * 4
# plain Horovod reference: its DistributedOptimizer allreduces the dense gradient
m = model(); opt = hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.01), named_parameters=m.named_parameters())
t0 = time.perf_counter()
for s in range(STEPS):
    g = torch.Generator().manual_seed(hvd.rank() * 100 + s)
    opt.zero_grad(); m(torch.randn(32, 256, generator=g)).square().mean().backward(); opt.step()
out["horovod"] = {"ms": 1e3 * (time.perf_counter() - t0) / STEPS, "recv": 1.0,
                  "wire": 2 * (hvd.size() - 1) / hvd.size(), "routes": ["allreduce"]}
for spec in specs:
    m = model()
    opt = hvd_ext.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.01), named_parameters=m.named_parameters(),
                                       compression=spec)
    ex = opt.exchange
    for s in range(STEPS + 1):
        if s == 1:
            r0, w0, t0 = ex.stats.bytes_received, ex.stats.wire_bytes, time.perf_counter()
        g = torch.Generator().manual_seed(hvd.rank() * 100 + s)
        opt.zero_grad(); m(torch.randn(32, 256, generator=g)).square().mean().backward(); opt.step()
    out[spec] = {"ms": 1e3 * (time.perf_counter() - t0) / STEPS,
                 "recv": (ex.stats.bytes_received - r0) / STEPS / dense,
                 "wire": (ex.stats.wire_bytes - w0) / STEPS / dense, "routes": opt._pipeline.routes}
if hvd.rank() == 0:
    print("SCALE " + json.dumps({"size": hvd.size(), "dense_bytes": dense, "results": out}), flush=True)
'''


def run(size: int, specs, timeout: float):
    cmd = ["horovodrun", "-np", str(size), "-H", f"localhost:{size}", "--gloo", sys.executable, "-c", WORKER,
           json.dumps(specs)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=child_env(), cwd=str(ROOT))
    for line in p.stdout.splitlines():
        i = line.find("SCALE {")
        if i >= 0:
            return json.loads(line[i + 6:])
    raise RuntimeError(f"N={size} failed (rc {p.returncode}):\n{(p.stdout + p.stderr)[-3000:]}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--out", default=str(RESULTS / "scale.json"))
    a = ap.parse_args(argv)
    specs = []
    for s in SPECS:
        specs.append(s)
        if not s.startswith("powersgd"):
            specs.append(s + (",exchange=allgather" if ":" in s else ":exchange=allgather"))
    rows = {}
    for n in a.sizes:
        print(f"N={n} ...", flush=True)
        rows[n] = run(n, specs, a.timeout)
    # table
    print(f"\nbytes received per rank per step / dense fp32 gradient (wire bytes in brackets); "
          f"dense {rows[a.sizes[0]]['dense_bytes'] / 1e6:.2f} MB")
    head = f"{'spec':34s}" + "".join(f"  N={n:<14d}" for n in a.sizes) + "  route at max N"
    print(head)
    lines = []
    for spec in ["horovod"] + specs:
        cells = "".join(f"  {rows[n]['results'][spec]['recv']:.3f} [{rows[n]['results'][spec]['wire']:.3f}]"
                        for n in a.sizes)
        route = rows[a.sizes[-1]]["results"][spec]["routes"]
        lines.append(f"{spec:34s}{cells}  {route[0]}")
        print(lines[-1])
    # cost-model projection to N = 1024 for an 8-bit codec on the same model
    from hvd_ext.exchange import cost
    n_elem = rows[a.sizes[0]]["dense_bytes"] // 4
    proj = cost.project(n_elem, float(n_elem), [2, 4, 8, 16, 64, 256, 1024])
    out = {"machine": machine_info(), "sizes": a.sizes, "rows": {str(k): v for k, v in rows.items()},
           "projection_8bit": proj, "table": lines}
    write_json(Path(a.out), out)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(1, 2, figsize=(11, 4))
        Ns = [r["N"] for r in proj]
        for ex in ("allreduce", "allgather", "twophase"):
            ax[0].loglog(Ns, [r[f"{ex}_wire"] / (4 * n_elem) for r in proj], marker="o", label=ex)
            ax[1].loglog(Ns, [1e3 * r[f"{ex}_s"] for r in proj], marker="o", label=ex)
        ax[0].set_xlabel("ranks N"); ax[0].set_ylabel("wire bytes per rank / dense")
        ax[1].set_xlabel("ranks N"); ax[1].set_ylabel("predicted ms per bucket (10 Gbit/s, 50 us)")
        ax[0].set_title("8-bit codec, model projection"); ax[0].legend(); ax[1].legend()
        fig.tight_layout()
        fig.savefig(Path(a.out).with_suffix(".png"), dpi=90)
    except Exception as e:  # noqa: BLE001
        print(f"(no plot: {e})")
    print(f"\nwrote {a.out}")


if __name__ == "__main__":
    main()
