"""Node-aware exchange on real Horovod ranks spread over nodes (the multi-node testbed).

    hierarchy_exchange.py alltoall|dynamic|declared|none|links

alltoall: plain ``hvd.init()``, node groups over the global process set's
alltoall (the default). The others make the groups from Horovod process sets
(HVD_EXT_NODE_GROUPS=process_sets): dynamic: ``hvd.init(process_sets=
"dynamic")``; declared: the node process sets passed to ``hvd.init``
(``hvd_ext.exchange.node_process_sets()``); none: plain ``hvd.init()`` -- the
node-aware route cannot be made, one warning, flat. These four take the cost
model's constant links (``HVD_EXT_NODE_LINKS=default``); links: plain
``hvd.init()``, the links measured (``Exchange.node_model``), two optimizers.

For each spec every rank computes gradients on its own data, the real
DistributedOptimizer exchanges them (its routes chosen from the node links it
measured), and every rank replays all ranks' gradients on the in-process
simulated world laid out on the same nodes, with the same node links: the
results must agree bit for bit (same code, same bytes). The flat exchange of
the same gradients (``hierarchy=flat``) is replayed too, for the codec-error
comparison.
"""
import os
import sys
import warnings

sys.path.insert(0, os.path.dirname(__file__))

import horovod.torch as hvd  # noqa: E402
import torch  # noqa: E402

import hvd_ext  # noqa: E402
from common import emit, exchanged_steps  # noqa: E402
from hvd_ext.exchange import node_process_sets  # noqa: E402
from hvd_ext.testing.harness import run_pipeline  # noqa: E402

MODE = sys.argv[1] if len(sys.argv) > 1 else "alltoall"
os.environ["HVD_EXT_NODE_GROUPS"] = "alltoall" if MODE in ("alltoall", "links") else "process_sets"
if MODE != "links":
    # The route checks need the node-aware routes: the cost model's constants (10 Gbit/s between nodes)
    # choose them for this small model, measured links on 2 shared cores may not (mode "links" measures).
    os.environ["HVD_EXT_NODE_LINKS"] = "default"
if MODE == "dynamic":
    hvd.init(process_sets="dynamic")
elif MODE == "declared":
    hvd.init(process_sets=node_process_sets())
else:
    hvd.init()
torch.set_num_threads(1)
RANK, SIZE, L = hvd.rank(), hvd.size(), hvd.local_size()
SPECS = ["none", "qsgd:bits=8", "topk:ratio=0.02", "qsgd:bits=8,exchange=twophase",
         "topk:ratio=0.02,exchange=twophase"] if MODE == "alltoall" else ["qsgd:bits=8"]
if MODE == "links":  # two optimizers of one job: the links are measured once, for the first
    SPECS = ["qsgd:bits=8", "topk:ratio=0.01"]
STEPS = 3


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.ReLU(), torch.nn.Linear(64, 5))


def relerr(a, b):
    num = sum(float(((a[k] - b[k]) ** 2).sum()) for k in a)
    return num / max(sum(float((b[k] ** 2).sum()) for k in b), 1e-30)


out = {"rank": RANK, "size": SIZE, "local_rank": hvd.local_rank(), "cross_rank": hvd.cross_rank(),
       "local_size": L, "cross_size": hvd.cross_size(), "mode": MODE}
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    for spec in SPECS:
        m = model()
        opt = hvd_ext.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1),
                                           named_parameters=m.named_parameters(), compression=spec)
        hvd.broadcast_parameters(m.state_dict(), root_rank=0)
        names = [n for n, _ in m.named_parameters()]
        raw, real, _ = exchanged_steps(m, opt, model, RANK, STEPS)
        gathered = hvd.allgather_object(raw, name=f"raw.{spec}")
        flat = torch.cat([p.detach().reshape(-1) for p in m.parameters()])
        allp = hvd.allgather(flat.unsqueeze(0), name=f"params.{spec}")
        grads = [[gathered[r][s] for r in range(SIZE)] for s in range(STEPS)]
        params = {n: p for n, p in model().named_parameters()}
        measured = opt._exchange.node_model()  # the links this job measured once, at the first node-aware choice
        sim = run_pipeline(spec, grads, SIZE, params=params, ranks_per_node=L, node_model=measured)[RANK]
        sim_flat = run_pipeline(spec + (",hierarchy=flat" if ":" in spec else ":hierarchy=flat"), grads, SIZE,
                                params=params)[RANK]
        mean = {n: sum(grads[0][r][n] for r in range(SIZE)) / SIZE for n in names}
        stats = opt._exchange.stats
        out[spec] = {
            "routes": opt._pipeline.routes, "sim_routes": sim.routes, "flat_routes": sim_flat.routes,
            "spread": float((allp - allp[0:1]).abs().max()),
            "bitwise": all(torch.equal(sim.results[s][n], real[s][n]) for s in range(STEPS) for n in names),
            "max_diff": max(float((sim.results[s][n] - real[s][n]).abs().max()) for s in range(STEPS) for n in names),
            "err_node": relerr(real[0], mean), "err_flat": relerr(sim_flat.results[0], mean),
            "wire_by_link": dict(stats.wire_by_link),
            "node_links": opt.stats.extra.get("node_links"),
        }
        if MODE == "links":  # what the cost model says with the links this job measured
            from hvd_ext.exchange import cost
            from hvd_ext.exchange.routes import estimated_payload_bytes

            n = sum(p.numel() for p in m.parameters())
            comp = hvd_ext.compression_from_spec(spec)
            pick = cost.choose_hierarchy(("allgather", "twophase"), ("allgather", "twophase"), n,
                                         estimated_payload_bytes(comp, n), hvd.cross_size(), L, measured)
            out[spec]["model_pick"] = pick
    if MODE == "links":  # hierarchy=auto measured: the trial runs to its decision, the same on every rank
        m = model()
        opt = hvd_ext.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), named_parameters=m.named_parameters(),
                                           compression="topk:ratio=0.01,hierarchy_trial=2")
        hvd.broadcast_parameters(m.state_dict(), root_rank=0)
        trial = opt._pipeline.route_trial
        g = torch.Generator().manual_seed(RANK)
        for _ in range(12):
            opt.zero_grad()
            m(torch.randn(8, 20, generator=g)).pow(2).mean().backward()
            opt.step()
        out["trial"] = {"planned": trial is not None, "report": trial.report() if trial else None,
                        "routes": opt._pipeline.routes, "stats": opt.stats.extra.get("route_trial")}
out["warnings"] = [str(w.message) for w in caught if "node-aware" in str(w.message)]
emit(**out)
