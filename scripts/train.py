#!/usr/bin/env python
"""Main job: data-parallel training of a 1-D CNN on MNIST-1D with hvd_ext.

    horovodrun -np 2 python scripts/train.py --compression topk:ratio=0.01 --epochs 8
    torchrun --nproc_per_node 2 scripts/train.py --engine ddp --compression auto   # on PyTorch DDP

The DDP engine lives in ``scripts/train_ddp.py`` (it also runs DDP's own hooks, ``ddp:fp16`` ...).

Prints test accuracy, bytes on the wire per step (and the ratio to the dense
fp32 gradient), ms per step and ms per step waiting on communication;
``--json OUT`` writes the same as one JSON object (rank 0).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # train_ddp.py, the DDP engine

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine", default="horovod", choices=["horovod", "ddp"],
                   help="horovod (horovodrun/mpirun) or ddp (torchrun; scripts/train_ddp.py)")
    p.add_argument("--compression", default="none",
                   help="compressor spec, e.g. none, fp16, randomk:ratio=0.01 (see hvd_ext.list_compressors())")
    p.add_argument("--epochs", type=int, default=8)
    p.add_argument("--lr", type=float, default=0.2, help="peak learning rate (one-cycle schedule)")
    p.add_argument("--batch", type=int, default=32, help="samples per rank per step")
    p.add_argument("--momentum", type=float, default=None,
                   help="SGD momentum (default 0.9; 0 for dgc, whose momentum lives in its feedback)")
    p.add_argument("--weight-decay", type=float, default=5e-4)
    p.add_argument("--channels", type=int, default=64, help="CNN width")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--bucket-bytes", type=int, default=25 * 1024 * 1024)
    p.add_argument("--json", default=None, help="write the summary as one JSON object here (rank 0)")
    p.add_argument("--log", default=None, help="per-step JSON-lines stats log (suffix .rankN added)")
    p.add_argument("--no-progress", action="store_true", help="no tqdm progress bar")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads per rank")
    p.add_argument("--overlap", default="auto", choices=["auto", "on", "off"],
                   help="compress buckets on a worker thread while backward goes on (auto: with 2+ cores per rank)")
    p.add_argument("--plain-horovod", action="store_true",
                   help="baseline: horovod.torch.DistributedOptimizer itself (--compression none or fp16 only)")
    p.add_argument("--sync", default="every",
                   help="sync strategy spec: every | local:period=8[,warmup=T] | adaptive:min=1,max=32 | "
                        "event:sigma=..,tau_min=..,tau_max=..,staleness=loss|inverse|none,gamma=.. "
                        "(event needs the MPI controller: horovodrun --mpi or mpirun)")
    p.add_argument("--budget", default="rank", choices=["rank", "global"],
                   help="rank: every rank takes --epochs epochs; global (--sync event or adaptive:balance=1): --epochs of batches "
                        "over all ranks together, a fast rank takes more steps and never waits for a slow one")
    p.add_argument("--slow-rank", type=int, default=-1, help="make this rank slower (see --slow-factor)")
    p.add_argument("--slow-factor", type=float, default=1.0, help="the slow rank's compute takes this many times longer")
    p.add_argument("--checkpoint", default=None, help="checkpoint file (model, optimizer, sync and server state)")
    p.add_argument("--checkpoint-every", type=int, default=0, help="save the checkpoint every N steps (0: at the end)")
    p.add_argument("--resume", action="store_true", help="continue from --checkpoint if it exists")
    p.add_argument("--crash-at-step", type=int, default=0, help=argparse.SUPPRESS)  # tests: simulate a kill
    args = p.parse_args(argv)
    for name in ("epochs", "batch", "channels", "threads"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if not args.lr > 0:
        p.error(f"--lr must be > 0, got {args.lr}")
    if not args.slow_factor >= 1.0:
        p.error(f"--slow-factor must be >= 1, got {args.slow_factor}")
    if args.checkpoint_every < 0:
        p.error(f"--checkpoint-every must be >= 0, got {args.checkpoint_every}")
    if args.plain_horovod and (args.compression not in ("none", "fp16") or args.sync != "every"):
        p.error("--plain-horovod runs Horovod's own optimizer: --compression none|fp16 and --sync every only")
    try:
        from hvd_ext.sync import sync_from_spec

        sync_spec = sync_from_spec(args.sync)
    except ValueError as e:
        p.error(str(e))
    uneven = sync_spec.name == "event" or bool(sync_spec.options.get("balance"))
    if args.budget == "global" and (not uneven or args.checkpoint):
        p.error("--budget global needs --sync event or adaptive:balance=1 (the ranks take different numbers "
                "of steps) and no --checkpoint (the ranks reach a step number at different times)")
    if sync_spec.options.get("balance") and args.budget != "global":
        p.error("--sync adaptive:balance=1 needs --budget global: its ranks take steps in proportion to their "
                "speed and stop together when the ranks' steps reach the budget")
    if (args.checkpoint_every or args.resume) and not args.checkpoint:
        p.error("--checkpoint-every/--resume need --checkpoint PATH")
    return args


def plain_horovod_optimizer(hvd, opt, model, compression, log_path):
    """The reference: Horovod's own DistributedOptimizer, with the same ``stats`` as ours.

    Bytes per step are the dense payload Horovod allreduces (4 or 2 bytes per
    element); waiting is the time spent in ``synchronize()``."""
    from hvd_ext.stats import CommStats

    codec = hvd.Compression.fp16 if compression == "fp16" else hvd.Compression.none
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(), compression=codec)
    nbytes = sum(p.numel() for p in model.parameters() if p.requires_grad) * (2 if compression == "fp16" else 4)
    stats = CommStats(log_path)
    inner = opt.synchronize

    def synchronize():
        t0 = time.perf_counter()
        inner()
        stats.record(bytes_sent=nbytes, bytes_received=nbytes, comm_wait_s=time.perf_counter() - t0,
                     compress_s=0.0, skipped=False)

    opt.synchronize = synchronize
    opt.stats = stats
    return opt


def main(argv=None):
    args = parse_args(argv)
    if args.engine == "ddp":
        import train_ddp

        return train_ddp.main(args)
    import horovod.torch as hvd

    import hvd_ext
    from hvd_ext.examples.mnist1d import MNIST1DCNN, accuracy, load_mnist1d

    # Validate the spec before any collective: a bad spec fails on every rank alike.
    compressor = hvd_ext.compression_from_spec(args.compression)
    sync_factory = hvd_ext.sync_from_spec(args.sync)

    # One-sided parameter server: one MPI world shared between mpi4py and Horovod.
    hvd_ext.sync.init_horovod(sync_factory.needs_mpi, f"--sync {args.sync}")
    torch.set_num_threads(args.threads)
    rank, size = hvd.rank(), hvd.size()

    # Rank 0 generates the data set once; the others wait, then read the cache.
    if rank == 0:
        load_mnist1d()
    hvd.barrier()
    x_train, y_train, x_test, y_test = load_mnist1d()

    if args.momentum is None:
        args.momentum = 0.0 if compressor.name == "dgc" else 0.9
    torch.manual_seed(args.seed)
    model = MNIST1DCNN(args.channels)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum, weight_decay=args.weight_decay)
    log_path = f"{args.log}.rank{rank}" if args.log else None
    if args.plain_horovod:
        opt = plain_horovod_optimizer(hvd, opt, model, args.compression, log_path)
    else:
        opt = hvd_ext.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                           compression=compressor, bucket_bytes=args.bucket_bytes,
                                           log_path=log_path,
                                           overlap={"on": True, "off": False}.get(args.overlap, args.overlap))
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    opt.stats.reset()
    sync = sync_factory(opt, model)

    steps_per_epoch = len(x_train) // (args.batch * size)
    total_steps = steps_per_epoch * args.epochs
    # Cycle momentum only where the optimizer has some: with momentum 0 (dgc) OneCycleLR
    # would otherwise switch SGD momentum on (0.85-0.95) on top of the compressor's.
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=total_steps,
                                                cycle_momentum=args.momentum > 0)
    dense_bytes = sum(p.numel() * 4 for p in model.parameters() if p.requires_grad)

    bar = None
    if rank == 0 and not args.no_progress:
        try:
            from tqdm import tqdm

            bar = tqdm(total=total_steps, desc=f"train {args.compression}", unit="step", leave=False, mininterval=2.0,
                       file=sys.stderr)
        except ImportError:
            bar = None

    history = []
    gen = torch.Generator().manual_seed(args.seed)  # same permutation on every rank
    train_time = 0.0
    loss_val = float("nan")
    start_step = 0
    if args.resume and args.checkpoint and os.path.exists(args.checkpoint):
        start_step, history, train_time = _load_checkpoint(args.checkpoint, hvd, model, opt, sched, sync,
                                                           _run_config(args, model))
        if bar is not None:
            bar.update(start_step)
    slow = rank == args.slow_rank and args.slow_factor > 1.0
    # --budget global (asynchronous sync): batches over all ranks; a rank stops when the ranks' steps
    # together reach it, its schedule read at that global progress (hvd_ext.sync.GlobalOneCycle)
    budget = size * total_steps if args.budget == "global" else None
    schedule = hvd_ext.sync.GlobalOneCycle(opt, args.lr, args.momentum > 0) if budget else None
    if budget and hasattr(sync, "set_budget"):
        sync.set_budget(budget)
    step_no, epoch, done = 0, 0, False
    while not done:
        perm = torch.randperm(len(x_train), generator=gen)
        if (epoch + 1) * steps_per_epoch <= start_step:
            epoch += 1
            continue  # finished before the checkpoint (the permutation is still drawn: same data order)
        t_epoch = time.perf_counter()
        for i in range(steps_per_epoch):
            step_no = epoch * steps_per_epoch + i
            if step_no < start_step:
                continue
            if budget:
                g = sync.global_steps()
                if g >= budget:
                    done = True
                    break
                schedule.at(g / budget)
            idx = perm[(i * size + rank) * args.batch:(i * size + rank + 1) * args.batch]
            t_compute = time.perf_counter()
            opt.zero_grad()
            loss = F.cross_entropy(model(x_train[idx]), y_train[idx])
            loss.backward()
            if slow:
                time.sleep((args.slow_factor - 1.0) * (time.perf_counter() - t_compute))
            sync.step(loss)
            if not budget:
                sched.step()
            loss_val = loss.item()
            if args.checkpoint and args.checkpoint_every and (step_no + 1) % args.checkpoint_every == 0:
                _save_checkpoint(args.checkpoint, hvd, step_no + 1, model, opt, sched, sync, history,
                                 _run_config(args, model), train_time + time.perf_counter() - t_epoch)
            if args.crash_at_step and step_no + 1 == args.crash_at_step:
                sys.stdout.flush()
                os._exit(17)  # simulated kill of the whole job
            if bar is not None:
                bar.update(1)
                if i % 20 == 0:
                    bar.set_postfix(loss=f"{loss_val:.3f}", epoch=epoch + 1)
        train_time += time.perf_counter() - t_epoch
        epoch += 1
        done = done or (not budget and epoch >= args.epochs)
        acc = accuracy(model, x_test, y_test)
        history.append({"epoch": epoch, "test_acc": acc, "train_time_s": train_time, "loss": loss_val})
    if bar is not None:
        bar.close()
    t_fin = time.perf_counter()
    sync.finish()  # last parameter sync: every rank ends with the same model
    train_time += time.perf_counter() - t_fin
    if history and sync_factory.name != "every":
        history[-1]["test_acc"] = accuracy(model, x_test, y_test)
        history[-1]["train_time_s"] = train_time
    if args.checkpoint:
        _save_checkpoint(args.checkpoint, hvd, total_steps, model, opt, sched, sync, history,
                         _run_config(args, model), train_time)
    exchanges_per_rank = [int(e) for e in hvd.allgather_object(int(sync.exchanges), name="train.exchanges")]
    local_steps_per_rank = hvd.allgather_object(int(getattr(sync, "steps", total_steps)), name="train.local_steps")

    s = opt.stats.summary()
    # Mean over ranks of the per-rank counters (ranks may send different byte counts).
    keys = ["bytes_sent_per_step", "bytes_received_per_step", "comm_wait_ms_per_step", "compress_ms_per_step",
            "exchanges"]
    vec = torch.tensor([float(s[k]) for k in keys], dtype=torch.float64)
    vec = hvd.allreduce(vec, op=hvd.Average, name="train.summary")
    mean = dict(zip(keys, vec.tolist()))
    final_acc = history[-1]["test_acc"]
    result = {
        "compression": ("horovod:" if args.plain_horovod else "") + compressor.spec(),
        "ranks": size,
        "epochs": args.epochs,
        "steps": total_steps,
        "test_acc": final_acc,
        "bytes_sent_per_step": mean["bytes_sent_per_step"],
        "bytes_received_per_step": mean["bytes_received_per_step"],
        "dense_bytes_per_step": dense_bytes,
        "bytes_ratio_vs_dense": mean["bytes_sent_per_step"] / dense_bytes,
        "ms_per_step": 1e3 * train_time / max(total_steps, 1),
        "comm_wait_ms_per_step": mean["comm_wait_ms_per_step"],
        "compress_ms_per_step": mean["compress_ms_per_step"],
        "exchanges": sum(exchanges_per_rank) / len(exchanges_per_rank),
        "exchanges_per_rank": exchanges_per_rank,
        "exchanges_per_epoch": sum(exchanges_per_rank) / len(exchanges_per_rank) / args.epochs,
        "sync": sync.describe(),
        "local_steps_per_rank": local_steps_per_rank,
        "resumed_from_step": start_step,
        "period_history": opt.stats.extra.get("period_history"),
        "trigger_reasons": opt.stats.extra.get("trigger_reasons"),
        "slow_rank": args.slow_rank if args.slow_factor > 1.0 else None,
        "slow_factor": args.slow_factor,
        "skipped_steps": s["skipped_steps"],
        "routes": list(getattr(getattr(opt, "_pipeline", None), "routes", []) or []),
        "overlap": opt.stats.extra.get("overlap"),
        "auto": opt.stats.extra.get("auto"),
        "node_links": opt.stats.extra.get("node_links"),
        "route_trial": opt.stats.extra.get("route_trial"),
        "train_time_s": train_time,
        "history": history,
    }
    if rank == 0:
        print(f"compression           {result['compression']}")
        print(f"ranks x epochs        {size} x {args.epochs} ({total_steps} steps)")
        print(f"test accuracy         {100 * final_acc:.2f}%")
        print(f"bytes sent per step   {result['bytes_sent_per_step']:.0f} "
              f"({result['bytes_ratio_vs_dense']:.4f} of dense fp32 {dense_bytes}; "
              f"{1 / max(result['bytes_ratio_vs_dense'], 1e-12):.1f}x fewer)")
        print(f"ms per step           {result['ms_per_step']:.2f}")
        print(f"comm wait ms per step {result['comm_wait_ms_per_step']:.2f}")
        print(f"train time            {train_time:.1f} s")
        print(f"sync                  {result['sync']}")
        if result["routes"]:
            print(f"exchange per bucket   {', '.join(result['routes'])}"
                  + ("" if result["overlap"] is None else
                     f" (compressed {'on a worker thread' if result['overlap'] else 'in the backward hooks'})"))
        links = result["node_links"]
        if links:
            print(f"node links            intra {links['intra']['MB_per_s']} MB/s, {links['intra']['latency_us']} us; "
                  f"inter (NIC) {links['inter']['MB_per_s']} MB/s, {links['inter']['latency_us']} us "
                  f"({links['source']}" + (f" in {links['probe_s']} s)" if "probe_s" in links else ")"))
        trial = result["route_trial"]
        if trial:
            periods = ", ".join(f"{k} {v}" for k, v in trial["measured_period_ms"].items())
            print(f"hierarchy trial       model picked {trial['model']}; measured step periods (ms) "
                  f"{periods or 'pending'}; kept {trial['choice'] or '(not decided yet)'}")
        auto = result["auto"]
        if auto:
            last = auto.get("last") or {}
            print(f"auto: codec per bucket {', '.join(auto['choice'])} ({auto['decisions']} decision(s); "
                  f"link {(last.get('link') or {}).get('MB_per_s', '?')} MB/s, "
                  f"{(last.get('link') or {}).get('latency_ms', '?')} ms per collective)")
            print(f"auto: exchange ms/step predicted {last.get('predicted_ms', '?')}, "
                  f"measured {last.get('measured_ms', last.get('measured_before_ms', '?'))}")
            if last.get("measured_period_ms"):
                cut = last.get("cut_early") or []
                print("auto: trial step periods (ms) " + ", ".join(
                    f"{k} {v}" + (" (cut early)" if k in cut else "") for k, v in last["measured_period_ms"].items()))
        print(f"exchanges per rank    {exchanges_per_rank} (mean {result['exchanges']:.1f} over {total_steps} steps)")
        if args.json:
            from train_ddp import write_json

            write_json(args.json, result)
    opt.stats.close()
    sync.close()
    return result


def _run_config(args, model):
    """What a checkpoint must match to be resumed: method and model layout."""
    import hvd_ext

    return {"compression": ("horovod:" if args.plain_horovod else "") + hvd_ext.compression_from_spec(args.compression).spec(),
            "sync": hvd_ext.sync_from_spec(args.sync).spec(),
            "model": [(n, tuple(p.shape)) for n, p in model.state_dict().items()]}


def _save_checkpoint(path, hvd, step, model, opt, sched, sync, history, config, train_time):
    """Collective: every rank's model/optimizer/scheduler/sync state (ranks may differ between
    syncs) and the parameter-server state, written by rank 0 atomically (temp file + os.replace:
    a crash mid-write leaves the previous checkpoint intact)."""
    mine = {"model": model.state_dict(), "optimizer": opt.state_dict(), "sched": sched.state_dict(),
            "sync": sync.state_dict()}
    per_rank = hvd.allgather_object(mine, name="train.ckpt.gather")  # every rank is at `step` now
    if hvd.rank() == 0:
        from train_ddp import atomic_save

        atomic_save({"format": "hvd_ext.train/1", "config": config, "step": step, "ranks": hvd.size(),
                     "per_rank": per_rank, "server": sync.shared_state_dict(), "history": history,
                     "train_time_s": train_time}, path)
    hvd.barrier()  # nobody pushes to the server while rank 0 reads it


def read_checkpoint(path, config, size):
    """Load and check a checkpoint; ValueError naming the file and what is wrong (every rank
    reads the same file, so every rank raises the same error before any collective)."""
    try:
        ckpt = torch.load(path, weights_only=False, map_location="cpu")
    except Exception as e:  # truncated / corrupt / not a torch file
        raise ValueError(f"--resume: checkpoint {path} is unreadable or corrupt ({type(e).__name__}: {e}); "
                         "delete it or pass another --checkpoint") from None
    if not isinstance(ckpt, dict) or ckpt.get("format") != "hvd_ext.train/1":
        raise ValueError(f"--resume: {path} is not a scripts/train.py checkpoint (format "
                         f"{ckpt.get('format') if isinstance(ckpt, dict) else type(ckpt).__name__!r}; "
                         "accepted: 'hvd_ext.train/1')")
    saved = ckpt.get("config", {})
    for key in ("compression", "sync", "model"):
        if saved.get(key) != config[key]:
            a, b = saved.get(key), config[key]
            if key == "model":
                diff = [x for x in zip(a or [], b) if x[0] != x[1]]
                a, b = (diff[0] if diff else (f"{len(a or [])} tensors", f"{len(b)} tensors"))
            raise ValueError(f"--resume: checkpoint {path} was written with {key} {a!r}, this run has {b!r}")
    if ckpt["ranks"] != size:
        raise ValueError(f"--resume: checkpoint {path} has {ckpt['ranks']} ranks, this job {size}")
    return ckpt


def _load_checkpoint(path, hvd, model, opt, sched, sync, config):
    ckpt = read_checkpoint(path, config, hvd.size())
    mine = ckpt["per_rank"][hvd.rank()]
    model.load_state_dict(mine["model"])
    opt.load_state_dict(mine["optimizer"])
    sched.load_state_dict(mine["sched"])
    sync.load_state_dict(mine["sync"])
    if ckpt["server"] is not None:
        sync.load_shared_state_dict(ckpt["server"])
    if hvd.rank() == 0:
        print(f"resumed from {path} at step {ckpt['step']}", flush=True)
    return int(ckpt["step"]), list(ckpt["history"]), float(ckpt["train_time_s"])


if __name__ == "__main__":
    if main().get("engine") == "ddp":
        import train_ddp

        train_ddp.leave()
