"""2-rank check of the sparsification family through the real pipeline and exchange.

For each spec: same model on both ranks, different data per rank, 3 steps.
After every synchronize() the decoded averaged gradients are allgathered and
compared bit for bit; parameters are compared at the end. For exact top-k the
step-0 result is also checked against (topk(g_0) + topk(g_1)) / 2 computed
from both ranks' raw gradients, and the bytes sent against wire_bytes(). Each rank checks these
in-process (named checks, common.Checks).
"""
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import torch  # noqa: E402
import horovod.torch as hvd  # noqa: E402

import hvd_ext  # noqa: E402
from hvd_ext.compression._sparse import topk_indices, count_for  # noqa: E402
from common import Checks  # noqa: E402

SPECS = [
    "topk:ratio=0.01,scope=layer",
    "topk:ratio=0.01,mode=sampled,values=fp16,scope=layer",
    "topk:ratio=0.02,scope=model,feedback=ewma,lambda=0.5",
    "threshold:tau=0.002",
    "dgc:ratio=0.01,mode=exact,ramp_steps=2,ramp_stages=2,clip=5",
    "sig:ratio=0.01,alpha=1",
]


def model():
    torch.manual_seed(0)
    # 40*2000 = 80000 weights > 65536: exercises the chunked 16-bit index format
    return torch.nn.Sequential(torch.nn.Linear(40, 2000), torch.nn.Tanh(), torch.nn.Linear(2000, 3))


def flat_grads(m):
    return torch.cat([p.grad.reshape(-1) for p in m.parameters()])


def main():
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    out = {"rank": rank, "size": size, "specs": {}}
    for si, spec in enumerate(SPECS):
        m = model()
        opt = hvd_ext.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1),
                                           named_parameters=m.named_parameters(), compression=spec)
        hvd.broadcast_parameters(m.state_dict(), root_rank=0)
        gen = torch.Generator().manual_seed(1000 * si + rank)
        rec = {"agree": [], "nonzero": [], "ref_ok": None, "bytes_ok": None}
        for step in range(3):
            x = torch.randn(16, 40, generator=gen)
            y = torch.randint(0, 3, (16,), generator=gen)
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(m(x), y)
            raw = None
            if step == 0 and spec == "topk:ratio=0.01,scope=layer":
                raw = torch.autograd.grad(loss, list(m.parameters()), retain_graph=True)
            before = opt.exchange.stats.bytes_sent
            loss.backward()
            opt.synchronize()
            sent_bytes = opt.exchange.stats.bytes_sent - before
            g = flat_grads(m)
            allg = hvd.allgather(g.unsqueeze(0), name=f"chk.{si}.{step}")
            rec["agree"].append(bool(torch.equal(allg[0], allg[1])))
            rec["nonzero"].append(int((g != 0).sum()))
            if raw is not None:
                # reference: each rank's exact top-k of its raw gradient, averaged
                dense = []
                for t in raw:
                    f = t.reshape(-1)
                    d = torch.zeros_like(f)
                    idx = topk_indices(f.abs(), count_for(0.01, f.numel()))
                    d[idx] = f[idx]
                    dense.append(d)
                mine = torch.cat(dense)
                both = hvd.allgather(mine.unsqueeze(0), name=f"ref.{si}")
                # the pipeline buckets in reverse parameter order; compare per parameter
                expected = (torch.zeros_like(both[0]) + both[0] + both[1]) * 0.5
                rec["ref_ok"] = bool(torch.equal(g, expected))
                comp = opt.compression
                params = list(m.parameters())
                exp_bytes = 8 + 4 * len(params) + sum((comp.wire_bytes(p.numel()) + 3) // 4 * 4 for p in params)
                rec["bytes_ok"] = [sent_bytes, exp_bytes]
            with opt.skip_synchronize():
                opt.step()
        pflat = torch.cat([p.detach().reshape(-1) for p in m.parameters()])
        allp = hvd.allgather(pflat.unsqueeze(0), name=f"par.{si}")
        rec["params_agree"] = bool(torch.equal(allp[0], allp[1]))
        rec["numel"] = int(pflat.numel())
        out["specs"][spec] = rec
    checks = Checks(rank)
    check(checks, out["specs"])
    checks.emit(**out)


def check(c, specs):
    for spec, rec in specs.items():
        c.expect(f"{spec}: decoded averaged gradients agree bit for bit at every step", rec["agree"] == [True] * 3,
                 rec["agree"])
        c.expect(f"{spec}: parameters agree at the end", rec["params_agree"])
        c.expect(f"{spec}: the averaged gradient is sparse, not empty",
                 all(0 < nz < rec["numel"] for nz in rec["nonzero"]), (rec["nonzero"], rec["numel"]))
    top = specs["topk:ratio=0.01,scope=layer"]
    c.expect("topk:ratio=0.01,scope=layer: step 0 is the mean of the ranks' exact top-k", top["ref_ok"] is True)
    c.expect("topk:ratio=0.01,scope=layer: bytes sent are wire_bytes()'s layout",
             top["bytes_ok"][0] == top["bytes_ok"][1], top["bytes_ok"])
    # about 2% nonzero after averaging two 1% selections
    bound = 2 * sum(count_for(0.01, n) for n in (40 * 2000, 2000, 2000 * 3, 3))
    c.expect("topk:ratio=0.01,scope=layer: at most the two ranks' selections nonzero", max(top["nonzero"]) <= bound,
             (top["nonzero"], bound))


if __name__ == "__main__":
    main()
