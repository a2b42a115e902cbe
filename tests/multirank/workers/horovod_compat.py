"""A standard Horovod training script's usage patterns, with hvd.DistributedOptimizer
replaced by hvd_ext.DistributedOptimizer (launched with the MPI controller and mpirun). Each rank
checks its results in-process (named checks, common.Checks); one RESULT line per rank."""
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import horovod.torch as hvd  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import hvd_ext  # noqa: E402
from common import report, init_horovod  # noqa: E402

RANK, SIZE = None, None  # set by main() after hvd.init()
DistributedOptimizer = hvd_ext.DistributedOptimizer  # the one-line change


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(6, 8)
        self.b = torch.nn.Linear(8, 2)
        self.extra = torch.nn.Linear(8, 2)  # used on rank 0 only (dynamic graph)

    def forward(self, x, use_extra=False):
        h = torch.relu(self.a(x))
        out = self.b(h)
        return out + self.extra(h) if use_extra else out


def data(i):
    g = torch.Generator().manual_seed(1000 * RANK + i)
    return torch.randn(4, 6, generator=g), torch.randint(0, 2, (4,), generator=g)


def spread(model):
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    allp = hvd.allgather(flat.unsqueeze(0))
    return float((allp - allp[0:1]).abs().max())


def fresh():
    torch.manual_seed(0)
    m = Net()
    hvd.broadcast_parameters(m.state_dict(), root_rank=0)
    return m


def typical(res):
    """1. Typical script: lr scaled by size, scheduler, broadcast state, clipping via synchronize()."""
    model = fresh()
    opt = torch.optim.SGD(model.parameters(), lr=0.01 * SIZE, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)  # built BEFORE wrapping
    opt = DistributedOptimizer(opt, named_parameters=model.named_parameters(), compression=hvd.Compression.fp16)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    for i in range(4):
        opt.zero_grad()
        x, y = data(i)
        F.cross_entropy(model(x, use_extra=(RANK == 0)), y).backward()
        opt.synchronize()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        with opt.skip_synchronize():
            opt.step()
        sched.step()
    res["typical_spread"] = spread(model)
    res["typical_lr"] = opt.param_groups[0]["lr"]


def op_sum(res, x, y):
    """2. No named_parameters, Adam, op=Sum equals the sum of gradients."""
    model = fresh()
    opt = DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-3), op=hvd.Sum)
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    mine = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    opt.synchronize()
    err = 0.0
    for p, g in zip([p for p in model.parameters() if p.grad is not None and p is not model.extra.weight
                     and p is not model.extra.bias], mine):
        err = max(err, float((p.grad - hvd.allreduce(g, op=hvd.Sum)).abs().max()))
    with opt.skip_synchronize():
        opt.step()
    res["sum_err"] = err


def predivide(res, x, y):
    """3. gradient_predivide_factor still averages."""
    model = fresh()
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters(),
                               gradient_predivide_factor=2.0)
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    mine = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    opt.synchronize()
    res["predivide_err"] = max(float((dict(model.named_parameters())[n].grad
                                      - hvd.allreduce(g, op=hvd.Average)).abs().max()) for n, g in mine.items())
    with opt.skip_synchronize():
        opt.step()


def adasum(res):
    """4. Adasum pass-through runs and keeps ranks identical."""
    model = fresh()
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters(),
                               op=hvd.Adasum)
    for i in range(2):
        opt.zero_grad()
        F.cross_entropy(model(*data(20 + i)[:1]), data(20 + i)[1]).backward()
        opt.step()
    res["adasum_spread"] = spread(model)


def user_errors(res, x, y):
    """5. Errors Horovod users rely on."""
    model = fresh()
    errors = {}
    try:
        DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                             named_parameters=[("same", p) for p in model.parameters()])
    except ValueError as e:
        errors["duplicate"] = "duplicates" in str(e)
    try:
        DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                             named_parameters=list(model.named_parameters())[:2])
    except ValueError as e:
        errors["unnamed"] = "not named" in str(e)
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters())
    F.cross_entropy(model(x), y).backward()
    try:
        opt.zero_grad()
    except AssertionError:
        errors["zero_grad_race"] = True
    opt.step()
    res["errors"] = errors


def every_optimizer(res):
    """6. Every torch optimizer: wrap, step, broadcast its state, checkpoint round trip."""
    opt_ok = {}
    classes = sorted((c.__name__, c) for c in torch.optim.Optimizer.__subclasses__()
                     if c.__module__.startswith("torch.optim") and c not in (torch.optim.LBFGS, torch.optim.SparseAdam))
    for name, cls in classes:
        model = fresh()
        kwargs = {"lr": 0.01}
        if cls is torch.optim.SGD:
            kwargs["momentum"] = 0.9
        # Muon: 2-D only
        named = [(n, p) for n, p in model.named_parameters() if cls.__name__ != "Muon" or p.dim() == 2]
        # warmup=1: adaptive ones (Adam, RMSprop, Adagrad...) run with their second moment frozen
        opt = DistributedOptimizer(cls([p for _, p in named], **kwargs), named_parameters=named,
                                   compression="randomk:ratio=0.5,warmup=1")
        for i in range(3):
            opt.zero_grad()
            F.cross_entropy(model(data(30 + i)[0]), data(30 + i)[1]).backward()
            opt.step()
        hvd.broadcast_optimizer_state(opt, root_rank=0)
        sd = opt.state_dict()
        opt.load_state_dict(sd)
        opt_ok[name] = spread(model) == 0.0 and isinstance(opt, cls) and "hvd_ext" in sd
    res["optimizers"] = opt_ok


def frozen_param(res):
    """7. A parameter that does not require grad stays without grad (Horovod's no-grad broadcast case)."""
    frozen = torch.nn.Parameter(torch.ones(2), requires_grad=False)
    live = torch.nn.Parameter(torch.rand(4))
    opt = DistributedOptimizer(torch.optim.SGD([frozen, live], lr=0.001, momentum=0.9, nesterov=True),
                               named_parameters=[("frozen", frozen), ("live", live)])
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    res["frozen_grad_is_none"] = frozen.grad is None and live.grad is not None


def check(c, res):
    c.expect("horovod runs with the MPI controller", res["mpi"] is True, res["mpi"])
    c.expect("typical script: ranks identical", res["typical_spread"] == 0.0, res["typical_spread"])
    c.expect("typical script: lr scaled by size then halved twice by the scheduler (0.005)",
             abs(res["typical_lr"] - 0.005) <= 1e-6 * 0.005, res["typical_lr"])  # pytest.approx's tolerance
    c.expect("op=Sum exchanges the sum of the gradients", res["sum_err"] < 1e-6, res["sum_err"])
    c.expect("gradient_predivide_factor still averages", res["predivide_err"] < 1e-6, res["predivide_err"])
    c.expect("Adasum pass-through keeps ranks identical", res["adasum_spread"] == 0.0, res["adasum_spread"])
    c.expect("duplicate names, unnamed parameters and zero_grad before step raise",
             res["errors"] == {"duplicate": True, "unnamed": True, "zero_grad_race": True}, res["errors"])
    c.expect("every torch optimizer (at least 10) wraps, steps, broadcasts and round-trips its state",
             len(res["optimizers"]) >= 10 and all(res["optimizers"].values()), res["optimizers"])
    c.expect("a parameter without requires_grad stays without grad", res["frozen_grad_is_none"])


def main():
    global RANK, SIZE
    RANK, SIZE = init_horovod(hvd)
    res = {"size": SIZE, "mpi": hvd.mpi_enabled()}
    typical(res)
    x, y = data(10)
    op_sum(res, x, y)
    predivide(res, x, y)
    adasum(res)
    user_errors(res, x, y)
    every_optimizer(res)
    frozen_param(res)
    report(RANK, res, check)


if __name__ == "__main__":
    main()
