#!/usr/bin/env python
"""Compression throughput: GB/s of gradient a compressor processes (compress + decode-and-sum).

    python benchmarks/throughput.py                       # 1M, 16M, 64M floats, every method below
    python benchmarks/throughput.py --sizes 1M --methods topk:ratio=0.01 qdist:bits=3

For each method and size: one rank's compress of a float32 gradient of that
size, then ``aggregate`` of two ranks' payloads (the decode-and-average every
rank does after the allgather; for allreduce codecs, compress + decompress).
GB/s = gradient bytes (4 * n) / (compress + aggregate seconds), median of
``--repeat`` runs after one warm-up. The gradient is Laplace-distributed (heavy
tails, like real gradients). Runs on CPU here (torch reference paths); on a
CUDA machine pass ``--device cuda`` to time the kernel paths.

Writes benchmarks/results/throughput.{json,md}.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import common  # noqa: E402
from common import ROOT  # noqa: E402

import hvd_ext  # noqa: E402
from hvd_ext.compression.base import Continue, TensorInfo  # noqa: E402

METHODS = ["none", "fp16", "randomk:ratio=0.01", "topk:ratio=0.01", "topk:ratio=0.01,mode=sampled",
           "dgc:ratio=0.01", "threshold:tau=0.01", "sig:ratio=0.01", "qsgd:bits=8", "qsgd:bits=4", "terngrad",
           "signsgd", "efsignsgd", "onebit", "natural", "int8", "qdist:bits=3", "powersgd:rank=2"]


def parse_size(s: str) -> int:
    s = s.strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(s[-1], 1)
    return int(float(s[:-1] if s[-1] in "KMG" else s) * mult)


def one_round(comp, grad, step, device):
    shape = grad.shape
    infos = [TensorInfo(name="g", shape=shape, step=step, rank=r, size=2) for r in range(2)]
    for i in infos:
        i.scale = 0.5
    t0 = time.perf_counter()
    payload, ctx = comp.compress(grad, infos[0])
    if comp.exchange == "allgather":
        other = payload  # the second rank's payload: same size, decoding cost is what matters
        out = comp.aggregate([payload, other], ctx, infos[0])
    else:
        out = comp.decompress(payload, ctx, infos[0])
        while isinstance(out, Continue):
            out = comp.decompress(out.payload, out.ctx, infos[0])
    if device.type == "cuda":
        torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    nbytes = payload.numel() * payload.element_size()
    return dt, nbytes, out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", nargs="*", default=["1M", "16M", "64M"])
    p.add_argument("--methods", nargs="*", default=METHODS)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "throughput"))
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    device = torch.device(a.device)
    rows = []
    for size in a.sizes:
        n = parse_size(size)
        side = int(n ** 0.5)
        grad = torch.distributions.Laplace(0.0, 1e-3).sample((n,)).to(device)
        grad2d = grad[: side * side].reshape(side, side)
        for spec in a.methods:
            comp = hvd_ext.compression_from_spec(spec)
            g = grad2d if comp.name == "powersgd" else grad
            times, nbytes = [], 0
            for rep in range(a.repeat + 1):
                dt, nbytes, _ = one_round(comp, g, rep, device)
                if rep:
                    times.append(dt)
            med = statistics.median(times)
            gbs = 4 * g.numel() / med / 1e9
            rows.append({"method": spec, "size": size, "numel": g.numel(), "seconds": med, "gb_per_s": gbs,
                         "payload_bytes": nbytes, "bytes_vs_dense": nbytes / (4 * g.numel())})
            print(f"{spec:32s} {size:>5s}  {1e3 * med:9.1f} ms  {gbs:7.3f} GB/s  payload {nbytes / (4 * g.numel()):.4f} "
                  f"of dense", flush=True)
            del comp
    doc = {"machine": common.machine_info(), "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
           "device": str(device), "threads": torch.get_num_threads(), "rows": rows}
    out = Path(a.out)
    common.write_json(out.with_suffix(".json"), doc)
    out.with_suffix(".md").write_text(markdown(doc))
    print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.md')}")


def markdown(doc) -> str:
    sizes = list(dict.fromkeys(r["size"] for r in doc["rows"]))
    methods = list(dict.fromkeys(r["method"] for r in doc["rows"]))
    by = {(r["method"], r["size"]): r for r in doc["rows"]}
    L = [f"### Compression throughput ({doc['device']}, {doc['threads']} threads; {doc['date']})", "",
         "GB/s of float32 gradient processed by compress + decode-and-sum of 2 ranks (higher is better).", "",
         "| method | " + " | ".join(sizes) + " | payload / dense |", "|---|" + "---|" * (len(sizes) + 1)]
    for m in methods:
        cells = [f"{by[(m, s)]['gb_per_s']:.3f}" if (m, s) in by else "" for s in sizes]
        ratio = next((by[(m, s)]["bytes_vs_dense"] for s in sizes if (m, s) in by), None)
        L.append(f"| `{m}` | " + " | ".join(cells) + f" | {ratio:.4f} |")
    L += ["", "Command: `python benchmarks/throughput.py`", ""]
    return "\n".join(L)


if __name__ == "__main__":
    main()
