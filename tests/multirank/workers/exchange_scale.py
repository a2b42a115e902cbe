"""Two-phase and sparse reduce-scatter routes on real Horovod ranks (any N).

For each spec: every rank computes a gradient on its own data, the real
DistributedOptimizer exchanges it (Horovod alltoall + allgather), and rank 0
replays the same per-rank gradients on the in-process simulated world. The
two must agree bit for bit (same code, same bytes), byte counts included;
after a few optimizer steps every rank holds the same parameters."""
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import horovod.torch as hvd  # noqa: E402
import torch  # noqa: E402

import hvd_ext  # noqa: E402
from common import Checks, exchanged_steps  # noqa: E402
from hvd_ext.testing.harness import run_pipeline  # noqa: E402

SPECS = ["qsgd:bits=8,route=twophase", "efsignsgd:route=twophase", "topk:ratio=0.02,route=twophase",
         "sig:ratio=0.02,route=twophase", "topk:ratio=0.02", "qdist:bits=3", "fp16", "bf16"]
ROUTES = {"bf16": ["allreduce"], "fp16": ["allreduce"], "qsgd:bits=8,route=twophase": ["twophase"],
          "topk:ratio=0.02,route=twophase": ["sparse_rs"]}


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.ReLU(), torch.nn.Linear(64, 5))


def one_spec(spec, rank, size):
    m = model()
    # momentum 0: with SGD momentum the residual feedback takes it over (momentum correction), which
    # the optimizer-less replay below does not do; the exchanged gradients are what is compared
    opt = hvd_ext.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1),
                                       named_parameters=m.named_parameters(), compression=spec)
    hvd.broadcast_parameters(m.state_dict(), root_rank=0)
    names = [n for n, _ in m.named_parameters()]
    raw, real, recv = exchanged_steps(m, opt, model, rank, 3)
    gathered = hvd.allgather_object(raw, name=f"raw.{spec}")
    flat = torch.cat([p.detach().reshape(-1) for p in m.parameters()])
    allp = hvd.allgather(flat.unsqueeze(0), name=f"params.{spec}")
    res = {"routes": list(opt._pipeline.routes), "spread": float((allp - allp[0:1]).abs().max())}
    # replay: the first step's parameters are the broadcast ones; gradients per rank as computed
    grads = [[gathered[r][s] for r in range(size)] for s in range(3)]
    sim = run_pipeline(spec, grads, size, params={n: p for n, p in model().named_parameters()})[rank]
    # sig scores by |w|: the replay keeps the first step's weights, so only step 0 compares for it
    steps = range(1) if spec.startswith("sig") else range(3)
    res["bitwise"] = all(torch.equal(sim.results[s][n], real[s][n]) for s in steps for n in names)
    res["max_diff"] = max(float((sim.results[s][n] - real[s][n]).abs().max()) for s in range(3) for n in names)
    res["sim_recv"] = sim.received[:len(steps)]
    res["recv"] = recv[:len(steps)]
    return res


def main():
    hvd.init()
    torch.set_num_threads(1)
    rank, size = hvd.rank(), hvd.size()
    checks = Checks(rank)
    out = {"size": size}
    for spec in SPECS:
        x = out[spec] = one_spec(spec, rank, size)
        checks.expect(f"{spec}: exchanged gradients bit for bit the simulated world's", x["bitwise"], x["max_diff"])
        checks.expect(f"{spec}: bytes received equal the simulated world's", x["recv"] == x["sim_recv"],
                      (x["recv"], x["sim_recv"]))
        checks.expect(f"{spec}: ranks hold identical parameters", x["spread"] == 0.0, x["spread"])
        if spec in ROUTES:
            checks.expect(f"{spec}: routes are {ROUTES[spec]}", x["routes"] == ROUTES[spec], x["routes"])
    checks.emit(**out)


if __name__ == "__main__":
    main()
