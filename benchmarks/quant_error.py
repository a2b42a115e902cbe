#!/usr/bin/env python
"""Quantization error at equal wire bits on real gradients of three workloads (thesis technique 5).

    python benchmarks/quant_error.py
    python benchmarks/quant_error.py --workloads cnn --bits 3 4

Workloads (all on MNIST-1D, generated locally, no download), each trained on one
process for ``--steps`` steps of batch 32 (SGD, momentum 0.9), capturing the
gradient of every parameter at several points of training:

* ``cnn``: the main job's 1-D CNN (``hvd_ext.examples.mnist1d.MNIST1DCNN``);
* ``transformer``: a 2-layer pre-norm transformer encoder over the 40 samples as
  tokens (width 64, 4 heads, learned positions, mean pooling), defined below;
* ``bnmlp``: an MLP 40-256-256-10 with BatchNorm after each hidden layer.

For each quantizer and bit width it compresses every captured layer (``--draws``
times: the rounding is stochastic) and reports the relative error
``sum ||Q(g) - g||^2 / sum ||g||^2`` over all layers and captures (dominated by
the layers with the largest gradients), the mean over layers of each layer's own
relative error, and the measured bits per element on the wire (payload bytes * 8
/ elements, headers included). QSGD is run with both norms and, for the max
norm (its strongest variant), at several bucket sizes, so that qdist is compared
with the best QSGD setting at no more wire bits.

Writes benchmarks/results/quant_error.{json,md}.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import common  # noqa: E402
from common import ROOT  # noqa: E402

import hvd_ext  # noqa: E402
from hvd_ext.compression.base import TensorInfo  # noqa: E402
from hvd_ext.examples.mnist1d import MNIST1DCNN, load_mnist1d  # noqa: E402

BITS = [2, 3, 4, 8]
QSGD_LINF_BUCKETS = [128, 256, 512, 1024]
QDIST_BUCKETS = [128, 256, 512]


def methods_for(b: int):
    out = [f"qdist:bits={b}"]  # bucket=256
    out += [f"qdist:bits={b},bucket={c}" for c in QDIST_BUCKETS if c != 256]
    out += [f"qdist:bits={b},dist=empirical", f"qdist:bits={b},bucket=0", f"qsgd:bits={b}"]
    out += [f"qsgd:bits={b},norm=linf" + (f",bucket={c}" if c != 512 else "") for c in QSGD_LINF_BUCKETS]
    if b == 2:
        out += ["terngrad", "terngrad:clip=0"]
    if b == 8:
        out.append("int8")
    return out


class TinyTransformer(nn.Module):
    """Pre-norm transformer encoder over the 40 samples of an MNIST-1D series as tokens."""

    def __init__(self, d=64, heads=4, layers=2, length=40, classes=10):
        super().__init__()
        self.embed = nn.Linear(1, d)
        self.pos = nn.Parameter(0.02 * torch.randn(length, d))
        layer = nn.TransformerEncoderLayer(d, heads, dim_feedforward=2 * d, dropout=0.0, batch_first=True,
                                           norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, classes)

    def forward(self, x):
        h = self.embed(x.unsqueeze(-1)) + self.pos
        return self.head(self.norm(self.encoder(h)).mean(1))


class BNMLP(nn.Module):
    def __init__(self, length=40, hidden=256, classes=10):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(length, hidden), nn.BatchNorm1d(hidden), nn.ReLU(),
                                 nn.Linear(hidden, hidden), nn.BatchNorm1d(hidden), nn.ReLU(),
                                 nn.Linear(hidden, classes))

    def forward(self, x):
        return self.net(x)


WORKLOADS = {
    "cnn": (MNIST1DCNN, 0.05),
    "transformer": (TinyTransformer, 0.02),
    "bnmlp": (BNMLP, 0.05),
}


def capture(steps, capture_at, seed=0, workload="cnn"):
    torch.manual_seed(seed)
    x, y, _, _ = load_mnist1d()
    make, lr = WORKLOADS[workload]
    model = make()
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
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


def measure(spec, grads, draws):
    comp = hvd_ext.compression_from_spec(spec)
    err, nbytes, per_layer = 0.0, 0, []
    numel = sum(g.numel() for _, g in grads)
    total_sq = 0.0
    for name, g in grads:
        gd = g.double()
        sq = float((gd ** 2).sum())
        total_sq += sq * draws
        e_layer = 0.0
        for d in range(draws):
            info = TensorInfo(name=name, shape=g.shape, step=d, rank=0, size=1)
            payload, ctx = comp.compress(g, info)
            dec = comp.decode(payload, ctx, info).reshape(g.shape)
            e_layer += float(((dec.double() - gd) ** 2).sum())
            if d == 0:
                nbytes += payload.numel()
        err += e_layer
        if sq > 0:
            per_layer.append(e_layer / (sq * draws))
    return {"rel_mse": err / total_sq, "layer_mean_rel_mse": sum(per_layer) / max(1, len(per_layer)),
            "bits_per_element": 8 * nbytes / numel}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--capture", type=int, nargs="*", default=[20, 200, 399])
    p.add_argument("--draws", type=int, default=3)
    p.add_argument("--workloads", nargs="*", default=list(WORKLOADS), choices=list(WORKLOADS))
    p.add_argument("--bits", type=int, nargs="*", default=BITS)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "quant_error"))
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    rows, workloads = [], {}
    for wl in a.workloads:
        grads = capture(a.steps, set(a.capture), workload=wl)
        workloads[wl] = {"tensors": len(grads), "elements": sum(g.numel() for _, g in grads)}
        for b in a.bits:
            for spec in methods_for(b):
                r = {"workload": wl, "bits": b, "method": spec, **measure(spec, grads, a.draws)}
                rows.append(r)
                print(f"{wl:11s} b={b} {spec:34s} rel MSE {r['rel_mse']:.4g} (layer mean {r['layer_mean_rel_mse']:.4g})"
                      f"  wire {r['bits_per_element']:.3f} bits/element", flush=True)
    doc = {"machine": common.machine_info(), "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
           "captures": a.capture, "steps": a.steps, "draws": a.draws, "workloads": workloads,
           "rows": rows, "summary": summary(rows)}
    out = Path(a.out)
    common.write_json(out.with_suffix(".json"), doc)
    out.with_suffix(".md").write_text(markdown(doc))
    print(markdown(doc))
    print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.md')}")


def summary(rows):
    """Per (workload, bits): qdist at its default bucket against the best QSGD (max norm) setting whose
    wire bits are no fewer than qdist's, and against the best one at any bucket size."""
    out = []
    for wl in dict.fromkeys(r["workload"] for r in rows):
        for b in dict.fromkeys(r["bits"] for r in rows if r["workload"] == wl):
            rs = [r for r in rows if r["workload"] == wl and r["bits"] == b]
            q = next(r for r in rs if r["method"] == f"qdist:bits={b}")
            linf = [r for r in rs if r["method"].startswith(f"qsgd:bits={b},norm=linf")]
            fair = [r for r in linf if r["bits_per_element"] >= q["bits_per_element"]]
            best_fair = min(fair, key=lambda r: r["rel_mse"]) if fair else None
            best_any = min(linf, key=lambda r: r["rel_mse"])
            others = [r for r in rs if not r["method"].startswith(("qdist", "qsgd"))
                      and r["bits_per_element"] <= q["bits_per_element"] + 0.1]
            out.append({"workload": wl, "bits": b, "qdist": q,
                        "qsgd_linf_same_or_more_bits": best_fair, "qsgd_linf_best_any_bucket": best_any,
                        "qdist_wins": best_fair is not None and q["rel_mse"] < best_fair["rel_mse"],
                        "others_at_these_bits": others})
    return out


def markdown(doc) -> str:
    wls = ", ".join(f"{k} ({v['tensors']} tensors, {v['elements']} elements)" for k, v in doc["workloads"].items())
    L = [f"### Quantization error on real gradients ({doc['date']})", "",
         f"Workloads: {wls}; gradients captured at steps {doc['captures']} of {doc['steps']}, "
         f"{doc['draws']} stochastic draws each. Relative error = sum ||Q(g)-g||^2 / sum ||g||^2 over all "
         "captured tensors (lower is better); layer mean = the mean of each tensor's own relative error; "
         "bits/element as measured on the wire, headers included.", "",
         "Summary: `qdist:bits=b` (per-bucket scales of 256, levels fitted per layer) against the best "
         "QSGD max-norm bucket setting with at least as many wire bits, and the best at any bucket size.", "",
         "| workload | bits | qdist rel MSE (bits/el) | best qsgd linf at >= bits | best qsgd linf, any bucket | qdist wins |",
         "|---|---|---|---|---|---|"]
    for s in doc["summary"]:
        q, f, a = s["qdist"], s["qsgd_linf_same_or_more_bits"], s["qsgd_linf_best_any_bucket"]
        fs = f"{f['rel_mse']:.4g} ({f['bits_per_element']:.3f}, `{f['method']}`)" if f else "-"
        L.append(f"| {s['workload']} | {s['bits']} | {q['rel_mse']:.4g} ({q['bits_per_element']:.3f}) | {fs} | "
                 f"{a['rel_mse']:.4g} ({a['bits_per_element']:.3f}, `{a['method']}`) | "
                 f"{'yes' if s['qdist_wins'] else 'NO'} |")
    L += ["", "All rows:", "",
          "| workload | bits | method | relative MSE | layer mean | bits/element on the wire |",
          "|---|---|---|---|---|---|"]
    for r in doc["rows"]:
        L.append(f"| {r['workload']} | {r['bits']} | `{r['method']}` | {r['rel_mse']:.4g} | "
                 f"{r['layer_mean_rel_mse']:.4g} | {r['bits_per_element']:.3f} |")
    L += ["", "Command: `python benchmarks/quant_error.py`", ""]
    return "\n".join(L)


if __name__ == "__main__":
    main()
