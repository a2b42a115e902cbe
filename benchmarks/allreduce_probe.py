#!/usr/bin/env python
"""Measure allreduce bandwidth of N local ranks over TCP/gloo on 127.0.0.1.

    scripts/shaped-cluster --rate 100mbit -- python benchmarks/allreduce_probe.py --mbytes 4

Prints one JSON line. With one tc tbf on the shared loopback every byte any
rank sends passes the same shaper, so the figure compared with the configured
rate is the *aggregate* wire rate: bytes all ranks sent / time. A ring
allreduce of S bytes makes each of N ranks send 2(N-1)/N * S bytes.
"""
import argparse
import json
import os
import socket
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _worker(rank, size, port, numel, iters, q):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=size)
    t = torch.ones(numel)
    dist.all_reduce(t)  # warm-up: connections and the tbf bucket
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(t)
    dt = time.perf_counter() - t0
    ok = bool(torch.allclose(t[:4], torch.full((4,), float(size ** (iters + 1)))))
    if rank == 0:
        q.put((dt, ok))
    dist.destroy_process_group()


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--mbytes", type=float, default=4.0, help="allreduce size (MiB of fp32)")
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--ranks", type=int, default=2)
    a = p.parse_args(argv)
    numel = int(a.mbytes * 2**20) // 4
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, a.ranks, port, numel, a.iters, q)) for r in range(a.ranks)]
    for pr in procs:
        pr.start()
    dt, ok = q.get(timeout=300)
    for pr in procs:
        pr.join()
    n = a.ranks
    per_rank = 2 * (n - 1) / n * numel * 4 * a.iters
    print(json.dumps({"ranks": n, "bytes_per_allreduce": numel * 4, "iters": a.iters, "seconds": dt,
                      "correct": ok, "aggregate_mbit_s": per_rank * n * 8 / dt / 1e6,
                      "per_rank_mbit_s": per_rank * 8 / dt / 1e6,
                      "algo_mbit_s": numel * 4 * a.iters * 8 / dt / 1e6}))


if __name__ == "__main__":
    main()
