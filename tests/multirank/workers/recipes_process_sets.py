"""Process sets as in Horovod (4 ranks): even = {0, 2}, odd = {1, 3}. An optimizer on the even set
is built on every rank; odd ranks step locally without communicating, even ranks average among
themselves. Then the odd set gets its own optimizer (and a LocalSGD strategy) the other way round.
Each rank checks its results in-process (named checks, common.Checks)."""
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import horovod.torch as hvd  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import hvd_ext  # noqa: E402
from common import report, init_horovod, flat_params, small_batch, small_model  # noqa: E402

RANK, SIZE, even, odd = None, None, None, None  # set by main() at hvd.init()



def run(pset, spec, sync_spec=None, steps=4):
    model, ref = small_model(), small_model()
    opt = hvd_ext.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                       named_parameters=model.named_parameters(), compression=spec, process_set=pset)
    # what a local-only rank must do: plain local steps of the optimizer as wrapped (a compressor's
    # feedback may have taken over SGD momentum, identically on every rank, so Horovod's
    # broadcast_optimizer_state sees the same state structure everywhere)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=opt.param_groups[0]["momentum"])
    sync = hvd_ext.sync_from_spec(sync_spec)(opt, model) if sync_spec else None
    hvd.broadcast_optimizer_state(opt, root_rank=0)  # the recipe, on every rank
    for i in range(steps):
        x, y = small_batch(RANK, i)
        for m, o in ((model, opt), (ref, ref_opt)):
            o.zero_grad()
            loss = F.cross_entropy(m(x), y)
            loss.backward()
            if o is opt and sync is not None:
                sync.step(loss)
            else:
                o.step()
    if sync is not None:
        sync.finish()
    allp = hvd.allgather(flat_params(model).unsqueeze(0), name=f"ps.{spec}.{sync_spec}")
    members = [r for r in range(SIZE) if (r % 2 == 0) == (pset is even)]
    return {"included": pset.included(), "collectives": opt.exchange.stats.collectives,
            "members_spread": float((allp[members] - allp[members[0]]).abs().max()),
            "local_err": float((flat_params(model) - flat_params(ref)).abs().max()),
            "differs_from_member": float((allp[RANK] - allp[members[0]]).abs().max())}


def check(checks, res):
    for case, c in res.items():
        if not isinstance(c, dict):
            continue
        member = (RANK % 2 == 0) == case.startswith("even")
        x = checks.section(case)
        x.expect(f"included = {member} (member of the set)", c["included"] == member, c)
        x.expect("the set's ranks agree", c["members_spread"] == 0.0, c)
        if member:  # they did exchange
            x.expect("a member: the set's average, not a local step",
                     c["differs_from_member"] == 0.0 and c["local_err"] > 0, c)
        else:
            x.expect("not a member: never communicated", c["collectives"] == 0, c)
            x.expect("not a member: exactly a local torch step", c["local_err"] < 1e-6, c)
            x.expect("not a member: differs from the members", c["differs_from_member"] > 0, c)


def main():
    global RANK, SIZE, even, odd
    even, odd = hvd.ProcessSet([0, 2]), hvd.ProcessSet([1, 3])
    RANK, SIZE = init_horovod(hvd, process_sets=[even, odd])
    res = {"size": SIZE,
           "even_none": run(even, "none"),
           "even_topk": run(even, "topk:ratio=0.3"),
           "odd_qsgd": run(odd, "qsgd:bits=8"),
           "odd_local": run(odd, "none", "local:period=2")}
    report(RANK, res, check)
    hvd.barrier()


if __name__ == "__main__":
    main()
