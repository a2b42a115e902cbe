"""Non-finite values never reach a parameter average or the parameter server.
argv[1]: avg (LocalSGD / AdaptiveSync, gloo) | event (EventTriggeredSGD, MPI). Each rank checks its
results in-process (named checks, common.Checks)."""
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import horovod.torch as hvd  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import hvd_ext  # noqa: E402
from common import report, init_horovod  # noqa: E402

RANK, SIZE = None, None  # set by main() after hvd.init()


def model_fn():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))


def flat(m):
    return torch.cat([p.detach().reshape(-1) for p in m.parameters()])


def gather(m, name):
    return hvd.allgather(flat(m).unsqueeze(0), name=name)


def poison(m):
    with torch.no_grad():
        m[0].weight[0, 0] = float("nan")


def batch(i):
    g = torch.Generator().manual_seed(100 * RANK + i)
    return torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)


def avg_case(spec, wrap):
    model = model_fn()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    if wrap == "hvd_ext":
        opt = hvd_ext.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    sync = hvd_ext.sync_from_spec(spec)(opt, model)
    for i in range(2):  # local steps, then the average at step 2
        x, y = batch(i)
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        if i == 1 and RANK == 1:
            poison(model)  # rank 1's parameters go bad just before the average
        sync.step(loss)
    allp = gather(model, f"nf.{spec}.{wrap}")
    # a NaN gradient on rank 1 in a local step (hvd_ext optimizer skips it locally)
    x, y = batch(5)
    opt.zero_grad()
    loss = F.cross_entropy(model(x), y) * (float("nan") if RANK == 1 else 1.0)
    loss.backward()
    before = flat(model).clone()
    sync.step(loss)
    local_skip = bool(torch.equal(before, flat(model))) if RANK == 1 else None
    sync.finish()
    return {"finite_all": bool(torch.isfinite(allp).all()),
            "spread": float((allp - allp[0:1]).abs().max()),
            "skipped_syncs": sync.skipped_syncs,
            "nan_grad_step_skipped": local_skip,
            "final_finite": bool(torch.isfinite(gather(model, f"nf2.{spec}.{wrap}")).all())}


def event_case():
    model = model_fn()
    opt = hvd_ext.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                       named_parameters=model.named_parameters())
    sync = hvd_ext.sync_from_spec("event:tau_min=1,tau_max=2,sigma=0")(opt, model)
    for i in range(6):
        x, y = batch(i)
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        if RANK == 1 and i == 2:
            poison(model)
        sync.step(loss)
    sync.finish()
    z = torch.from_numpy(sync.server.pull())
    allp = gather(model, "nf.event")
    res = {"server_finite": bool(torch.isfinite(z).all()), "finite_all": bool(torch.isfinite(allp).all()),
           "spread": float((allp - allp[0:1]).abs().max()), "skipped_pushes": sync.skipped_pushes}
    sync.close()
    return res


def check(checks, res):
    for case, c in res.items():
        if case == "rank":
            continue
        x = checks.section(case)
        if case == "event":
            x.expect("the server and every rank's parameters stay finite, ranks identical",
                     c["server_finite"] and c["finite_all"] and c["spread"] == 0.0, c)
            # rank 1 (poisoned) skipped its push; rank 0 pushed all
            x.expect("skipped pushes: at least 1 on the poisoned rank 1, none on rank 0",
                     c["skipped_pushes"] >= 1 if RANK == 1 else c["skipped_pushes"] == 0, c["skipped_pushes"])
            continue
        x.expect("rank 1's NaN left out of the average: finite, ranks identical",
                 c["finite_all"] and c["spread"] == 0.0, c)
        x.expect("a sync skipped, rank 1 recovered (finite at the end)",
                 c["skipped_syncs"] >= 1 and c["final_finite"], c)
        if RANK == 1:
            # a NaN gradient in a local step: hvd_ext's optimizer skips it; a plain one cannot
            x.expect("a NaN gradient in a local step is skipped by hvd_ext's optimizer, not by a plain one",
                     c["nan_grad_step_skipped"] is case.endswith("hvd_ext"), c["nan_grad_step_skipped"])


def main():
    global RANK, SIZE
    mode = sys.argv[1]
    RANK, SIZE = init_horovod(hvd, mpi_world=mode == "event")
    res = {"rank": RANK}
    if mode == "avg":
        for spec in ["local:period=2", "adaptive:min=2,max=4"]:
            for wrap in ("hvd_ext", "plain"):
                res[f"{spec}|{wrap}"] = avg_case(spec, wrap)
    else:
        res["event"] = event_case()
    report(RANK, res, check)
    hvd.barrier()


if __name__ == "__main__":
    main()
