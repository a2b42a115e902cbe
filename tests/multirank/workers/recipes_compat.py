"""Usage patterns of Horovod scripts not covered by horovod_compat.py (which runs under MPI:
every optimizer, duplicate/missing names, clipping inside skip_synchronize, Adasum): here
requires_grad changing between steps, backward_passes_per_step, a module used on one rank only
with a compressed (allgather) exchange, and a parameter never given a gradient. Gloo, 2 ranks. Each
rank checks its results in-process (named checks, common.Checks)."""
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import horovod.torch as hvd  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import hvd_ext  # noqa: E402
from common import report, init_horovod  # noqa: E402

RANK, SIZE = None, None  # set by main() after hvd.init()


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(6, 8)
        self.b = torch.nn.Linear(8, 3)
        self.extra = torch.nn.Linear(8, 3)   # used on rank 0 only
        self.unused = torch.nn.Linear(2, 2)  # never used anywhere

    def forward(self, x, extra=False):
        h = torch.relu(self.a(x))
        return self.b(h) + (self.extra(h) if extra else 0)


def fresh():
    torch.manual_seed(0)
    return Net()


def data(i):
    g = torch.Generator().manual_seed(1000 * RANK + i)
    return torch.randn(5, 6, generator=g), torch.randint(0, 3, (5,), generator=g)


def spread(m, name):
    flat = torch.cat([p.detach().reshape(-1) for p in m.parameters()])
    allp = hvd.allgather(flat.unsqueeze(0), name=name)
    return float((allp - allp[0:1]).abs().max())


def requires_grad_switch(spec):
    """1. requires_grad switched off then on again between steps (fine-tuning schedules)"""
    model = fresh()
    opt = hvd_ext.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       named_parameters=model.named_parameters(), compression=spec)
    frozen_moved = False
    for i in range(6):
        model.a.weight.requires_grad_(not (2 <= i < 4))
        before = model.a.weight.detach().clone()
        opt.zero_grad()
        x, y = data(i)
        F.cross_entropy(model(x), y).backward()
        opt.step()
        if 2 <= i < 4:
            frozen_moved |= not torch.equal(before, model.a.weight.detach())
    return {"spread": spread(model, f"rg.{spec}"), "frozen_moved": frozen_moved}


def backward_passes():
    """2. backward_passes_per_step=2: the step applies the average over ranks of the accumulated gradient"""
    model = fresh()
    opt = hvd_ext.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       named_parameters=model.named_parameters(), backward_passes_per_step=2)
    errs, raised = [], False
    for step in range(2):
        opt.zero_grad()
        for k in range(2):
            x, y = data(10 + 2 * step + k)
            F.cross_entropy(model(x), y).backward()
        local = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        opt.synchronize()
        for n, p in model.named_parameters():
            if n in local:
                errs.append(float((p.grad - hvd.allreduce(local[n], name=f"bpps.{step}.{n}",
                                                          op=hvd.Average)).abs().max()))
        with opt.skip_synchronize():
            opt.step()
    try:  # a third backward before step() is Horovod's AssertionError
        opt.zero_grad()
        for k in range(3):
            F.cross_entropy(model(data(20)[0]), data(20)[1]).backward()
    except AssertionError:
        raised = True
    return {"err": max(errs), "spread": spread(model, "bpps"), "third_backward_raises": raised}


def one_rank_module():
    """3. a module used on rank 0 only, with an allgather codec; a parameter nobody uses"""
    model = fresh()
    opt = hvd_ext.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                       named_parameters=model.named_parameters(), compression="qsgd:bits=8")
    for i in range(3):
        opt.zero_grad()
        x, y = data(30 + i)
        F.cross_entropy(model(x, extra=(RANK == 0)), y).backward()
        opt.step()
    return {"spread": spread(model, "orm"),
            "extra_moved": bool((model.extra.weight.detach() - fresh().extra.weight).abs().max() > 0),
            "unused_grad_zero": bool(model.unused.weight.grad is None
                                     or float(model.unused.weight.grad.abs().max()) == 0.0)}


def check(c, res):
    for spec in ("none", "topk:ratio=0.5"):
        x = res[f"requires_grad|{spec}"]
        c.expect(f"requires_grad|{spec}: ranks identical", x["spread"] == 0.0, x)
        c.expect(f"requires_grad|{spec}: a frozen parameter does not move, not even by feedback",
                 not x["frozen_moved"], x)
    c.expect("bpps: the ranks' average of the accumulated gradient, ranks identical, a third backward raises",
             res["bpps"] == {"err": 0.0, "spread": 0.0, "third_backward_raises": True}, res["bpps"])
    o = res["one_rank_module"]
    c.expect("one_rank_module: ranks identical, the rank-0-only module moved, an unused parameter's gradient zero",
             o["spread"] == 0.0 and o["extra_moved"] and o["unused_grad_zero"], o)


def main():
    global RANK, SIZE
    RANK, SIZE = init_horovod(hvd)
    res = {"rank": RANK}
    for spec in ("none", "topk:ratio=0.5"):
        res[f"requires_grad|{spec}"] = requires_grad_switch(spec)
    res["bpps"] = backward_passes()
    res["one_rank_module"] = one_rank_module()
    report(RANK, res, check)
    hvd.barrier()


if __name__ == "__main__":
    main()
