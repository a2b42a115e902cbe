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

Reference figures measured in the same run: ``memcpy`` (``copy_`` of the
gradient into an existing buffer of the same size: the physical limit of any
pass that reads and writes it) and ``fresh copy`` (``clone``: the same plus
mapping a new dense result, which every decode pays). The first (warm-up)
round of each method is reported as ``first s``: it includes compiling the
fused CPU kernels (``HVD_EXT_COMPILE``, see ``hvd_ext.ops.cpu_kernels``).
The previous figures are shown as ``before``: read from
``throughput_baseline.json`` (written once from the old ``throughput.json``),
or ``--baseline FILE``. The load average is recorded: re-run when it is high.

Writes benchmarks/results/throughput.{json,md}.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
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
    if comp.collective == "allgather":
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
    p.add_argument("--baseline", default=None, help="JSON of earlier figures (default: <out>_baseline.json)")
    common.add_load_option(p)
    a = p.parse_args(argv)
    common.refuse_if_loaded(a)
    out = Path(a.out)
    base_path = Path(a.baseline) if a.baseline else out.parent / (out.name + "_baseline.json")
    if not base_path.exists() and out.with_suffix(".json").exists() and not a.baseline:
        shutil.copyfile(out.with_suffix(".json"), base_path)  # keep the figures we are about to replace
    baseline = {}
    if base_path.exists():
        for r in json.loads(base_path.read_text()).get("rows", []):
            baseline[(r["method"], r["size"])] = r["gb_per_s"]
    if a.threads:
        torch.set_num_threads(a.threads)
    device = torch.device(a.device)
    rows = []
    for size in a.sizes:
        n = parse_size(size)
        side = int(n ** 0.5)
        grad = torch.distributions.Laplace(0.0, 1e-3).sample((n,)).to(device)
        grad2d = grad[: side * side].reshape(side, side)
        buf = torch.empty_like(grad)
        for ref, fn in (("memcpy", lambda: buf.copy_(grad)), ("fresh copy", lambda: grad.clone())):
            fn()
            times = []
            for _ in range(max(a.repeat, 5)):
                t0 = time.perf_counter()
                fn()
                if device.type == "cuda":
                    torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
            med = statistics.median(times)
            gbs = 4 * n / med / 1e9
            rows.append({"method": ref, "size": size, "numel": n, "seconds": med, "gb_per_s": gbs,
                         "payload_bytes": 4 * n, "bytes_vs_dense": 1.0, "reference": True})
            print(f"{ref:32s} {size:>5s}  {1e3 * med:9.1f} ms  {gbs:7.3f} GB/s  (reference)", flush=True)
        for spec in a.methods:
            comp = hvd_ext.compression_from_spec(spec)
            g = grad2d if comp.name == "powersgd" else grad
            times, nbytes, first = [], 0, 0.0
            step0 = comp.warmup_length()  # past the dense warm-up (powersgd: 100 exchanges)
            for rep in range(a.repeat + 1):
                dt, nbytes, _ = one_round(comp, g, step0 + rep, device)
                if rep:
                    times.append(dt)
                else:
                    first = dt
            med = statistics.median(times)
            gbs = 4 * g.numel() / med / 1e9
            before = baseline.get((spec, size))
            rows.append({"method": spec, "size": size, "numel": g.numel(), "seconds": med, "gb_per_s": gbs,
                         "payload_bytes": nbytes, "bytes_vs_dense": nbytes / (4 * g.numel()),
                         "first_seconds": first, "before_gb_per_s": before})
            print(f"{spec:32s} {size:>5s}  {1e3 * med:9.1f} ms  {gbs:7.3f} GB/s  payload {nbytes / (4 * g.numel()):.4f} "
                  f"of dense  (before {before if before is None else f'{before:.3f}'}; first round {first:.1f} s)",
                  flush=True)
            del comp
    doc = {"machine": common.machine_info(), "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
           "device": str(device), "threads": torch.get_num_threads(), "rows": rows,
           "loadavg": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
           "compile": os.environ.get("HVD_EXT_COMPILE", "auto"), "baseline": str(base_path),
           "argv": " ".join(sys.argv[1:] if argv is None else argv)}
    common.write_json(out.with_suffix(".json"), doc)
    out.with_suffix(".md").write_text(markdown(doc))
    print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.md')}")


def markdown(doc) -> str:
    rows = doc["rows"]
    sizes = list(dict.fromkeys(r["size"] for r in rows))
    methods = list(dict.fromkeys(r["method"] for r in rows))
    by = {(r["method"], r["size"]): r for r in rows}
    load = doc.get("loadavg")
    L = [f"### Compression throughput ({doc['device']}, {doc['threads']} threads; {doc['date']}"
         + (f"; load average {load[0]:.2f}" if load else "") + ")", "",
         "GB/s of float32 gradient processed by compress + decode-and-sum of 2 ranks (higher is better); "
         "`before`: the previous figures; `vs memcpy`: fraction of the memcpy bandwidth of the same run. "
         "`memcpy` copies the gradient into an existing buffer, `fresh copy` into a new one "
         "(what writing a fresh dense result costs). `first s`: seconds of the first (warm-up) round, "
         "which includes compiling the fused CPU kernels.", ""]
    head = "| method | " + " | ".join(f"{s} | {s} before | {s} vs memcpy" for s in sizes) + " | first s | payload / dense |"
    L += [head, "|---|" + "---|" * (3 * len(sizes) + 2)]
    for m in methods:
        cells = []
        for s in sizes:
            r = by.get((m, s))
            mem = by.get(("memcpy", s))
            if r is None:
                cells += ["", "", ""]
                continue
            b = r.get("before_gb_per_s")
            cells += [f"{r['gb_per_s']:.3f}", "" if b is None else f"{b:.3f}",
                      "" if (mem is None or r.get("reference")) else f"{r['gb_per_s'] / mem['gb_per_s']:.3f}"]
        first = max((by[(m, s)].get("first_seconds") or 0.0) for s in sizes if (m, s) in by)
        ratio = next((by[(m, s)]["bytes_vs_dense"] for s in sizes if (m, s) in by), None)
        L.append(f"| `{m}` | " + " | ".join(cells) + f" | {first:.1f} | {ratio:.4f} |")
    L += ["", "Command: `python benchmarks/throughput.py " + doc.get("argv", "") + "`", ""]
    return "\n".join(L)


if __name__ == "__main__":
    main()
