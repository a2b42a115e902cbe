"""The main job on PyTorch DDP (``scripts/train.py --engine ddp``), launched as DDP users do:

    torchrun --nproc_per_node 2 scripts/train.py --engine ddp --compression auto

Same model, data, sharding, optimizer and one-cycle schedule as the Horovod engine, so the two
compare step for step; the JSON has the same keys. ``--compression`` takes:

* any hvd_ext spec (``auto``, ``none``, ``topk:ratio=0.01``, ``qsgd:bits=8``, ``powersgd:rank=2``,
  ...): ``hvd_ext.ddp.register`` puts that codec on DDP's buckets (docs/ddp.md);
* DDP's own hooks, for comparison: ``ddp:allreduce`` (DDP's default), ``ddp:fp16``, ``ddp:bf16``,
  ``ddp:powersgd[:rank=R,start=S]`` and ``ddp:batched_powersgd[:rank=R,start=S]``
  (``torch.distributed.algorithms.ddp_comm_hooks``; ``start`` is ``start_powerSGD_iter``, default
  100 like hvd_ext's ``powersgd`` warm-up, ``min_compression_rate`` 2 and error feedback with warm
  start, torch's defaults).

Measured per rank: bytes handed to the collectives per step (hvd_ext: its exchange's count;
DDP's hooks: every tensor passed to ``dist.all_reduce``), and the communication wait: from the
last bucket's hook call (local backward is done then) until ``loss.backward()`` returns.
A step whose gradient is non-finite on some rank is skipped on every rank (``state.skip_step``).

``--checkpoint PATH [--checkpoint-every N] [--resume]``: rank 0 writes the model, optimizer, schedule
and every rank's hook state (hvd_ext's error feedback and codec state differ per rank); a resumed run
continues where the checkpoint left off (DDP's own PowerSGD hooks are refused: their state is not saved).
"""
from __future__ import annotations

import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

DDP_HOOKS = ("allreduce", "fp16", "bf16", "powersgd", "batched_powersgd")
HOROVOD_ONLY = {"plain_horovod": False, "sync": "every", "overlap": "auto", "budget": "rank"}
FORMAT = "hvd_ext.train_ddp/1"


def check_args(args) -> None:
    """Options of the Horovod engine only, a bad --compression and a launch outside torchrun fail
    before any collective."""
    bad = [f"--{k.replace('_', '-')}" for k, v in HOROVOD_ONLY.items() if getattr(args, k) != v]
    if bad:
        raise SystemExit(f"train.py --engine ddp: {', '.join(bad)} belong to the Horovod engine "
                         "(--engine horovod); the DDP engine takes --compression, the training options and --slow-*")
    if parse_ddp_hook(args.compression) is None:
        from hvd_ext.spec import compression_from_spec

        try:
            compression_from_spec(args.compression)
        except ValueError as e:
            raise SystemExit(f"train.py --engine ddp: --compression: {e}") from None
    elif args.checkpoint and "powersgd" in args.compression:
        raise SystemExit(f"train.py --engine ddp: --checkpoint with {args.compression!r}: DDP's PowerSGD state "
                         "(its error feedback, its step count) is not saved; accepted: hvd_ext specs (their hook "
                         "state is saved) and ddp:allreduce|fp16|bf16")
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise SystemExit("train.py --engine ddp: start it with torchrun, e.g. "
                         "torchrun --nproc_per_node 2 scripts/train.py --engine ddp --compression auto")


def parse_ddp_hook(spec: str):
    """``ddp:NAME[:k=v,...]`` -> (NAME, options) for DDP's own hooks; None for an hvd_ext spec."""
    if not spec.startswith("ddp:"):
        return None
    name, _, rest = spec[4:].partition(":")
    if name not in DDP_HOOKS:
        raise SystemExit(f"--compression {spec!r}: unknown DDP hook {name!r}; accepted: "
                         + ", ".join(f"ddp:{h}" for h in DDP_HOOKS) + " (or an hvd_ext spec)")
    opts = {"rank": 2, "start": 100}
    for kv in filter(None, rest.split(",")):
        k, _, v = kv.partition("=")
        if name not in ("powersgd", "batched_powersgd") or k not in opts or not v.isdigit() or int(v) < 1:
            raise SystemExit(f"--compression {spec!r}: bad option {kv!r}; accepted: rank=R,start=S "
                             "(integers >= 1; start >= 2) for ddp:powersgd and ddp:batched_powersgd only")
        opts[k] = int(v)
    if opts["start"] < 2:
        raise SystemExit(f"--compression {spec!r}: start must be >= 2 (PowerSGD with error feedback)")
    return name, opts


class AllreduceMeter:
    """Counts the bytes DDP's own hooks hand to ``dist.all_reduce``, and when a hook last ran."""

    def __init__(self, count_allreduce: bool):
        self.bytes = 0
        self.last_hook_t = None
        if count_allreduce:
            orig = dist.all_reduce

            def counting_all_reduce(tensor, *a, **kw):
                self.bytes += tensor.numel() * tensor.element_size()
                return orig(tensor, *a, **kw)

            dist.all_reduce = counting_all_reduce  # DDP's hooks look it up at call time

    def wrap(self, hook):
        def timed_hook(state, bucket):
            self.last_hook_t = time.perf_counter()
            return hook(state, bucket)

        return timed_hook


def register_hook(ddp, spec: str, seed: int):
    """Register ``spec`` on ``ddp``; -> (hvd_ext hook state or None, meter, description)."""
    own = parse_ddp_hook(spec)
    meter = AllreduceMeter(count_allreduce=own is not None)
    if own is None:
        from hvd_ext import ddp as hvd_ddp

        state, hook = hvd_ddp.comm_hook(spec)
        ddp.register_comm_hook(state, meter.wrap(hook))
        return state, meter, spec
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

    name, o = own
    if name in ("powersgd", "batched_powersgd"):
        state = psgd.PowerSGDState(process_group=None, matrix_approximation_rank=o["rank"],
                                   start_powerSGD_iter=o["start"], min_compression_rate=2,
                                   use_error_feedback=True, warm_start=True, random_seed=seed)
        if name == "batched_powersgd":
            mend_batched_orthogonalize(psgd)
        fn = psgd.powerSGD_hook if name == "powersgd" else psgd.batched_powerSGD_hook
        ddp.register_comm_hook(state, meter.wrap(fn))
        return None, meter, f"ddp:{name}:rank={o['rank']},start={o['start']}"
    fn = {"allreduce": default_hooks.allreduce_hook, "fp16": default_hooks.fp16_compress_hook,
          "bf16": default_hooks.bf16_compress_hook}[name]
    ddp.register_comm_hook(None, meter.wrap(fn))
    return None, meter, f"ddp:{name}"


def mend_batched_orthogonalize(psgd) -> None:
    """torch's ``batched_powerSGD_hook`` hands ``_orthogonalize`` one 2-D matrix, which since the
    batched rewrite of ``_orthogonalize`` (pytorch#75157) accepts only a batch of them and raises
    AssertionError (torch 2.13). Where it does, give it the matrix as a batch of one: the same
    orthogonalization, nothing else changed."""
    try:
        psgd._orthogonalize(torch.ones(4, 2))
        return
    except AssertionError:
        pass
    batched = psgd._orthogonalize

    def orthogonalize(matrices, epsilon=0):
        return batched(matrices.unsqueeze(0) if matrices.dim() == 2 else matrices, epsilon)

    psgd._orthogonalize = orthogonalize


def save_checkpoint(path, step, model, opt, sched, state, history, train_time, config) -> None:
    """Collective: rank 0 writes the model, optimizer and schedule (the same on every rank) and every
    rank's hook state (error feedback differs per rank), atomically."""
    per_rank = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, state.state_dict() if state is not None else None)
    if dist.get_rank() == 0:
        atomic_save({"format": FORMAT, "config": config, "step": step, "ranks": len(per_rank),
                     "model": model.state_dict(), "optimizer": opt.state_dict(), "sched": sched.state_dict(),
                     "hook": per_rank, "history": history, "train_time_s": train_time}, path)
    dist.barrier()  # the file is complete before any rank goes on (or is killed)


def atomic_save(obj, path: str) -> None:
    """``torch.save`` to a temporary file, then ``os.replace``: a crash mid-write leaves the previous file."""
    tmp = f"{path}.tmp.{os.getpid()}"
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def load_checkpoint(path, config, model, opt, sched, state):
    """Every rank reads ``path`` (so a bad file fails every rank alike, before any collective) and
    takes its parts; -> (step, history, train_time)."""
    try:
        ck = torch.load(path, weights_only=False, map_location="cpu")
    except Exception as e:  # truncated / corrupt / not a torch file
        raise SystemExit(f"--resume: checkpoint {path} is unreadable ({type(e).__name__}: {e})") from None
    if not isinstance(ck, dict) or ck.get("format") != FORMAT:
        raise SystemExit(f"--resume: {path} is not a DDP-engine checkpoint of scripts/train.py (accepted: {FORMAT!r})")
    for key in ("compression", "model"):
        if ck["config"].get(key) != config[key]:
            raise SystemExit(f"--resume: {path} was written with another {key} ({ck['config'].get(key)!r}, "
                             f"this run {config[key]!r})")
    if ck["ranks"] != dist.get_world_size():
        raise SystemExit(f"--resume: {path} has {ck['ranks']} ranks, this job {dist.get_world_size()}")
    model.load_state_dict(ck["model"])
    opt.load_state_dict(ck["optimizer"])
    sched.load_state_dict(ck["sched"])
    if state is not None:
        state.load_state_dict(ck["hook"][dist.get_rank()])  # before the first backward: pipelines take it then
    if dist.get_rank() == 0:
        print(f"resumed from {path} at step {ck['step']}", flush=True)
    return int(ck["step"]), list(ck["history"]), float(ck["train_time_s"])


def sent_bytes(state, meter) -> int:
    return int(state.exchange.stats.bytes_sent) if state is not None else meter.bytes


def train(args, ddp, model, opt, sched, data, state, meter, ck):
    """The training loop from ``ck`` = (step, history, train_time) -- (0, [], 0.0), or a resumed
    checkpoint's; -> (history, train_time, wait_s, bytes, skipped)."""
    x_train, y_train, x_test, y_test = data
    from hvd_ext.examples.mnist1d import accuracy

    rank, size = dist.get_rank(), dist.get_world_size()
    steps_per_epoch = len(x_train) // (args.batch * size)
    gen = torch.Generator().manual_seed(args.seed)  # same permutation on every rank
    start, history, train_time = ck
    wait_s, skipped, loss_val = 0.0, 0, float("nan")
    slow = rank == args.slow_rank and args.slow_factor > 1.0
    b_start = sent_bytes(state, meter)
    for epoch in range(args.epochs):
        perm = torch.randperm(len(x_train), generator=gen)  # drawn for finished epochs too: same data order
        if (epoch + 1) * steps_per_epoch <= start:
            continue
        t_epoch = time.perf_counter()
        for i in range(max(start - epoch * steps_per_epoch, 0), steps_per_epoch):
            idx = perm[(i * size + rank) * args.batch:(i * size + rank + 1) * args.batch]
            t_compute = time.perf_counter()
            opt.zero_grad()
            loss = F.cross_entropy(ddp(x_train[idx]), y_train[idx])
            meter.last_hook_t = None
            loss.backward()
            t_done = time.perf_counter()
            wait_s += t_done - meter.last_hook_t if meter.last_hook_t is not None else 0.0
            if slow:  # compute ended when the last bucket's hook ran
                time.sleep((args.slow_factor - 1.0) * ((meter.last_hook_t or t_done) - t_compute))
            if state is not None and state.skip_step:
                skipped += 1  # every rank knows: the exchange carried the non-finite flag
            else:
                opt.step()
            sched.step()
            loss_val = loss.item()
            step_no = epoch * steps_per_epoch + i + 1
            if args.checkpoint and args.checkpoint_every and step_no % args.checkpoint_every == 0:
                save_checkpoint(args.checkpoint, step_no, model, opt, sched, state, history,
                                train_time + time.perf_counter() - t_epoch, run_config(args, model))
            if args.crash_at_step and step_no == args.crash_at_step:
                os._exit(17)  # tests: a simulated kill of the whole job
        train_time += time.perf_counter() - t_epoch
        history.append({"epoch": epoch + 1, "test_acc": accuracy(model, x_test, y_test),
                        "train_time_s": train_time, "loss": loss_val})
    return history, train_time, wait_s, sent_bytes(state, meter) - b_start, skipped


def run_config(args, model):
    """What a checkpoint must match to be resumed: the method and the model's layout."""
    return {"engine": "ddp", "compression": args.compression,
            "model": [(n, tuple(p.shape)) for n, p in model.state_dict().items()]}


def main(args):
    check_args(args)
    from torch.nn.parallel import DistributedDataParallel as DDP

    from hvd_ext.examples.mnist1d import MNIST1DCNN, load_mnist1d

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", timeout=timedelta(seconds=600))
    torch.set_num_threads(args.threads)
    rank, size = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        load_mnist1d()
    dist.barrier()
    data = load_mnist1d()

    if args.momentum is None:
        args.momentum = 0.0 if args.compression.split(":")[0] == "dgc" else 0.9
    torch.manual_seed(args.seed)
    model = MNIST1DCNN(args.channels)
    dense_bytes = sum(p.numel() * 4 for p in model.parameters() if p.requires_grad)
    ddp = DDP(model, bucket_cap_mb=args.bucket_bytes / 2 ** 20)
    state, meter, described = register_hook(ddp, args.compression, args.seed)
    opt = torch.optim.SGD(ddp.parameters(), lr=args.lr, momentum=args.momentum, weight_decay=args.weight_decay)
    total_steps = len(data[0]) // (args.batch * size) * args.epochs
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=total_steps,
                                                cycle_momentum=args.momentum > 0)
    ck = (0, [], 0.0)
    if args.resume and os.path.exists(args.checkpoint):
        ck = load_checkpoint(args.checkpoint, run_config(args, model), model, opt, sched, state)
    history, train_time, wait_s, nbytes, skipped = train(args, ddp, model, opt, sched, data, state, meter, ck)
    if args.checkpoint:
        save_checkpoint(args.checkpoint, total_steps, model, opt, sched, state, history, train_time,
                        run_config(args, model))

    done = max(total_steps - ck[0], 1)  # steps this run took (after a resume: since the checkpoint)
    vec = torch.tensor([nbytes / done, 1e3 * wait_s / done], dtype=torch.float64)
    dist.all_reduce(vec)
    vec /= size
    result = {
        "compression": described, "engine": "ddp", "resumed_from_step": ck[0], "framework": "pytorch-ddp", "ranks": size,
        "epochs": args.epochs, "steps": total_steps, "test_acc": history[-1]["test_acc"],
        "bytes_sent_per_step": vec[0].item(), "dense_bytes_per_step": dense_bytes,
        "bytes_ratio_vs_dense": vec[0].item() / dense_bytes, "ms_per_step": 1e3 * train_time / total_steps,
        "comm_wait_ms_per_step": vec[1].item(), "exchanges": float(total_steps), "skipped_steps": skipped,
        "routes": routes_of(state), "auto": auto_of(state), "train_time_s": train_time, "history": history,
        "slow_rank": args.slow_rank if args.slow_factor > 1.0 else None, "slow_factor": args.slow_factor,
    }
    if rank == 0:
        report(result, args)
    dist.barrier()  # every rank's collectives are done and rank 0's results written
    return result


def leave() -> None:
    """End a DDP-engine process without the interpreter's teardown. Tearing gloo down at exit sometimes
    aborted one rank (SIGABRT, "terminate called without an active exception": about 1 run in 10 on
    the multi-node testbed, and once on one node) after every result was written, and torchrun then
    failed the job. After :func:`main`'s closing barrier nothing is left to send or write."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def routes_of(state):
    if state is None:
        return []
    return [r for pipe, _ in state.pipelines.values() for r in pipe.routes]


def auto_of(state):
    """``auto``'s report per DDP bucket (None for a fixed codec or DDP's own hooks)."""
    if state is None:
        return None
    reports = [pipe.auto.report() for pipe, _ in state.pipelines.values() if pipe.auto is not None]
    return reports or None


def report(result, args) -> None:
    print(f"engine                PyTorch DDP ({result['ranks']} ranks, gloo)")
    print(f"compression           {result['compression']}")
    print(f"ranks x epochs        {result['ranks']} x {args.epochs} ({result['steps']} steps)")
    print(f"test accuracy         {100 * result['test_acc']:.2f}%")
    print(f"bytes sent per step   {result['bytes_sent_per_step']:.0f} "
          f"({result['bytes_ratio_vs_dense']:.4f} of dense fp32 {result['dense_bytes_per_step']}; "
          f"{1 / max(result['bytes_ratio_vs_dense'], 1e-12):.1f}x fewer)")
    print(f"ms per step           {result['ms_per_step']:.2f}")
    print(f"comm wait ms per step {result['comm_wait_ms_per_step']:.2f}")
    print(f"train time            {result['train_time_s']:.1f} s")
    if result["routes"]:
        print(f"exchange per bucket   {', '.join(result['routes'])}")
    for i, rep in enumerate(result["auto"] or []):
        print(f"auto: DDP bucket {i}    codec per bucket {', '.join(rep['choice'])} ({rep['decisions']} decision(s))")
    if result["skipped_steps"]:
        print(f"skipped steps         {result['skipped_steps']} (non-finite gradient on some rank)")
    if args.json:
        write_json(args.json, result)
    sys.stdout.flush()


def write_json(path: str, result) -> None:
    """The run's summary as one JSON object (both engines of scripts/train.py)."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
