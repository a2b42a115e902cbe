#!/usr/bin/env python
"""Quantization error at equal bits on real gradients of the MNIST-1D CNN (thesis technique 5).

    python benchmarks/quant_error.py

Trains the main job's CNN on one process for a few hundred steps and captures
the gradient of every layer at several points of training. For each quantizer
and bit width it compresses every captured layer (``--draws`` times: the
rounding is stochastic) and reports the relative error
``sum ||Q(g) - g||^2 / sum ||g||^2`` over all layers and captures, and the
measured bits per element on the wire (payload bytes * 8 / elements, headers
included).

Writes benchmarks/results/quant_error.{json,md}.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import common  # noqa: E402
from common import ROOT  # noqa: E402

import hvd_ext  # noqa: E402
from hvd_ext.compression.base import TensorInfo  # noqa: E402
from hvd_ext.examples.mnist1d import MNIST1DCNN, load_mnist1d  # noqa: E402

BITS = [2, 3, 4, 8]


def methods_for(b: int):
    out = [f"qdist:bits={b}", f"qdist:bits={b},dist=empirical", f"qsgd:bits={b}", f"qsgd:bits={b},norm=linf"]
    if b == 2:
        out.append("terngrad")
    if b == 8:
        out.append("int8")
    return out


def capture(steps, capture_at, seed=0):
    torch.manual_seed(seed)
    x, y, _, _ = load_mnist1d()
    model = MNIST1DCNN()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    g = torch.Generator().manual_seed(seed)
    grads = []
    for step in range(steps):
        idx = torch.randint(0, len(x), (32,), generator=g)
        opt.zero_grad()
        F.cross_entropy(model(x[idx]), y[idx]).backward()
        if step in capture_at:
            grads += [(f"{n}@{step}", p.grad.detach().clone()) for n, p in model.named_parameters()]
        opt.step()
    return grads


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--capture", type=int, nargs="*", default=[20, 200, 399])
    p.add_argument("--draws", type=int, default=3)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "quant_error"))
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    grads = capture(a.steps, set(a.capture))
    total_sq = sum(float((g.double() ** 2).sum()) for _, g in grads) * a.draws
    numel = sum(g.numel() for _, g in grads)
    rows = []
    for b in BITS:
        for spec in methods_for(b):
            comp = hvd_ext.compression_from_spec(spec)
            err, nbytes = 0.0, 0
            for d in range(a.draws):
                for name, g in grads:
                    info = TensorInfo(name=name, shape=g.shape, step=d, rank=0, size=1)
                    payload, ctx = comp.compress(g, info)
                    dec = comp.decode(payload, ctx, info).reshape(g.shape)
                    err += float(((dec.double() - g.double()) ** 2).sum())
                    if d == 0:
                        nbytes += payload.numel()
            rows.append({"bits": b, "method": spec, "rel_mse": err / total_sq, "bits_per_element": 8 * nbytes / numel})
            print(f"b={b} {spec:32s} rel MSE {err / total_sq:.4g}  wire {8 * nbytes / numel:.3f} bits/element",
                  flush=True)
    doc = {"machine": common.machine_info(), "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
           "captures": a.capture, "tensors": len(grads), "elements": numel, "draws": a.draws, "rows": rows}
    out = Path(a.out)
    common.write_json(out.with_suffix(".json"), doc)
    out.with_suffix(".md").write_text(markdown(doc))
    print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.md')}")


def markdown(doc) -> str:
    L = [f"### Quantization error on real MNIST-1D CNN gradients ({doc['date']})", "",
         f"{doc['tensors']} layer gradients captured at steps {doc['captures']} ({doc['elements']} elements), "
         f"{doc['draws']} stochastic draws each. Relative error = sum ||Q(g)-g||^2 / sum ||g||^2 (lower is better); "
         "bits/element as measured on the wire, headers included.", "",
         "| bits | method | relative MSE | bits/element on the wire |", "|---|---|---|---|"]
    for r in doc["rows"]:
        L.append(f"| {r['bits']} | `{r['method']}` | {r['rel_mse']:.4g} | {r['bits_per_element']:.3f} |")
    L += ["", "Command: `python benchmarks/quant_error.py`", ""]
    return "\n".join(L)


if __name__ == "__main__":
    main()
