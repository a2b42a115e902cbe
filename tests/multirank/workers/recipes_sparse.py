"""Sparse embeddings: gradients exchanged as indices + values and handed back sparse (SparseAdam,
SGD), or dense with sparse_as_dense=True. Gloo, 2 ranks. Each rank checks its results in-process
(named checks, common.Checks)."""
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import horovod.torch as hvd  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import hvd_ext  # noqa: E402
from common import report, init_horovod  # noqa: E402

RANK = None  # set by main() after hvd.init()
VOCAB, DIM = 1000, 16


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, DIM, sparse=True)
        self.head = torch.nn.Linear(DIM, 3)

    def forward(self, tok):
        return self.head(self.emb(tok).mean(1))


def fresh():
    torch.manual_seed(0)
    return Net()


def data(i):
    g = torch.Generator().manual_seed(1000 * RANK + i)
    return torch.randint(0, VOCAB, (4, 3), generator=g), torch.randint(0, 3, (4,), generator=g)


def spread(m, name):
    flat = torch.cat([p.detach().reshape(-1) for p in m.parameters()])
    allp = hvd.allgather(flat.unsqueeze(0), name=name)
    return float((allp - allp[0:1]).abs().max())


def run(case, make_opts, steps=3, check_grad=False):
    model = fresh()
    opts = make_opts(model)
    for o in opts:
        hvd.broadcast_optimizer_state(o, root_rank=0)  # Horovod sets sparse zero grads for SparseAdam
    out = {"sparse_grad": [], "err": 0.0, "bytes": []}
    for i in range(steps):
        for o in opts:
            o.zero_grad()
        tok, y = data(i)
        before = [o.exchange.stats.bytes_sent for o in opts]  # hooks start exchanges during backward
        F.cross_entropy(model(tok), y).backward()
        local = model.emb.weight.grad.to_dense().clone()
        for o in opts:
            o.synchronize()
        out["bytes"].append(sum(o.exchange.stats.bytes_sent - b for o, b in zip(opts, before)))
        g = model.emb.weight.grad
        out["sparse_grad"].append(bool(g.is_sparse))
        if check_grad:
            want = hvd.allreduce(local, name=f"{case}.{i}", op=hvd.Average)
            out["err"] = max(out["err"], float((g.to_dense() - want).abs().max()))
        for o in opts:
            with o.skip_synchronize():
                o.step()
    out["spread"] = spread(model, case)
    return out


def horovod_sparse_embeddings():
    """Horovod's test_sparse_embeddings: SparseAdam, no named_parameters, ranks with different batch
    shapes, the plain zero_grad/backward/step loop; the first step too must hand back sparse grads."""
    out = {}
    for as_dense in (False, True):
        torch.manual_seed(0)
        emb = torch.nn.Embedding(10, 3, sparse=True)
        inp = torch.LongTensor([[1, 2, 4, 5], [4, 3, 2, 9]] if RANK == 0 else [[1, 3, 4], [4, 7, 9]])
        opt = hvd_ext.DistributedOptimizer(torch.optim.SparseAdam(list(emb.parameters()), lr=0.1),
                                           sparse_as_dense=as_dense)
        sparse = []
        for _ in range(2):
            opt.zero_grad()
            emb(inp).sum().backward()
            opt.step()
            sparse.append(bool(emb.weight.grad.is_sparse))
        out[f"as_dense={as_dense}"] = {"sparse_grad": sparse, "spread": spread(emb, f"hse.{as_dense}")}
    return out


def check(c, r):
    for case in ("sgd", "sgd_topk", "sparse_adam"):
        x = r[case]
        c.expect(f"{case}: gradients handed back sparse, the ranks' average, ranks identical",
                 all(x["sparse_grad"]) and x["spread"] == 0.0 and x["err"] < 1e-6, x)
        # first step learns which gradients are sparse (dense exchange); then indices + values only
        c.expect(f"{case}: after the first step, indices + values only (under 1/20 of dense bytes)",
                 max(x["bytes"][1:]) * 20 < r["dense_bytes"], (x["bytes"], r["dense_bytes"]))
    d = r["as_dense"]  # exchanged dense, handed back sparse (Horovod's sparse_as_dense)
    c.expect("as_dense: handed back sparse, the ranks' average, ranks identical",
             all(d["sparse_grad"]) and d["spread"] == 0.0 and d["err"] < 1e-6, d)
    c.expect("as_dense: exchanged dense", min(d["bytes"]) >= r["dense_bytes"], (d["bytes"], r["dense_bytes"]))
    for case, h in r["horovod_sparse_embeddings"].items():  # SparseAdam from the first step
        c.expect(f"horovod_sparse_embeddings {case}: sparse gradients from the first step, ranks identical",
                 h["sparse_grad"] == [True, True] and h["spread"] == 0.0, h)


def main():
    global RANK
    RANK, _ = init_horovod(hvd)
    res = {"rank": RANK}
    res["sgd"] = run("sgd", lambda m: [hvd_ext.DistributedOptimizer(
        torch.optim.SGD(m.parameters(), lr=0.5), named_parameters=m.named_parameters())], check_grad=True)
    res["sgd_topk"] = run("sgd_topk", lambda m: [hvd_ext.DistributedOptimizer(
        torch.optim.SGD(m.parameters(), lr=0.5, momentum=0.9), named_parameters=m.named_parameters(),
        compression="topk:ratio=0.3")])
    res["sparse_adam"] = run("sparse_adam", lambda m: [
        hvd_ext.DistributedOptimizer(torch.optim.SparseAdam(list(m.emb.parameters()), lr=0.01),
                                     named_parameters=list(m.emb.named_parameters())),
        hvd_ext.DistributedOptimizer(torch.optim.Adam(m.head.parameters(), lr=0.01),
                                     named_parameters=list(m.head.named_parameters()))], check_grad=True)
    res["as_dense"] = run("as_dense", lambda m: [hvd_ext.DistributedOptimizer(
        torch.optim.SGD(m.parameters(), lr=0.5), named_parameters=m.named_parameters(), sparse_as_dense=True)],
        check_grad=True)
    res["horovod_sparse_embeddings"] = horovod_sparse_embeddings()
    res["dense_bytes"] = VOCAB * DIM * 4
    report(RANK, res, check)
    hvd.barrier()


if __name__ == "__main__":
    main()
