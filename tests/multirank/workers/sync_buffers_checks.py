"""BatchNorm buffers across 2 ranks (MPI controller): plain data parallel lets them drift,
average_buffers makes them equal; LocalSGD and EventTriggeredSGD end with equal buffers. Each rank
checks its results in-process (named checks, common.Checks)."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from mpi4py import MPI  # noqa: E402

import horovod.torch as hvd  # noqa: E402

import hvd_ext  # noqa: E402
from common import Checks  # noqa: E402
from hvd_ext.sync import EventTriggeredSGD, LocalSGD, average_buffers, buffer_spread  # noqa: E402

rank = None  # set by main() after hvd.init()


def make():
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    opt = hvd_ext.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9),
                                       named_parameters=m.named_parameters())
    hvd.broadcast_parameters(m.state_dict(), root_rank=0)
    return m, opt


def batches(n):
    g = torch.Generator().manual_seed(100 + rank)
    for _ in range(n):  # each rank's inputs have a different mean and scale (non-IID)
        yield torch.randn(16, 8, generator=g) * (1 + rank) + 3 * rank, torch.randint(0, 3, (16,), generator=g)


def bufvec(m):
    return torch.cat([b.reshape(-1).double() for b in m.buffers() if b.is_floating_point()])


def train(m, opt, sync=None, steps=12):
    for x, y in batches(steps):
        opt.zero_grad()
        loss = F.cross_entropy(m(x), y)
        loss.backward()
        sync.step(loss) if sync is not None else opt.step()


def every_step(out):
    """1. every-step gradient averaging: parameters equal, BN buffers not"""
    m, opt = make()
    train(m, opt)
    before = bufvec(m)
    allb = hvd.allgather_object(before.tolist(), name="t.before")
    out["every_spread"] = buffer_spread(m)
    nbytes = average_buffers(m)
    after = bufvec(m)
    mean = torch.tensor(allb, dtype=torch.float64).mean(0)
    out["avg_err"] = float((after - mean).abs().max())
    out["avg_bytes"] = nbytes
    out["every_spread_after"] = buffer_spread(m)
    p = torch.cat([q.detach().reshape(-1) for q in m.parameters()])
    out["param_diff"] = float((p - hvd.broadcast(p, 0, name="t.p")).abs().max())


def local(out):
    """2. LocalSGD averages buffers with the parameters"""
    m, opt = make()
    s = LocalSGD(opt, m, period=4)
    train(m, opt, s, steps=10)  # 10 % 4 != 0: finish() makes the last average
    s.finish()
    out["local_spread"] = buffer_spread(m)


def event(out):
    """3. EventTriggeredSGD: buffers averaged in finish(); with sync_buffers=False they stay apart"""
    for flag in (True, False):
        m, opt = make()
        s = EventTriggeredSGD(opt, m, tau_min=2, tau_max=4, sync_buffers=flag, progress="thread")
        train(m, opt, s, steps=10)
        s.finish()
        out[f"event_spread_{flag}"] = buffer_spread(m)
        p = torch.cat([q.detach().reshape(-1) for q in m.parameters()])
        out[f"event_param_diff_{flag}"] = float((p - hvd.broadcast(p, 0, name=f"t.ep{flag}")).abs().max())
        s.close()


def check(c, r):
    c.expect("gradients averaged: parameters identical", r["param_diff"] == 0.0, r["param_diff"])
    c.expect("... but the BN running stats are not", r["every_spread"] > 0.05, r["every_spread"])
    c.expect("average_buffers = mean of the ranks' buffers", r["avg_err"] < 1e-6, r["avg_err"])
    c.expect("buffers equal after average_buffers", r["every_spread_after"] == 0.0, r["every_spread_after"])
    c.expect("average_buffers sends running_mean + running_var (float32), not the int counter",
             r["avg_bytes"] == 4 * 2 * 16, r["avg_bytes"])
    c.expect("LocalSGD ends with equal buffers", r["local_spread"] == 0.0, r["local_spread"])
    c.expect("EventTriggeredSGD(sync_buffers=True) ends with equal buffers and parameters",
             r["event_spread_True"] == 0.0 and r["event_param_diff_True"] == 0.0,
             (r["event_spread_True"], r["event_param_diff_True"]))
    c.expect("EventTriggeredSGD(sync_buffers=False): buffers apart, parameters equal",
             r["event_spread_False"] > 0.05 and r["event_param_diff_False"] == 0.0,
             (r["event_spread_False"], r["event_param_diff_False"]))


def main():
    global rank
    hvd.init(comm=MPI.COMM_WORLD)
    torch.set_num_threads(1)
    rank = hvd.rank()
    out = {}
    every_step(out)
    local(out)
    event(out)
    checks = Checks(rank)
    check(checks, out)
    checks.emit(rank=rank, **out)


if __name__ == "__main__":
    main()
