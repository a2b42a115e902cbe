"""ParameterServer / EventTriggeredSGD checks on 2 ranks (MPI controller, one shared MPI world)."""
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import numpy as np  # noqa: E402
import torch  # noqa: E402
from mpi4py import MPI  # noqa: E402

import horovod.torch as hvd  # noqa: E402

hvd.init(comm=MPI.COMM_WORLD)  # one MPI world shared by mpi4py and Horovod

import hvd_ext  # noqa: E402
from common import emit  # noqa: E402
from hvd_ext.sync import ParameterServer  # noqa: E402

torch.set_num_threads(1)
comm = MPI.COMM_WORLD
rank, size = hvd.rank(), hvd.size()
out = {"rank": rank, "size": size, "mpi_rank": comm.Get_rank(), "thread_level": MPI.Query_thread()}

# 1. concurrent accumulates from all ranks sum exactly (no barrier between pushes)
n = 1001
ps = ParameterServer(n, init=np.arange(n, dtype=np.float64), progress="thread")
R = 200
for i in range(R):
    ps.push(np.full(n, float(rank + 1)))
    if i % 50 == 0:
        ps.push_pull(np.zeros(n))
ps.barrier()
z = ps.pull()
expected = np.arange(n) + R * sum(r + 1 for r in range(size))
board = ps.post_board(0.5 + rank, 10 * (rank + 1))
ps.barrier()
board = ps.read_board()
sd = ps.state_dict()
ps.barrier()
ps.push(np.ones(n))
ps.barrier()
ps.load_state_dict(sd)
z2 = ps.pull()
out["rma"] = {"max_err": float(np.abs(z - expected).max()), "pushes": ps.pushes,
              "board": board.tolist(), "restore_err": float(np.abs(z2 - sd["z"]).max()),
              "progress": ps.progress}
ps.close()


def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


def batch(step):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(16, 6, generator=g), torch.randint(0, 3, (16,), generator=g)


def flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def spread(model, name):
    allp = hvd.allgather(flat(model).unsqueeze(0), name=name)
    return float((allp - allp[0]).abs().max())


def run(steps=None, seconds=None, slow=1.0, **kw):
    m = make_model()
    o = hvd_ext.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9),
                                     named_parameters=m.named_parameters())
    s = hvd_ext.EventTriggeredSGD(o, m, **kw)
    at = []
    t0 = time.perf_counter()
    t = 0
    while (steps is not None and t < steps) or (seconds is not None and time.perf_counter() - t0 < seconds):
        tc = time.perf_counter()
        o.zero_grad()
        x, y = batch(t)
        loss = torch.nn.functional.cross_entropy(m(x), y)
        loss.backward()
        time.sleep(0.004)  # "compute"
        if slow > 1:
            time.sleep((slow - 1) * (time.perf_counter() - tc))
        s.step(loss)
        if o.stats.last["exchanged"]:
            at.append(t + 1)
        t += 1
    s.finish()
    res = {"at": at, "reasons": dict(s.reasons), "weights": list(s.weights), "delays": list(s.delays),
           "steps": s.steps, "exchanges": s.exchanges, "stats_exchanges": o.stats.exchanges,
           "spread": spread(m, f"ev.spread.{kw['tau_max']}.{seconds}")}
    s.close()
    return res


# 2. trigger: sigma huge -> only tau_max fires; sigma 0 -> threshold fires at tau_min
out["tau_max_only"] = run(steps=20, sigma=1e12, tau_min=2, tau_max=5)
out["threshold"] = run(steps=20, sigma=0.0, tau_min=3, tau_max=7)
# constructed drift: sigma moderate, tau_min=1; drift triggers well before tau_max
out["drift"] = run(steps=20, sigma=1e-6, tau_min=1, tau_max=50, staleness="none")
# 3. one rank 3x slower, asynchronous for 4 s: no deadlock, fast rank makes more local steps
slow = run(seconds=4.0, slow=3.0 if rank == 1 else 1.0, sigma=1e-4, tau_min=2, tau_max=8,
           staleness="loss", gamma=1.0)
# keep the RESULT line short (launchers split long lines)
out["slow"] = {k: slow[k] for k in ("reasons", "steps", "exchanges", "stats_exchanges", "spread")}
out["slow"].update(max_delay=max(slow["delays"]), min_weight=min(slow["weights"]), n_weights=len(slow["weights"]))
emit(**out)
