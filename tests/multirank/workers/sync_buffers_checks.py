"""BatchNorm buffers across 2 ranks (MPI controller): plain data parallel lets them drift,
average_buffers makes them equal; LocalSGD and EventTriggeredSGD end with equal buffers."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from mpi4py import MPI  # noqa: E402

import horovod.torch as hvd  # noqa: E402

hvd.init(comm=MPI.COMM_WORLD)

import hvd_ext  # noqa: E402
from common import emit  # noqa: E402
from hvd_ext.sync import EventTriggeredSGD, LocalSGD, average_buffers, buffer_spread  # noqa: E402

torch.set_num_threads(1)
rank = hvd.rank()


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


out = {}
# 1. every-step gradient averaging: parameters equal, BN buffers not
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

# 2. LocalSGD averages buffers with the parameters
m, opt = make()
s = LocalSGD(opt, m, period=4)
train(m, opt, s, steps=10)  # 10 % 4 != 0: finish() makes the last average
s.finish()
out["local_spread"] = buffer_spread(m)

# 3. EventTriggeredSGD: buffers averaged in finish(); with sync_buffers=False they stay apart
for flag in (True, False):
    m, opt = make()
    s = EventTriggeredSGD(opt, m, tau_min=2, tau_max=4, sync_buffers=flag, progress="thread")
    train(m, opt, s, steps=10)
    s.finish()
    out[f"event_spread_{flag}"] = buffer_spread(m)
    p = torch.cat([q.detach().reshape(-1) for q in m.parameters()])
    out[f"event_param_diff_{flag}"] = float((p - hvd.broadcast(p, 0, name=f"t.ep{flag}")).abs().max())
    s.close()
emit(rank=rank, **out)
