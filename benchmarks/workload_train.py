#!/usr/bin/env python
"""Per-rank trainer for the benchmark workloads (hvd_ext/examples/workloads.py).

    horovodrun -np 2 --gloo python benchmarks/workload_train.py --workload resnet --compression topk:ratio=0.01
    mpirun -np 2 python benchmarks/workload_train.py --workload mnist1d-noniid-slow --sync event

Same training loop as the main job (scripts/train.py: SGD or AdamW, one-cycle
schedule, hvd_ext.DistributedOptimizer or ``--plain-horovod``, ``--sync`` strategies)
on any workload, with optional non-IID label-skewed shards (``--skew``) and a slow
rank or several (``--slow-rank 1`` or ``1,3``, ``--slow-factor``: after its forward+backward a slow rank
sleeps (factor-1) x that compute time). At every epoch end rank 0 evaluates (the
clock stops meanwhile) and records the metric and its cumulative training seconds:

* synchronous methods and local/adaptive SGD: rank 0's current model; with
  BatchNorm the running statistics are first averaged over the ranks
  (``hvd_ext.sync.average_buffers``, a Horovod user's recipe), and their spread
  before averaging is recorded (``buffer_spread``, relative);
* ``event`` (asynchronous): the parameter server's current z, read one-sided
  (no collective, the other ranks keep computing).

The budget is the same total number of samples for every method: epochs x steps
per epoch x ranks batches. Synchronous methods and local/adaptive SGD reach it with
every rank taking the same number of steps (a fast rank waits at each exchange). The
asynchronous ``event`` strategy reaches it with each rank stepping until the ranks'
steps together (``EventTriggeredSGD.global_steps()``, read one-sided from the board)
reach the budget: a fast rank takes more steps instead of waiting, and the one-cycle
schedule follows that global progress, so all ranks sit at the same point of it at
the same time. ``adaptive:balance=1`` runs on the same budget (``AdaptiveSync.set_budget``):
its ranks take local steps in proportion to their speed and stop at the same sync. After ``sync.finish()`` all ranks hold the same model, which is
evaluated once more (the final point, at the time the last rank finished). ``--json
OUT`` writes the summary (rank 0).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import torch  # noqa: E402


def rank_list(text: str):
    """'1' or '1,3' -> (1,) or (1, 3)."""
    try:
        ranks = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"--slow-rank takes rank numbers separated by commas, got {text!r}")
    if not ranks or min(ranks) < 0:
        raise argparse.ArgumentTypeError(f"--slow-rank takes ranks >= 0, got {text!r}")
    return ranks


def parse_args(argv=None):
    from hvd_ext.examples.workloads import WORKLOADS

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", required=True, choices=list(WORKLOADS))
    p.add_argument("--compression", default="none")
    p.add_argument("--plain-horovod", action="store_true", help="horovod.torch.DistributedOptimizer itself")
    p.add_argument("--sync", default="every")
    p.add_argument("--epochs", type=int, default=None, help="default: the workload's")
    p.add_argument("--lr", type=float, default=None, help="peak learning rate; default: the workload's")
    p.add_argument("--batch", type=int, default=None, help="samples per rank per step; default: the workload's")
    p.add_argument("--skew", type=float, default=None, help="label skew of the shards (default: the workload's)")
    p.add_argument("--slow-rank", type=rank_list, default=None,
                   help="the slow rank(s), a comma list: 1 or 1,3 (default: the workload's)")
    p.add_argument("--slow-factor", type=float, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    if a.plain_horovod and (a.compression not in ("none", "fp16") or a.sync != "every"):
        p.error("--plain-horovod: --compression none|fp16 and --sync every only")
    return a


def main(argv=None):
    a = parse_args(argv)
    import horovod.torch as hvd

    import hvd_ext
    from hvd_ext.examples.workloads import get_workload, label_histogram, label_skew_shards, text_corpus
    from hvd_ext.sync import average_buffers, buffer_spread
    from hvd_ext.sync._common import FlatState

    w = get_workload(a.workload)
    for k in ("epochs", "lr", "batch", "skew", "slow_rank", "slow_factor"):
        if getattr(a, k) is not None:
            setattr(w, k, getattr(a, k))
    compressor = hvd_ext.compression_from_spec(a.compression)
    sync_factory = hvd_ext.sync_from_spec(a.sync)
    hvd_ext.sync.init_horovod(sync_factory.needs_mpi, f"--sync {a.sync}")
    torch.set_num_threads(a.threads)
    rank, size = hvd.rank(), hvd.size()
    if rank == 0:
        w.load()  # generate/cache once
    hvd.barrier()
    x_train, y_train, x_test, y_test = w.load()
    corpus = text_corpus()[2] if a.workload == "lm" else None

    # shards: IID = a fresh global permutation per epoch, strided over ranks (as the main job);
    # non-IID = fixed label-skewed shards, each permuted per epoch
    shards = None
    if w.skew is not None and y_train.dim() == 1:
        shards = label_skew_shards(y_train, size, w.skew, seed=a.seed)
        steps_per_epoch = min(len(s) for s in shards) // w.batch
    else:
        steps_per_epoch = len(x_train) // (w.batch * size)
    total_steps = steps_per_epoch * w.epochs

    torch.manual_seed(a.seed)
    model = w.model()
    if w.optimizer == "adamw":
        opt = torch.optim.AdamW(model.parameters(), lr=w.lr, weight_decay=w.weight_decay)
        cycle = False
    else:
        opt = torch.optim.SGD(model.parameters(), lr=w.lr, momentum=0.9, weight_decay=w.weight_decay)
        cycle = True
    if a.plain_horovod:
        from train import plain_horovod_optimizer  # scripts/train.py: Horovod's own optimizer + our stats

        opt = plain_horovod_optimizer(hvd, opt, model, a.compression, None)
    else:
        opt = hvd_ext.DistributedOptimizer(opt, named_parameters=model.named_parameters(), compression=compressor)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    opt.stats.reset()
    sync = sync_factory(opt, model)
    is_async = sync_factory.name == "event"
    budgeted = is_async or getattr(sync, "balance", False)  # the ranks take different numbers of steps
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=w.lr, total_steps=total_steps, cycle_momentum=cycle)
    budget = size * total_steps  # batches, all ranks together: the same for every method
    if budgeted and hasattr(sync, "set_budget"):
        sync.set_budget(budget)
    schedule = hvd_ext.sync.GlobalOneCycle(opt, w.lr, cycle) if budgeted else None
    has_bn = any(b.is_floating_point() for b in model.buffers())
    flat = FlatState(model, opt, buffers=False, momentum=False)
    slow_ranks = w.slow_rank if isinstance(w.slow_rank, tuple) else (w.slow_rank,)
    slow = rank in slow_ranks and w.slow_factor > 1.0

    def evaluate() -> float:
        if is_async:  # the server's z, read one-sided
            mine = flat.params_vector()
            flat.set_params_vector(torch.from_numpy(sync.server.pull()))
            v = w.evaluate(model, x_test, y_test)
            flat.set_params_vector(mine)
            return v
        return w.evaluate(model, x_test, y_test)

    history, spreads = [], []
    gen = torch.Generator().manual_seed(a.seed)
    train_time, loss_val = 0.0, float("nan")
    epoch, local_steps, done = 0, 0, False
    while not done:
        if shards is None:
            perm = torch.randperm(len(x_train), generator=gen)
        else:
            mine_idx = shards[rank][torch.randperm(len(shards[rank]), generator=gen)]
        t_epoch = time.perf_counter()
        for i in range(steps_per_epoch):
            if budgeted:  # stop at the global budget; the schedule at the global progress
                g = sync.global_steps()
                if g >= budget:
                    done = True
                    break
                schedule.at(g / budget)
            if shards is None:
                idx = perm[(i * size + rank) * w.batch:(i * size + rank + 1) * w.batch]
            else:
                idx = mine_idx[i * w.batch:(i + 1) * w.batch]
            t_c = time.perf_counter()
            opt.zero_grad()
            loss = w.loss(model, x_train[idx], y_train[idx])
            loss.backward()
            if slow:
                time.sleep((w.slow_factor - 1.0) * (time.perf_counter() - t_c))
            sync.step(loss)
            if not budgeted:
                sched.step()
            local_steps += 1
            loss_val = loss.item()
        train_time += time.perf_counter() - t_epoch
        epoch += 1
        done = done or (not budgeted and epoch >= w.epochs)
        if has_bn and not budgeted:  # collective, every rank at the same step
            spreads.append(buffer_spread(model))
            average_buffers(model)
        if not (budgeted and done):  # a rank that stopped mid-epoch on the budget: the final point follows
            v = evaluate() if rank == 0 else float("nan")
            history.append({"epoch": epoch, "metric": v, "train_time_s": train_time, "loss": loss_val})
    t_fin = time.perf_counter()
    sync.finish()
    if has_bn and not is_async:
        average_buffers(model)
    train_time += time.perf_counter() - t_fin
    # the last rank's finishing time is the job's time
    train_time = max(float(t) for t in hvd.allgather_object(train_time, name="wl.time"))
    steps_per_rank = [int(n) for n in hvd.allgather_object(local_steps, name="wl.steps")]
    final_buf_spread = buffer_spread(model) if has_bn else 0.0
    pvec = flat.params_vector()
    pmean = pvec.clone()
    hvd.allreduce_(pmean, op=hvd.Average, name="wl.pmean")
    param_spread = max(hvd.allgather_object(float((pvec - pmean).abs().max()), name="wl.pspread"))
    final = w.evaluate(model, x_test, y_test) if rank == 0 else float("nan")
    history.append({"epoch": epoch, "metric": final, "train_time_s": train_time, "loss": loss_val,
                    "final": True})

    s = opt.stats.summary()
    keys = ["bytes_sent_per_step", "comm_wait_ms_per_step", "exchanges"]
    vec = hvd.allreduce(torch.tensor([float(s[k]) for k in keys], dtype=torch.float64), op=hvd.Average,
                        name="wl.summary")
    mean = dict(zip(keys, vec.tolist()))
    dense = sum(p.numel() * 4 for p in model.parameters() if p.requires_grad)
    hist_labels = ([label_histogram(y_train[s_], int(y_train.max()) + 1) for s_ in shards]
                   if shards is not None else None)
    result = {
        "workload": w.name, "description": w.description, "metric": w.metric, "target": w.target,
        "method": ("horovod" if a.plain_horovod else compressor.spec()) + ("" if a.sync == "every" else
                                                                          f"@{sync_factory.spec()}"),
        "compression": a.compression, "sync": sync.describe(), "ranks": size, "epochs": w.epochs,
        "steps": total_steps, "budget_batches": budget, "steps_per_rank": steps_per_rank, "batch": w.batch, "lr": w.lr, "optimizer": w.optimizer, "skew": w.skew,
        "shard_label_histograms": hist_labels, "slow_rank": (list(slow_ranks) if len(slow_ranks) > 1 else slow_ranks[0]) if w.slow_factor > 1 else None,
        "slow_factor": w.slow_factor, "final_metric": final, "train_time_s": train_time,
        "bytes_sent_per_step": mean["bytes_sent_per_step"], "bytes_ratio_vs_dense": mean["bytes_sent_per_step"] / dense,
        "comm_wait_ms_per_step": mean["comm_wait_ms_per_step"], "exchanges": mean["exchanges"],
        "params": sum(p.numel() for p in model.parameters()), "batchnorm": has_bn,
        "buffer_spread_per_epoch": spreads, "final_buffer_spread": final_buf_spread,
        "final_param_spread": param_spread, "corpus": corpus, "history": history,
        "period_history": opt.stats.extra.get("period_history"),
        "trigger_reasons": opt.stats.extra.get("trigger_reasons"),
    }
    if rank == 0:
        f = (lambda v: f"{100 * v:.2f}%") if w.metric == "acc" else (lambda v: f"{v:.4f} (ppl {math.exp(v):.2f})")
        print(f"workload {w.name}  method {result['method']}  epochs {w.epochs} x {steps_per_epoch} steps")
        for h in history:
            print(f"  epoch {h['epoch']:2d}{' final' if h.get('final') else ''}  {w.metric} {f(h['metric'])}  "
                  f"t {h['train_time_s']:.1f}s  loss {h['loss']:.3f}")
        print(f"final {w.metric} {f(final)}; train {train_time:.1f}s; bytes/step "
              f"{result['bytes_sent_per_step']:.0f} ({result['bytes_ratio_vs_dense']:.4f} of dense); "
              f"buffer spread per epoch {[round(x, 4) for x in spreads]} final {final_buf_spread:.2e}; "
              f"param spread {param_spread:.2e}")
        if a.json:
            Path(a.json).parent.mkdir(parents=True, exist_ok=True)
            Path(a.json).write_text(json.dumps(result, indent=1))
    opt.stats.close()
    sync.close()
    return result


if __name__ == "__main__":
    main()
