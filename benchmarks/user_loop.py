#!/usr/bin/env python
"""A plain Horovod training loop, as a user writes it, for the ``auto`` trust benchmark.

    horovodrun -np 2 --gloo python benchmarks/user_loop.py --loop cnn-sgd --method auto --seed 0
    horovodrun -np 2 --gloo python benchmarks/user_loop.py --loop lm --method horovod:fp16

Nothing of hvd_ext's own trainer (``scripts/train.py``) is used: a constant learning rate,
``zero_grad / backward / step``, Horovod's broadcast recipe, and ``hvd_ext.DistributedOptimizer``
swapped in for ``hvd.DistributedOptimizer`` (``--method horovod`` / ``horovod:fp16`` run
Horovod's own optimizer). Loops (``LOOPS``):

* ``cnn-sgd`` / ``cnn-adam``: the main job's 1-D CNN 3.3x wider (212 channels, 681k parameters)
  on MNIST-1D, batch 64 per rank, SGD momentum 0.9 lr 0.1 / Adam lr 1e-3;
* ``resnet``: the ``resnet`` workload's BatchNorm CNN on shapes16, SGD momentum 0.9 lr 0.05;
* ``lm``: the ``lm`` workload's byte-level transformer, AdamW lr 3e-3.

Rank 0 evaluates at every epoch end (clock stopped) and writes ``--json``: the metric per epoch
with the cumulative training seconds, ms/step (steps after the first epoch's first 10, so
start-up is left out), bytes sent per step, and ``auto``'s choices when it ran.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402


def _cnn(opt: str):
    def make():
        from hvd_ext.examples.mnist1d import MNIST1DCNN, load_mnist1d
        return dict(data=load_mnist1d(), model=MNIST1DCNN(212), metric="acc", target=0.95, epochs=8, batch=64,
                    opt=opt, lr=0.1 if opt == "sgd" else 1e-3)
    return make


def _resnet():
    from hvd_ext.examples.workloads import SmallResNet, load_shapes
    return dict(data=load_shapes(), model=SmallResNet(16), metric="acc", target=0.95, epochs=3, batch=32,
                opt="sgd", lr=0.05)


def _lm():
    from hvd_ext.examples.workloads import TinyTransformerLM, lm_windows, text_corpus
    train, test, _ = text_corpus()
    w_tr, w_te = lm_windows(train, 64), lm_windows(test, 64)
    return dict(data=(w_tr[:, :-1], w_tr[:, 1:], w_te[:, :-1], w_te[:, 1:]), model=TinyTransformerLM(64, 2, 4, 64),
                metric="loss", target=2.0, epochs=2, batch=16, opt="adamw", lr=3e-3)


LOOPS = {"cnn-sgd": _cnn("sgd"), "cnn-adam": _cnn("adam"), "resnet": _resnet, "lm": _lm}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--loop", required=True, choices=list(LOOPS))
    p.add_argument("--method", default="auto", help="horovod | horovod:fp16 | an hvd_ext compression spec")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--epochs", type=int, default=None, help="default: the loop's")
    p.add_argument("--json", default=None)
    return p.parse_args(argv)


def evaluate(model, x, y, metric: str) -> float:
    """Test accuracy, or held-out loss in nats per byte."""
    model.eval()
    tot, n = 0.0, 0
    with torch.no_grad():
        for i in range(0, len(x), 500):
            out = model(x[i:i + 500])
            if metric == "acc":
                tot += (out.argmax(-1) == y[i:i + 500]).sum().item()
                n += len(out)
            else:
                tot += F.cross_entropy(out.reshape(-1, out.shape[-1]), y[i:i + 500].reshape(-1), reduction="sum").item()
                n += y[i:i + 500].numel()
    model.train()
    return tot / max(n, 1)


def main(argv=None):
    a = parse_args(argv)
    import horovod.torch as hvd

    import hvd_ext

    hvd.init()
    torch.set_num_threads(1)
    torch.manual_seed(a.seed)
    cfg = LOOPS[a.loop]()
    epochs = a.epochs or cfg["epochs"]
    x_tr, y_tr, x_te, y_te = cfg["data"]
    model = cfg["model"]
    if cfg["opt"] == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=cfg["lr"], momentum=0.9)
    elif cfg["opt"] == "adam":
        opt = torch.optim.Adam(model.parameters(), lr=cfg["lr"])
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], weight_decay=0.01)
    if a.method.startswith("horovod"):
        comp = hvd.Compression.fp16 if a.method == "horovod:fp16" else hvd.Compression.none
        opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(), compression=comp)
    else:
        opt = hvd_ext.DistributedOptimizer(opt, named_parameters=model.named_parameters(), compression=a.method)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)

    rank, size = hvd.rank(), hvd.size()
    gen = torch.Generator().manual_seed(a.seed)
    n_steps = len(x_tr) // (cfg["batch"] * size)
    history, train_s, step_times, step = [], 0.0, [], 0
    for epoch in range(epochs):
        perm = torch.randperm(len(x_tr), generator=gen)
        t_epoch = time.perf_counter()
        for i in range(n_steps):
            idx = perm[(i * size + rank) * cfg["batch"]:(i * size + rank + 1) * cfg["batch"]]
            t0 = time.perf_counter()
            opt.zero_grad()
            out = model(x_tr[idx])
            loss = F.cross_entropy(out.reshape(-1, out.shape[-1]), y_tr[idx].reshape(-1))
            loss.backward()
            opt.step()
            if step >= 10:
                step_times.append(time.perf_counter() - t0)
            step += 1
        train_s += time.perf_counter() - t_epoch
        v = evaluate(model, x_te, y_te, cfg["metric"]) if rank == 0 else float("nan")
        history.append({"epoch": epoch + 1, "metric": v, "train_s": train_s})
        if rank == 0:
            print(f"epoch {epoch + 1}: {cfg['metric']} {v:.4f}  {train_s:.1f} s", flush=True)

    ms = 1e3 * sum(step_times) / max(len(step_times), 1)
    ms = float(hvd.allreduce(torch.tensor([ms], dtype=torch.float64), op=hvd.Average, name="ul.ms")[0])
    stats = getattr(opt, "stats", None)
    summary = stats.summary() if stats is not None else {}
    auto = stats.extra.get("auto") if stats is not None else None
    if rank == 0:
        result = {"loop": a.loop, "method": a.method, "seed": a.seed, "ranks": size, "epochs": epochs,
                  "steps": step, "metric": cfg["metric"], "target": cfg["target"],
                  "params": sum(p.numel() for p in model.parameters()), "final": history[-1]["metric"],
                  "ms_per_step": ms, "history": history,
                  "bytes_sent_per_step": summary.get("bytes_sent_per_step"),
                  "auto": None if auto is None else {"choice": auto["choice"], "history": auto["history"]}}
        print(f"{a.loop} {a.method} seed {a.seed}: final {cfg['metric']} {result['final']:.4f}, "
              f"{ms:.2f} ms/step" + (f", auto chose {auto['choice']}" if auto else ""), flush=True)
        if a.json:
            Path(a.json).parent.mkdir(parents=True, exist_ok=True)
            Path(a.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
