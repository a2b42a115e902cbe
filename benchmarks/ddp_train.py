#!/usr/bin/env python
"""PyTorch DDP (gloo) peer of scripts/train.py: same MNIST-1D CNN, data, sharding and schedule.

    torchrun --nproc_per_node 2 benchmarks/ddp_train.py --epochs 8 --json out.json
    torchrun --nproc_per_node 2 benchmarks/ddp_train.py --hook powersgd --rank 2 --json out.json

Same optimiser (SGD + momentum + weight decay, one-cycle LR), per-rank batch,
seed, data permutation and rank sharding as scripts/train.py, so the two can be
compared step for step. The JSON has the same keys as train.py's.

Measurement (both hooks run as Python DDP comm hooks so they can be measured the
same way; plain = torch's default ``allreduce_hook``):
  * bytes_sent_per_step: bytes of every tensor this rank passes to
    ``dist.all_reduce`` (counted by wrapping it) -- the payload, as hvd_ext counts it;
  * comm_wait_ms_per_step: time from the last bucket's hook call (local backward
    compute is done then) until ``loss.backward()`` returns (DDP has waited for
    the collective(s) and written the averaged gradients). For PowerSGD this
    includes the hook's own orthogonalisation/decompression between collectives.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hook", choices=["allreduce", "powersgd"], default="allreduce")
    p.add_argument("--rank", type=int, default=2, help="PowerSGD matrix approximation rank")
    p.add_argument("--start-iter", type=int, default=10,
                   help="PowerSGD start_powerSGD_iter (vanilla allreduce before; torch's default 1000 would "
                        "never compress in a short run; >= 2 with error feedback)")
    p.add_argument("--min-compression-rate", type=float, default=2.0, help="PowerSGD min_compression_rate")
    p.add_argument("--epochs", type=int, default=8)
    p.add_argument("--lr", type=float, default=0.2)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--weight-decay", type=float, default=5e-4)
    p.add_argument("--channels", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--bucket-mb", type=float, default=25.0, help="DDP bucket_cap_mb")
    p.add_argument("--json", default=None)
    p.add_argument("--log", default=None, help="per-step JSON-lines log (suffix .rankN added)")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--slow-rank", type=int, default=-1, help="make this rank slower (see --slow-factor)")
    p.add_argument("--slow-factor", type=float, default=1.0,
                   help="the slow rank sleeps (F-1) x its forward+backward compute time each step (as train.py)")
    a = p.parse_args(argv)
    if a.slow_factor < 1.0:
        p.error("--slow-factor must be >= 1")
    if a.hook == "powersgd" and a.start_iter < 2:
        p.error("--start-iter must be >= 2 (PowerSGD with error feedback / warm start)")
    for name in ("epochs", "batch", "channels", "threads", "rank"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    return a


class _Meter:
    """Counts bytes passed to dist.all_reduce and remembers when a comm hook last ran."""

    def __init__(self):
        self.bytes = 0
        self.last_hook_t = None

    def install(self):
        orig = dist.all_reduce

        def counting_all_reduce(tensor, *args, **kwargs):
            self.bytes += tensor.numel() * tensor.element_size()
            return orig(tensor, *args, **kwargs)

        dist.all_reduce = counting_all_reduce  # the hooks look it up as dist.all_reduce at call time

    def wrap(self, hook):
        def timed_hook(state, bucket):
            self.last_hook_t = time.perf_counter()
            return hook(state, bucket)

        return timed_hook


def main(argv=None):
    a = parse_args(argv)
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
    from torch.nn.parallel import DistributedDataParallel as DDP

    from hvd_ext.examples.mnist1d import MNIST1DCNN, accuracy, load_mnist1d

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", timeout=timedelta(seconds=600))
    torch.set_num_threads(a.threads)
    rank, size = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        load_mnist1d()
    dist.barrier()
    x_train, y_train, x_test, y_test = load_mnist1d()

    torch.manual_seed(a.seed)
    model = MNIST1DCNN(a.channels)
    dense_bytes = sum(p.numel() * 4 for p in model.parameters() if p.requires_grad)
    ddp = DDP(model, bucket_cap_mb=a.bucket_mb)
    meter = _Meter()
    meter.install()
    if a.hook == "powersgd":
        state = psgd.PowerSGDState(process_group=None, matrix_approximation_rank=a.rank,
                                   start_powerSGD_iter=a.start_iter, min_compression_rate=a.min_compression_rate,
                                   use_error_feedback=True, warm_start=True, random_seed=a.seed)
        ddp.register_comm_hook(state, meter.wrap(psgd.powerSGD_hook))
        spec = f"ddp-powersgd:rank={a.rank},start={a.start_iter}"
    else:
        ddp.register_comm_hook(None, meter.wrap(default_hooks.allreduce_hook))
        spec = "ddp"

    opt = torch.optim.SGD(ddp.parameters(), lr=a.lr, momentum=a.momentum, weight_decay=a.weight_decay)
    steps_per_epoch = len(x_train) // (a.batch * size)
    total_steps = steps_per_epoch * a.epochs
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=a.lr, total_steps=total_steps)

    bar = None
    if rank == 0 and not a.no_progress:
        try:
            from tqdm import tqdm

            bar = tqdm(total=total_steps, desc=f"train {spec}", unit="step", leave=False, mininterval=2.0,
                       file=sys.stderr)
        except ImportError:
            pass
    log = open(f"{a.log}.rank{rank}", "a") if a.log else None

    gen = torch.Generator().manual_seed(a.seed)
    history = []
    train_time = 0.0
    wait_s = 0.0
    total_bytes = 0
    loss_val = float("nan")
    step = 0
    slow = rank == a.slow_rank and a.slow_factor > 1.0
    for epoch in range(a.epochs):
        perm = torch.randperm(len(x_train), generator=gen)
        t_epoch = time.perf_counter()
        for i in range(steps_per_epoch):
            idx = perm[(i * size + rank) * a.batch:(i * size + rank + 1) * a.batch]
            t_compute = time.perf_counter()
            opt.zero_grad()
            loss = F.cross_entropy(ddp(x_train[idx]), y_train[idx])
            b0 = meter.bytes
            meter.last_hook_t = None
            loss.backward()
            t_done = time.perf_counter()
            w = t_done - meter.last_hook_t if meter.last_hook_t is not None else 0.0
            sent = meter.bytes - b0
            if slow:  # compute ended when the last bucket's hook ran
                time.sleep((a.slow_factor - 1.0) * ((meter.last_hook_t or t_done) - t_compute))
            wait_s += w
            total_bytes += sent
            opt.step()
            sched.step()
            loss_val = loss.item()
            step += 1
            if log is not None:
                log.write(json.dumps({"step": step, "bytes_sent": sent, "comm_wait_s": w}) + "\n")
                log.flush()
            if bar is not None:
                bar.update(1)
        train_time += time.perf_counter() - t_epoch
        acc = accuracy(model, x_test, y_test)
        history.append({"epoch": epoch + 1, "test_acc": acc, "train_time_s": train_time, "loss": loss_val})
    if bar is not None:
        bar.close()
    if log is not None:
        log.close()

    vec = torch.tensor([total_bytes / total_steps, 1e3 * wait_s / total_steps], dtype=torch.float64)
    dist.all_reduce(vec)
    vec /= size
    final_acc = history[-1]["test_acc"]
    result = {
        "compression": spec,
        "framework": "pytorch-ddp",
        "ranks": size,
        "epochs": a.epochs,
        "steps": total_steps,
        "test_acc": final_acc,
        "bytes_sent_per_step": vec[0].item(),
        "dense_bytes_per_step": dense_bytes,
        "bytes_ratio_vs_dense": vec[0].item() / dense_bytes,
        "ms_per_step": 1e3 * train_time / total_steps,
        "comm_wait_ms_per_step": vec[1].item(),
        "exchanges": float(total_steps),
        "train_time_s": train_time,
        "history": history,
        "slow_rank": a.slow_rank if a.slow_factor > 1.0 else None,
        "slow_factor": a.slow_factor,
    }
    if a.hook == "powersgd":
        result["powersgd"] = {"rank": a.rank, "start_powerSGD_iter": a.start_iter,
                              "min_compression_rate": a.min_compression_rate, "error_feedback": True,
                              "warm_start": True}
    if rank == 0:
        print(f"method                {spec}")
        print(f"ranks x epochs        {size} x {a.epochs} ({total_steps} steps)")
        print(f"test accuracy         {100 * final_acc:.2f}%")
        print(f"bytes sent per step   {result['bytes_sent_per_step']:.0f} "
              f"({result['bytes_ratio_vs_dense']:.4f} of dense fp32 {dense_bytes})")
        print(f"ms per step           {result['ms_per_step']:.2f}")
        print(f"comm wait ms per step {result['comm_wait_ms_per_step']:.2f}")
        if a.json:
            Path(a.json).parent.mkdir(parents=True, exist_ok=True)
            with open(a.json, "w") as f:
                json.dump(result, f, indent=1)
    dist.destroy_process_group()
    return result


if __name__ == "__main__":
    main()
