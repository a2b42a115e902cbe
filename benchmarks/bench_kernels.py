"""Throughput of the hvd_ext compression kernels against torch on the same device.

    python benchmarks/bench_kernels.py                  # 1M, 16M, 64M, 256M floats on CUDA
    python benchmarks/bench_kernels.py --quick          # 1M, 16M (CUDA) / 1M (CPU)
    python benchmarks/bench_kernels.py --sizes 4,64 --ratio 0.01 --bits 4 --ranks 4

For every size n (in millions of float32): GB/s of each CUDA kernel and of its
torch counterpart (torch.topk for selection, the torch reference implementations
in hvd_ext.ops.cuda_kernels for the rest), and each as a fraction of the measured
device-to-device copy bandwidth (y.copy_(x): 8n bytes moved). GB/s counts the
minimum traffic of the operation (every input byte read once, every output byte
written once), in 1e9 bytes per second; "speedup" = torch time / kernel time.

Without a CUDA device (or without CuPy) only the torch reference implementations
run, at small sizes (default 1M and 4M floats), and the output says so.

Writes <out>.json and <out>.md (default benchmarks/results/bench_kernels.*) and prints the table.
"""
from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from hvd_ext.ops import cuda_kernels as K  # noqa: E402


def _timer(device):
    if device.type == "cuda":
        def run(fn, repeat):
            fn()                                   # warm-up (compiles the kernel the first time)
            torch.cuda.synchronize(device)
            ts = []
            for _ in range(repeat):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                fn()
                b.record()
                b.synchronize()
                ts.append(a.elapsed_time(b) / 1e3)
            return statistics.median(ts)
    else:
        def run(fn, repeat):
            fn()
            ts = []
            for _ in range(repeat):
                t0 = time.perf_counter()
                fn()
                ts.append(time.perf_counter() - t0)
            return statistics.median(ts)
    return run


def bench_size(n, device, args, timer, kernels_on):
    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(n, generator=g).to(device)
    rows = []
    copy_dst = torch.empty_like(x)
    t_copy = timer(lambda: copy_dst.copy_(x), args.repeat)
    copy_gbs = 8 * n / t_copy / 1e9
    del copy_dst

    def add(name, nbytes, t_kernel, t_torch, torch_name):
        rows.append({
            "n": n, "op": name, "bytes": nbytes, "torch_op": torch_name,
            "kernel_s": t_kernel, "torch_s": t_torch,
            "kernel_GBs": nbytes / t_kernel / 1e9 if t_kernel else None,
            "torch_GBs": nbytes / t_torch / 1e9 if t_torch else None,
            "kernel_frac_copy": (nbytes / t_kernel / 1e9) / copy_gbs if t_kernel else None,
            "torch_frac_copy": (nbytes / t_torch / 1e9) / copy_gbs if t_torch else None,
            "speedup": (t_torch / t_kernel) if (t_kernel and t_torch) else None,
        })

    def both(fn_kernel, fn_torch):
        tk = None
        if kernels_on:
            K.use_reference(False)
            tk = timer(fn_kernel, args.repeat)
        K.use_reference(True)
        try:
            tt = timer(fn_torch, args.repeat)
        finally:
            K.use_reference(False)
        return tk, tt

    # selection of ratio*n coordinates: our histogram threshold (one count read) vs torch.topk (exact)
    k = max(1, int(args.ratio * n))
    tk, tt = both(lambda: K.select_threshold(x, k), lambda: torch.topk(x.abs(), k, sorted=False))
    add(f"select {args.ratio:g}", 4 * n + 8 * k, tk, tt, "torch.topk(abs(x))")
    if not kernels_on:   # also the torch reference of the histogram selection
        tr = timer(lambda: K.select_threshold_reference(x, k), args.repeat)
        add(f"select {args.ratio:g} (reference)", 4 * n + 8 * k, None, tr, "select_threshold_reference")

    bits, N = args.bits, args.ranks
    L = 2 ** bits
    levels = torch.linspace(-1, 1, L, device=device)
    scale = float(x.abs().max())
    nb = K.packed_nbytes(n, bits)
    tk, tt = both(lambda: K.quantize_pack(x, levels, scale, bits, 1, 2),
                  lambda: K.quantize_pack_reference(x, levels, scale, bits, 1, 2))
    add(f"quantize_pack b={bits}", 4 * n + nb, tk, tt, "torch reference")

    datas = [K.quantize_pack(x, levels, scale, bits, r, 2) for r in range(N)]
    out = torch.zeros(n, device=device)
    tk, tt = both(lambda: K.unpack_dequantize_accumulate(out, datas, levels, [scale] * N, bits, n),
                  lambda: K.unpack_dequantize_accumulate_reference(out, datas, levels, [scale] * N, bits, n))
    add(f"unpack_dequant_acc b={bits} N={N}", N * nb + 8 * n, tk, tt, "torch reference")
    del datas

    codes = torch.randint(0, L, (n,), device=device, dtype=torch.int32).to(torch.uint8)
    tk, tt = both(lambda: K.pack_bits(codes, bits), lambda: K.pack_bits_reference(codes, bits))
    add(f"pack_bits b={bits}", n + nb, tk, tt, "torch reference")
    packed = K.pack_bits(codes, bits)
    tk, tt = both(lambda: K.unpack_bits(packed, bits, n), lambda: K.unpack_bits_reference(packed, bits, n))
    add(f"unpack_bits b={bits}", n + nb, tk, tt, "torch reference")
    del codes, packed

    tk, tt = both(lambda: K.sign_pack(x), lambda: K.sign_pack_reference(x))
    add("sign_pack", 4 * n + (n + 7) // 8, tk, tt, "torch reference")
    signs = [K.sign_pack(x * (1 if r % 2 else -1)) for r in range(N)]
    tk, tt = both(lambda: K.majority_vote(signs, n), lambda: K.majority_vote_reference(signs, n))
    add(f"majority_vote N={N}", N * ((n + 7) // 8) + 4 * n, tk, tt, "torch reference")
    del signs

    idxs = [torch.randperm(n, device=device)[:k].sort().values.to(torch.int32) for _ in range(N)]
    vals = [torch.randn(k, device=device) for _ in range(N)]
    tk, tt = both(lambda: K.sparse_scatter_add(out, idxs, vals, 1.0 / N),
                  lambda: K.sparse_scatter_add_reference(out, idxs, vals, 1.0 / N))
    add(f"sparse_scatter_add N={N} k={args.ratio:g}n", N * 8 * k + 8 * N * k, tk, tt, "index_add_")
    del idxs, vals

    mem = torch.empty_like(x)
    y = torch.randn(n, generator=g).to(device)
    tk, tt = both(lambda: K.residual_update(mem, x, y), lambda: K.residual_update_reference(mem, x, y))
    add("residual_update", 12 * n, tk, tt, "torch u - sent")
    mask = x > 1.0
    tk, tt = both(lambda: K.ewma_update(mem, y, mask, 0.9), lambda: K.ewma_update_reference(mem, y, mask, 0.9))
    add("ewma_update", 13 * n, tk, tt, "torch where")
    return rows, copy_gbs


def markdown(result):
    lines = [f"# hvd_ext kernel benchmark ({result['date']})", "",
             f"Device: {result['device_name']} ({result['device']}); torch {result['torch']}; "
             f"cupy {result['cupy']}.", ""]
    if result["note"]:
        lines += [f"**{result['note']}**", ""]
    lines += ["GB/s = minimum bytes read+written / time; frac = fraction of measured device-to-device "
              "copy bandwidth; speedup = torch time / kernel time.", ""]
    lines += ["| n | op | kernel GB/s | kernel frac | torch op | torch GB/s | torch frac | speedup |",
              "|---|---|---|---|---|---|---|---|"]

    def f(v, fmt):
        return "-" if v is None else format(v, fmt)
    for size in result["sizes"]:
        n = size["n"]
        lines.append(f"| {n/2**20:g}M | copy (d2d) | {size['copy_GBs']:.1f} | 1.00 | | | | |")
        for r in size["rows"]:
            lines.append(f"| {n/2**20:g}M | {r['op']} | {f(r['kernel_GBs'], '.1f')} | {f(r['kernel_frac_copy'], '.2f')} "
                         f"| {r['torch_op']} | {f(r['torch_GBs'], '.2f')} | {f(r['torch_frac_copy'], '.3f')} "
                         f"| {f(r['speedup'], '.1f')} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default=None, help="comma-separated sizes in millions (2^20) of floats")
    ap.add_argument("--quick", action="store_true", help="small sizes only")
    ap.add_argument("--device", default="auto", help="auto, cuda, cuda:N or cpu")
    ap.add_argument("--ratio", type=float, default=0.01, help="fraction selected (default 0.01)")
    ap.add_argument("--bits", type=int, default=4, help="bits per code for quantize/pack (default 4)")
    ap.add_argument("--ranks", type=int, default=4, help="ranks decoded by the N-rank kernels (default 4)")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "bench_kernels"),
                    help="output path without extension (.json and .md are written)")
    args = ap.parse_args(argv)

    if args.device == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        device = torch.device(args.device)
    kernels_on = device.type == "cuda" and K.backend(torch.zeros(1, device=device)) == "cuda"
    if args.sizes:
        sizes = [float(s) for s in args.sizes.split(",")]
    elif device.type == "cuda":
        sizes = [1, 16] if args.quick else [1, 16, 64, 256]
    else:
        sizes = [1] if args.quick else [1, 4]
    note = ""
    if not kernels_on:
        why = "no CUDA device" if device.type != "cuda" else "CuPy not importable"
        note = (f"{why}: CUDA kernels NOT measured; only the torch reference implementations "
                f"(and torch.topk) ran on {device}, at small sizes.")
        print(note)
    try:
        import cupy
        cupy_v = cupy.__version__
    except Exception:
        cupy_v = "not available"
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else (platform.processor() or "cpu")
    timer = _timer(device)
    result = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "device": str(device),
              "device_name": name, "torch": torch.__version__, "cupy": cupy_v, "kernels_measured": kernels_on,
              "note": note, "args": vars(args), "sizes": []}
    for s in sizes:
        n = int(s * 2 ** 20)
        print(f"n = {s:g}M floats ...", flush=True)
        rows, copy_gbs = bench_size(n, device, args, timer, kernels_on)
        result["sizes"].append({"n": n, "copy_GBs": copy_gbs, "rows": rows})
        if device.type == "cuda":
            torch.cuda.empty_cache()
    md = markdown(result)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1))
    out.with_suffix(".md").write_text(md)
    print(md)
    print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.md')}")
    return result


if __name__ == "__main__":
    main()
