"""Non-finite values never reach a parameter average or the parameter server.
argv[1]: avg (LocalSGD / AdaptiveSync, gloo) | event (EventTriggeredSGD, MPI)."""
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import horovod.torch as hvd  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import hvd_ext  # noqa: E402
from common import emit  # noqa: E402

mode = sys.argv[1]
if mode == "event":
    from mpi4py import MPI

    hvd.init(comm=MPI.COMM_WORLD)
else:
    hvd.init()
torch.set_num_threads(1)
RANK, SIZE = hvd.rank(), hvd.size()


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


res = {"rank": RANK}
if mode == "avg":
    for spec in ["local:period=2", "adaptive:min=2,max=4"]:
        for wrap in ("hvd_ext", "plain"):
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
            res[f"{spec}|{wrap}"] = {"finite_all": bool(torch.isfinite(allp).all()),
                                     "spread": float((allp - allp[0:1]).abs().max()),
                                     "skipped_syncs": sync.skipped_syncs,
                                     "nan_grad_step_skipped": local_skip,
                                     "final_finite": bool(torch.isfinite(gather(model, f"nf2.{spec}.{wrap}")).all())}
else:
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
    res["event"] = {"server_finite": bool(torch.isfinite(z).all()), "finite_all": bool(torch.isfinite(allp).all()),
                    "spread": float((allp - allp[0:1]).abs().max()), "skipped_pushes": sync.skipped_pushes}
    sync.close()
emit(**res)
hvd.barrier()
