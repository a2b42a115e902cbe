"""2-rank check of the quantization family through the real pipeline and exchange.

* signsgd:scale=none: each rank sets known gradients; the applied gradient must be the
  bare majority vote sign(sign_0 + sign_1) (0 on ties).
* powersgd:rank=2: rank i's gradient is A + (-1)^i B with A rank 2 and B small
  noise; the averaged update must equal A (rank 2) after the P/Q allreduce rounds,
  identical on both ranks, and the vector (bias) is sent uncompressed.
* qdist:budget=3: 2 steps on a tiny MLP; decoded averaged gradients agree bit for bit.

Each rank checks its results in-process (named checks, common.Checks).
"""
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import torch  # noqa: E402
import horovod.torch as hvd  # noqa: E402

import hvd_ext  # noqa: E402
from common import Checks  # noqa: E402


def set_and_sync(opt, params, grads):
    for p, g in zip(params, grads):
        p.grad = g.clone()
        opt._pipeline.mark_ready(p)
    opt.synchronize()
    return [p.grad.clone() for p in params]


def gathered_equal(t):
    g = hvd.allgather(t.reshape(1, -1))
    return bool(torch.equal(g[0], g[1]))


def main():
    hvd.init()
    rank = hvd.rank()
    out = {"rank": rank, "size": hvd.size()}

    # ---- signsgd majority vote
    w = torch.nn.Parameter(torch.zeros(8))
    opt = hvd_ext.DistributedOptimizer(torch.optim.SGD([w], lr=1.0), named_parameters=[("w", w)],
                                       compression="signsgd:scale=none")
    mine = [torch.tensor([3., 2., -1., -5., 0.5, -0.5, 1., -1.]),
            torch.tensor([1., -2., 4., -5., 0.7, 0.25, -2., 3.])][rank]
    res = set_and_sync(opt, [w], [mine])[0]
    out["vote"] = res.tolist()
    out["vote_bytes"] = opt.exchange.stats.bytes_sent

    # ---- powersgd rank 2 over real allreduce rounds
    torch.manual_seed(0)
    A = torch.randn(12, 2) @ torch.randn(2, 9)
    B = 0.1 * torch.randn(12, 9)
    M = torch.nn.Parameter(torch.zeros(12, 9))
    v = torch.nn.Parameter(torch.zeros(12))
    opt = hvd_ext.DistributedOptimizer(torch.optim.SGD([M, v], lr=1.0), named_parameters=[("M", M), ("v", v)],
                                       compression="powersgd:rank=2,warmup=0")
    vec = torch.arange(12.0) * (rank + 1)
    gm, gv = set_and_sync(opt, [M, v], [A + (B if rank == 0 else -B), vec])
    out["psgd_err"] = float((gm - A).abs().max())
    out["psgd_vec_err"] = float((gv - torch.arange(12.0) * 1.5).abs().max())
    out["psgd_agree"] = gathered_equal(gm)
    out["psgd_has_q"] = "M" in opt.compression.q_memory
    # residual memory after the step: M_i - approx, so the two ranks' memories sum to 0 here
    mem = opt.compression.feedback._pending.get("M", opt.compression.feedback.memory.get("M"))
    msum = hvd.allreduce(mem, op=hvd.Sum)
    out["psgd_mem_sum"] = float(msum.abs().max())

    # ---- qdist with a per-layer bit budget through the pipeline
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(10, 32), torch.nn.Tanh(), torch.nn.Linear(32, 3))
    opt = hvd_ext.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       named_parameters=model.named_parameters(), compression="qdist:budget=3")
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    gen = torch.Generator().manual_seed(rank)
    agree = []
    for _ in range(2):
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(torch.randn(8, 10, generator=gen)),
                                                 torch.randint(0, 3, (8,), generator=gen))
        loss.backward()
        opt.synchronize()
        agree.append(gathered_equal(torch.cat([p.grad.reshape(-1) for p in model.parameters()])))
        with opt.skip_synchronize():
            opt.step()
    out["qdist_agree"] = agree
    out["qdist_params_agree"] = gathered_equal(torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
    out["qdist_bits"] = {k: b for k, (s, b) in opt.compression._alloc.items()}
    checks = Checks(rank)
    check(checks, out)
    checks.emit(**out)


def check(c, r):
    c.expect("signsgd: the applied gradient is the bare majority vote (0 on ties)",
             r["vote"] == [1.0, 0.0, 0.0, -1.0, 1.0, 0.0, 0.0, 0.0], r["vote"])
    # exchange header 12 + 1 byte of signs (a frame's last payload is not padded)
    c.expect("signsgd: 13 bytes sent", r["vote_bytes"] == 13, r["vote_bytes"])
    c.expect("powersgd: the averaged update is A (rank 2)", r["psgd_err"] < 1e-4, r["psgd_err"])
    c.expect("powersgd: the vector is sent uncompressed (exact mean)", r["psgd_vec_err"] == 0.0, r["psgd_vec_err"])
    c.expect("powersgd: ranks agree bit for bit", r["psgd_agree"])
    c.expect("powersgd: Q memory kept for the matrix", r["psgd_has_q"])
    c.expect("powersgd: the ranks' residual memories sum to 0", r["psgd_mem_sum"] < 1e-4, r["psgd_mem_sum"])
    c.expect("qdist: decoded averaged gradients agree bit for bit at both steps", r["qdist_agree"] == [True, True],
             r["qdist_agree"])
    c.expect("qdist: parameters agree", r["qdist_params_agree"])
    c.expect("qdist: a bit width for every tensor",
             set(r["qdist_bits"]) == {"0.weight", "0.bias", "2.weight", "2.bias"}, r["qdist_bits"])


if __name__ == "__main__":
    main()
