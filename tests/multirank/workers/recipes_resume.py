"""Horovod's resume recipe with hvd_ext: rank 0 loads a checkpoint, the others start empty,
then ``hvd.broadcast_parameters`` + ``hvd.broadcast_optimizer_state`` and training goes on.

Also: a process set that excludes rank 1 (2 ranks), and the sync strategies resumed on rank 0 only.
Each rank checks its results in-process (named checks, common.Checks) and prints one RESULT line.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import horovod.torch as hvd  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import hvd_ext  # noqa: E402
from common import report, init_horovod, flat_params, small_batch, small_model  # noqa: E402

RANK, SIZE, only0 = None, None, None  # set by main() at hvd.init()



def spread(model):
    allp = hvd.allgather(flat_params(model).unsqueeze(0), name="recipes.spread")
    return float((allp - allp[0:1]).abs().max())


def train(model, opt, first, n, sync=None):
    batch = skewed_batch if model[0].in_features == 40 else small_batch
    for i in range(first, first + n):
        x, y = batch(RANK, i)
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        (sync.step(loss) if sync is not None else opt.step())


def kwargs_for(cls):
    kw = {"lr": 0.01}
    if cls is torch.optim.SGD:
        kw["momentum"] = 0.9
    return kw


def skewed_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(40, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))


def skewed_batch(rank, i):
    """Inputs whose first 5 features are 20x the rest: the first weights' gradients dominate a top-k
    selection, so sparse reduce-scatter moves its owner ranges (the rebalance)."""
    g = torch.Generator().manual_seed(1000 * rank + i)
    x = torch.randn(32, 40, generator=g)
    x[:, :5] *= 20
    return x, torch.randint(0, 10, (32,), generator=g)


def resume_case(cls, spec, steps=3, make_model=small_model):
    """Train, checkpoint (rank 0's state only), rebuild everything, load on rank 0 only, recipe, train."""
    model = make_model()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = hvd_ext.DistributedOptimizer(cls(model.parameters(), **kwargs_for(cls)),
                                       named_parameters=model.named_parameters(), compression=spec)
    train(model, opt, 0, steps)
    ckpt = {"model": {k: v.clone() for k, v in model.state_dict().items()}, "opt": opt.state_dict()}
    # a new process: fresh model and optimizer everywhere, state on rank 0 only
    model = make_model()
    opt = hvd_ext.DistributedOptimizer(cls(model.parameters(), **kwargs_for(cls)),
                                       named_parameters=model.named_parameters(), compression=spec)
    if RANK == 0:
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    after_recipe = spread(model)
    train(model, opt, steps, steps)
    ext = opt.state_dict()["hvd_ext"]
    comp = ext.get("compressor", {})
    comp_sig = float(sum(float(v.double().abs().sum()) for d in comp.values() if isinstance(d, dict)
                         for v in d.values() if torch.is_tensor(v)))
    bounds = tuple(tuple(v.tolist()) for k, v in sorted(ext.get("owner", {}).items()) if k.endswith(":bounds"))
    decided = (tuple((ext.get("auto") or {}).get("choice", ())), (ext.get("auto") or {}).get("last_eval"))
    steps_seen = hvd.allgather_object((int(ext["step"]), comp_sig, bounds, decided), name="recipes.steps")
    return {"after_recipe": after_recipe, "spread": spread(model), "finite": bool(torch.isfinite(flat_params(model)).all()),
            "same_hvd_ext_state": len(set(steps_seen)) == 1, "step": int(ext["step"]), "bounds": bounds,
            "decided": decided}


def every_optimizer():
    """1. every torch optimizer (LBFGS: Horovod refuses to broadcast its state; SparseAdam: sparse test)"""
    classes = sorted((c.__name__, c) for c in torch.optim.Optimizer.__subclasses__()
                     if c.__module__.startswith("torch.optim") and c not in (torch.optim.LBFGS, torch.optim.SparseAdam)
                     and c.__name__ != "Muon")
    return {name: resume_case(cls, "none") for name, cls in classes}


# 2. compressors with feedback and/or compressor state (and step-dependent selection)
# and what every rank must hold alike to make the same collectives: auto's decision (taken after its
# warm-up, before the checkpoint) and sparse reduce-scatter's owner ranges (moved by its rebalance)
SPECS = ["fp16", "topk:ratio=0.3", "topk:ratio=0.3,feedback=ewma", "powersgd:rank=1,min_compression=1",
         "dgc:ratio=0.3", "signum", "randomk:ratio=0.3,shared=1", "qsgd:bits=4", "auto:warmup=2",
         "topk:ratio=0.1,route=twophase"]


def sync_case(sspec):
    """3. sync strategies: strategy state loaded on rank 0 only"""
    model = small_model()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = hvd_ext.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                       named_parameters=model.named_parameters())
    sync = hvd_ext.sync_from_spec(sspec)(opt, model)
    train(model, opt, 0, 3, sync)
    ck = {"model": {k: v.clone() for k, v in model.state_dict().items()}, "opt": opt.state_dict(),
          "sync": sync.state_dict()}
    model = small_model()
    opt = hvd_ext.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                       named_parameters=model.named_parameters())
    sync = hvd_ext.sync_from_spec(sspec)(opt, model)
    if RANK == 0:
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        sync.load_state_dict(ck["sync"])
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    train(model, opt, 3, 5, sync)
    sync.finish()
    return {"spread": spread(model), "steps": sync.state_dict().get("steps")}


def outside_set():
    """4. a process set that excludes rank 1: constructs, steps locally, no communication there"""
    model = small_model()
    before = flat_params(model).clone()
    opt = hvd_ext.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       named_parameters=model.named_parameters(),
                                       compression="topk:ratio=0.5", process_set=only0)
    collectives_before = opt.exchange.stats.collectives
    x, y = small_batch(RANK, 50)
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    expected = before - 0.1 * torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    opt.step()
    return {"included": only0.included(),
            "collectives": opt.exchange.stats.collectives - collectives_before,
            "local_step_err": float((flat_params(model) - expected).abs().max()) if RANK != 0 else None,
            "changed": bool((flat_params(model) - before).abs().max() > 0)}


def check(checks, r):
    c = checks.section("optimizers")
    c.expect("at least 10 torch optimizers", len(r["optimizers"]) >= 10, sorted(r["optimizers"]))
    for name, x in r["optimizers"].items():
        c.expect(f"{name}: the state-creating step moved no parameter", x["after_recipe"] == 0.0, x)
        c.expect(f"{name}: ranks identical, finite", x["spread"] == 0.0 and x["finite"], x)
        c.expect(f"{name}: the same hvd_ext state on the ranks, 6 steps", x["same_hvd_ext_state"] and x["step"] == 6, x)
    c = checks.section("compressors")
    for spec, x in r["compressors"].items():
        c.expect(f"{spec}: no parameter moved by the recipe, ranks identical, finite",
                 x["after_recipe"] == 0.0 and x["spread"] == 0.0 and x["finite"], x)
        c.expect(f"{spec}: rank 1 took rank 0's exchange count (6)", x["step"] == 6, x)
        if spec.startswith("auto"):
            c.expect(f"{spec}: auto had decided before the checkpoint (rank 1 took the decision)",
                     x["decided"][1] is not None and x["decided"][1] <= 3, x)
        if spec != "signum":  # each rank's signum momentum moves on from rank 0's with its own gradients
            c.expect(f"{spec}: the same hvd_ext state on the ranks", x["same_hvd_ext_state"], x)
    c, x = checks.section("compressors"), r["rebalanced"]
    moved = [b for b in x["bounds"] if abs(b[1] - b[-1] / 2) > 1]  # 2 owners: not the even split by size
    c.expect("sparse reduce-scatter: owner ranges moved before the checkpoint, the same on both ranks after "
             "the resume", len(moved) > 0 and x["same_hvd_ext_state"], x)
    c.expect("sparse reduce-scatter resumed: ranks identical, finite", x["spread"] == 0.0 and x["finite"], x)
    c = checks.section("sync")
    for sspec, x in r["sync"].items():
        c.expect(f"{sspec}: ranks identical", x["spread"] == 0.0, x)
    c.expect("local:period=2: rank 1 took rank 0's strategy counters (8 steps)",
             r["sync"]["local:period=2"]["steps"] == 8, r["sync"]["local:period=2"])
    # 2 ranks, process set {0}: rank 1 builds the optimizer and steps locally, no collective
    c, ps = checks.section("outside_set"), r["outside_set"]
    c.expect("included on rank 0 only; the step changed the parameters",
             ps["included"] == (RANK == 0) and ps["changed"], ps)
    if RANK == 1:
        c.expect("rank 1: no collective, exactly a local step", ps["collectives"] == 0 and ps["local_step_err"] < 1e-6,
                 ps)


def main():
    global RANK, SIZE, only0
    only0 = hvd.ProcessSet([0])
    RANK, SIZE = init_horovod(hvd, process_sets=[only0])
    res = {"size": SIZE, "optimizers": every_optimizer(),
           "compressors": {spec: resume_case(torch.optim.SGD, spec) for spec in SPECS},
           "rebalanced": resume_case(torch.optim.SGD, "topk:ratio=0.05,route=twophase", 20, skewed_model),
           "sync": {sspec: sync_case(sspec) for sspec in ["every", "local:period=2", "adaptive:min=1,max=4"]},
           "outside_set": outside_set()}
    report(RANK, res, check)
    hvd.barrier()  # nobody shuts Horovod down while a process set collective still runs


if __name__ == "__main__":
    main()
