"""AdaptiveSync on 3 ranks of different speeds (Gloo controller): the decision allreduce left in flight
from one sync to the next step, a checkpoint on rank 0 alone while it is, and ``balance=1``'s plans,
counts and normalised average, as the 2-rank worker (:mod:`sync_local_checks`) checks them on 2.
One RESULT line per rank; named checks "adaptive3: ..." and "balance3: ..."."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch  # noqa: E402

import horovod.torch as hvd  # noqa: E402

import hvd_ext  # noqa: E402
import sync_local_checks as two  # noqa: E402
from common import Checks  # noqa: E402

SLEEP = (0.004, 0.008, 0.012)  # rank 0 three times as fast as rank 2


def adaptive_in_flight():
    """Decisions in flight across steps, rank 0 checkpointing alone mid-flight; each rank's loss differs."""
    m = two.make_model()
    o = hvd_ext.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9),
                                     named_parameters=m.named_parameters())
    a = hvd_ext.AdaptiveSync(o, m, min_period=1, max_period=6)
    flight, saved = [], []
    for t in range(30):
        o.zero_grad()
        two.loss_of(m, t).backward()
        a.step()
        flight.append((a.syncs, len(a.history), a._decision is not None))
        if two.rank == 0 and a._decision is not None and len(saved) < 2:
            saved.append(a.state_dict()["period"])   # rank 0 alone, the decision in flight: it waits for it
    a.finish()
    return {"flight": flight, "history": o.stats.extra["period_history"], "spread": two.spread(m, "ad3.final"),
            "saved": saved}


def balance_ranks3():
    a, m, rounds = two.balanced_run(150, SLEEP, normalise=True)
    err = max(float((after - two.expected_average(x0, x, plan, True)).abs().max()) for x0, x, after, plan in rounds)
    steps = hvd.allgather(torch.tensor([a.steps]), name="bal3.steps").tolist()
    return {"steps": steps, "syncs": a.syncs, "history": a.history, "plans": [r[3] for r in rounds],
            "global": a.global_steps(), "completed": a.completed, "spread": two.spread(m, "bal3.final"),
            "normalised_err": err}


def check(c, out):
    a, b = out["adaptive3"], out["balance3"]
    fl = a["flight"]  # (syncs, periods decided, a decision in flight) after each step
    c.expect("adaptive3: a sync's decision stays in flight until the next step, which decides it first",
             all(s == n + f for s, n, f in fl) and any(f for *_, f in fl)
             and all(n == s_prev for (s_prev, _, _), (_, n, _) in zip(fl, fl[1:])), fl)
    c.expect("adaptive3: identical on the ranks after finish", a["spread"] == 0.0, a["spread"])
    c.expect("adaptive3: rank 0 checkpointed twice with a decision in flight, each a decided period",
             two.rank != 0 or (len(a["saved"]) == 2 and all(1 <= p <= 6 for p in a["saved"])), a["saved"])
    c.expect("balance3: identical after finish, the budget reached", b["spread"] == 0.0 and b["global"] >= 150,
             (b["spread"], b["global"]))
    c.expect("balance3: the fastest rank took more steps than the slowest", b["steps"][0] > 1.3 * b["steps"][2],
             b["steps"])
    c.expect("balance3: every sync is FedNova's normalised average of the 3 ranks, plans unequal from the third",
             b["normalised_err"] < 1e-6 and any(len(set(p)) > 1 for p in b["plans"][2:]), (b["normalised_err"], b["plans"]))


def main():
    hvd.init()
    torch.set_num_threads(1)
    two.rank, two.size = hvd.rank(), hvd.size()
    out = {"rank": two.rank, "size": two.size, "adaptive3": adaptive_in_flight(), "balance3": balance_ranks3()}
    checks = Checks(two.rank)
    check(checks, out)
    checks.emit(**out)


if __name__ == "__main__":
    main()
