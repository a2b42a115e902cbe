"""LocalSGD / AdaptiveSync checks on 2 ranks (Gloo controller); one RESULT line per rank. Each rank
checks its results in-process (named checks "h1: ...", "local: ...", "adaptive: ...", "balance: ...", "finite: ...",
"event: ...", common.Checks); the test compares the ranks' AdaptiveSync decisions."""
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch  # noqa: E402

import horovod.torch as hvd  # noqa: E402

import hvd_ext  # noqa: E402
from common import Checks  # noqa: E402

rank, size = None, None  # set by main() after hvd.init()


def make_model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))


def batch(step, r=None):
    g = torch.Generator().manual_seed(1000 * step + (rank if r is None else r))
    return torch.randn(16, 6, generator=g), torch.randint(0, 3, (16,), generator=g)


def loss_of(model, step):
    x, y = batch(step)
    return torch.nn.functional.cross_entropy(model(x), y)


def flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def spread(model, name):
    allp = hvd.allgather(flat(model).unsqueeze(0), name=name)
    return float((allp - allp[0]).abs().max())


def h1():
    """1. LocalSGD(H=1) around a plain optimizer == synchronous DistributedOptimizer (momentum + wd)"""
    K = 6
    m_a = make_model()
    o_a = torch.optim.SGD(m_a.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-3)
    s_a = hvd_ext.LocalSGD(o_a, m_a, period=1)
    m_b = make_model()
    o_b = hvd_ext.DistributedOptimizer(torch.optim.SGD(m_b.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-3),
                                       named_parameters=m_b.named_parameters())
    for t in range(K):
        for m, o, s in ((m_a, o_a, s_a), (m_b, o_b, None)):
            o.zero_grad()
            loss_of(m, t).backward()
            (s.step() if s else o.step())
    return {"max_diff": float((flat(m_a) - flat(m_b)).abs().max()),
            "moved": float((flat(m_b) - flat(make_model())).abs().max()),
            "spread": spread(m_a, "h1.spread"), "exchanges": s_a.exchanges}


def local():
    """2. LocalSGD(H=3, warmup=2) around DistributedOptimizer: identical after syncs, divergent between"""
    m = make_model()
    o = hvd_ext.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9),
                                     named_parameters=m.named_parameters())
    s = hvd_ext.LocalSGD(o, m, period=3, warmup=2)
    spreads = []
    for t in range(10):
        o.zero_grad()
        loss_of(m, t).backward()
        s.step()
        spreads.append(spread(m, f"l3.spread.{t}"))
    s.finish()
    return {"spreads": spreads, "final_spread": spread(m, "l3.final"), "syncs": s.syncs,
            "grad_steps": s.grad_steps, "exchanges": s.exchanges, "stats_exchanges": o.stats.exchanges,
            "stats_steps": o.stats.steps}


def adaptive():
    """3. AdaptiveSync: decisions from constructed momentum"""
    m = make_model()
    o = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    a = hvd_ext.AdaptiveSync(o, m, min_period=2, max_period=10, period=8, delta_lo=0.2, delta_hi=0.5)
    o.zero_grad()
    loss_of(m, 0).backward()
    o.step()  # creates momentum buffers
    for p in m.parameters():  # agree: identical momentum on every rank
        o.state[p]["momentum_buffer"].fill_(0.5)
    a._average()
    agree = (a.last_delta, a.period)

    def diverge_momentum():  # rank-dependent momentum of opposite sign
        for p in m.parameters():
            o.state[p]["momentum_buffer"].fill_(1.0 + 3.0 * (1 if rank == 0 else -1))

    diverge_momentum()
    a._average()
    diverge = (a.last_delta, a.period)
    diverge_momentum()
    a._average()
    diverge_momentum()
    a._average()  # 4 -> 2 -> 2 (clamped at min)
    clamp = a.period
    mom = torch.cat([o.state[p]["momentum_buffer"].reshape(-1) for p in m.parameters()])
    allm = hvd.allgather(mom.unsqueeze(0), name="ad.mom")
    # a real run: identical period histories on both ranks
    m2 = make_model()
    o2 = hvd_ext.DistributedOptimizer(torch.optim.SGD(m2.parameters(), lr=0.05, momentum=0.9),
                                      named_parameters=m2.named_parameters())
    a2 = hvd_ext.AdaptiveSync(o2, m2, min_period=1, max_period=6)
    flight = []   # after each step: (syncs, periods decided, a decision still in flight)
    for t in range(30):
        o2.zero_grad()
        loss_of(m2, t).backward()
        a2.step()
        flight.append((a2.syncs, len(a2.history), a2._decision is not None))
        if rank == 0 and t in (9, 19) and a2._decision is not None:
            a2.state_dict()   # a checkpoint on rank 0 alone while a decision is in flight: no hang
    a2.finish()
    return {"flight": flight, "agree": list(agree), "diverge": list(diverge), "clamp": clamp,
            "mom_spread": float((allm - allm[0]).abs().max()),
            "history": o2.stats.extra["period_history"], "spread": spread(m2, "ad.final"), "exchanges": a2.exchanges}


def balanced_run(budget, sleep, normalise=False, distributed=True, period=3, min_period=1):
    """AdaptiveSync(balance=1) on a budget, the period held at ``period`` (the divergence thresholds
    never met); each rank sleeps ``sleep[rank]`` per step. Records, at each sync, this rank's
    parameters before the average (x_i), at the round's start (x0) and after."""
    m = make_model()
    base = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)
    o = hvd_ext.DistributedOptimizer(base, named_parameters=m.named_parameters()) if distributed else base
    a = hvd_ext.AdaptiveSync(o, m, min_period=min_period, max_period=8, period=period, delta_lo=0.0,
                             delta_hi=1e30, balance=True, normalise=normalise)
    a.set_budget(budget)
    last, rounds = {}, []
    plain_step = o.step

    def spy(*args, **kw):  # the optimizer's step inside a.step(): x_i is what it leaves
        out = plain_step(*args, **kw)
        last["x"] = flat(m).clone()
        return out

    o.step = spy
    t = 0
    while a.global_steps() < a.budget:
        if a.since_sync == 0:
            last["x0"] = flat(m).clone()
        o.zero_grad()
        loss_of(m, t).backward()
        time.sleep(sleep[rank])
        syncs = a.syncs
        a.step()
        last["plan"] = list(a._round_plan())   # decided at the round's first step, kept until the next one
        t += 1
        if a.syncs > syncs:
            rounds.append((last["x0"], last["x"], flat(m).clone(), last["plan"]))
    a.finish()
    return a, m, rounds


def expected_average(x0, x, plan, normalise):
    """What the sync must give: the plain mean of the x_i, or FedNova's x0 + mean_i (mean H / H_i)(x_i - x0)."""
    xs = hvd.allgather(x.unsqueeze(0), name="bal.x")
    if not normalise:
        return xs.mean(0)
    scale = torch.tensor([sum(plan) / len(plan) / h for h in plan]).unsqueeze(1)
    return x0 + (scale * (xs - x0)).mean(0)


def balance():
    """5. AdaptiveSync(balance=1): a 3x slower rank takes fewer steps; both stop at the same sync"""
    m = make_model()
    a0 = hvd_ext.AdaptiveSync(torch.optim.SGD(m.parameters(), lr=0.1), m, balance=True)
    try:
        a0.step()
        no_budget = None
    except RuntimeError as e:
        no_budget = str(e)
    plain = hvd_ext.AdaptiveSync(torch.optim.SGD(m.parameters(), lr=0.1), m, balance=True, normalise=False)
    unbalanced = hvd_ext.AdaptiveSync(torch.optim.SGD(m.parameters(), lr=0.1), m)
    defaults = [(s.normalise, s.describe().split("warmup=0")[1]) for s in (a0, plain, unbalanced)]
    a, m, rounds = balanced_run(120, (0.01, 0.03))
    out = {"defaults": defaults, "no_budget": no_budget, "steps": a.steps, "syncs": a.syncs, "global": a.global_steps(),
           "completed": a.completed, "history": a.history, "spread": spread(m, "bal.final"),
           "plans": [r[3] for r in rounds], "total_steps": int(hvd.allreduce(torch.tensor(a.steps), op=hvd.Sum,
                                                                             name="bal.steps"))}
    _, _, at_min = balanced_run(24, (0.005, 0.015), period=2, min_period=2)
    out["plans_at_min"] = [r[3] for r in at_min]
    restored = hvd_ext.AdaptiveSync(torch.optim.SGD(m.parameters(), lr=0.1), m, balance=True)
    restored.load_state_dict(a.state_dict())
    out["restored"] = [restored.completed, restored.plan, restored.global_steps()] == [a.completed, a.plan,
                                                                                       a.global_steps()]
    errs = []
    for normalise in (False, True):
        _, _, rounds = balanced_run(40, (0.005, 0.015), normalise=normalise, distributed=False)
        errs.append(max(float((after - expected_average(x0, x, plan, normalise)).abs().max())
                        for x0, x, after, plan in rounds))
    out["average_err"], out["normalised_err"] = errs
    out["budget_mismatch"] = []
    for budget in (100 + rank, 10**6 + rank):   # a difference of one batch is caught at any size
        m = make_model()
        c = hvd_ext.AdaptiveSync(torch.optim.SGD(m.parameters(), lr=0.1), m, period=2, balance=True)
        c.set_budget(budget)
        try:
            for t in range(4):
                loss_of(m, t).backward()
                c.step()
            out["budget_mismatch"].append(None)
        except ValueError as e:
            out["budget_mismatch"].append(str(e))
    # warm-up around a plain optimizer (an average every warm step): each warm step counts N batches
    m = make_model()
    w = hvd_ext.AdaptiveSync(torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9), m, period=2, warmup=3,
                             balance=True)
    w.set_budget(30)
    t = 0
    while w.global_steps() < w.budget:
        loss_of(m, t).backward()
        time.sleep((0.002, 0.006)[rank])
        w.step()
        t += 1
    w.finish()
    out["warm"] = {"completed": w.completed, "steps": int(hvd.allreduce(torch.tensor(w.steps), op=hvd.Sum,
                                                                          name="bal.warm.steps")),
                   "spread": spread(m, "bal.warm.final")}
    return out


def all_bad_average():
    """6. finite_average when every rank holds a NaN: nothing exchanged into the tensors, each keeps its own"""
    from hvd_ext.sync._common import exchange_for
    from hvd_ext.sync.local_sgd import finite_average

    mine = torch.tensor([float(rank), float("nan"), 2.0 + rank])
    t = mine.clone()
    before = exchange_for(None).stats.collectives
    _, _, bad = finite_average([t], "allbad")
    collectives = exchange_for(None).stats.collectives - before
    same = bool(torch.equal(t[[0, 2]], mine[[0, 2]]) and torch.isnan(t[1]))
    u = torch.tensor([1.0 + rank, 3.0]) if rank == 0 else torch.tensor([float("inf"), 5.0])
    _, _, one_bad = finite_average([u], "onebad")
    return {"bad": bad, "kept_own": same, "one_bad": one_bad, "one_bad_result": u.tolist(),
            "collectives": collectives}


def gloo_event_error():
    """4. EventTriggeredSGD under Gloo: clear error, no MPI touched"""
    m = make_model()
    try:
        hvd_ext.EventTriggeredSGD(torch.optim.SGD(m.parameters(), lr=0.1), m)
        return None
    except RuntimeError as e:
        return str(e)


def check(c, out):
    h = out["h1"]
    c.expect("h1: LocalSGD(H=1) equals synchronous SGD, parameters moved, ranks identical, 6 exchanges",
             h["moved"] > 1e-3 and h["max_diff"] < 1e-5 and h["spread"] == 0.0 and h["exchanges"] == 6, h)
    L = out["local"]
    sp = L["spreads"]
    c.expect("local: warm-up: gradients exchanged each step (identical)", sp[0] == sp[1] == 0.0, sp)
    c.expect("local: identical after the syncs after local steps 3 and 6", sp[4] == sp[7] == 0.0, sp)
    c.expect("local: ranks drift between syncs", sp[2] > 0 and sp[3] > 0 and sp[8] > 0, sp)
    c.expect("local: identical after finish()", L["final_spread"] == 0.0, L["final_spread"])
    c.expect("local: 2 gradient steps, 3 syncs, 5 exchanges",
             L["grad_steps"] == 2 and L["syncs"] == 3 and L["exchanges"] == 5, L)
    c.expect("local: the optimizer's stats count 5 exchanges in 10 steps",
             L["stats_exchanges"] == 5 and L["stats_steps"] == 10, L)
    a = out["adaptive"]
    c.expect("adaptive: ranks agree -> H + 1", a["agree"][0] == 0.0 and a["agree"][1] == 9, a["agree"])
    c.expect("adaptive: ranks diverge -> H / 2", a["diverge"][0] > 0.5 and a["diverge"][1] == 4, a["diverge"])
    c.expect("adaptive: never below min_period", a["clamp"] == 2, a["clamp"])
    c.expect("adaptive: momentum buffers are synced too", a["mom_spread"] == 0.0, a["mom_spread"])
    c.expect("adaptive: real run identical on the ranks, one exchange per history entry",
             a["spread"] == 0.0 and a["exchanges"] == len(a["history"]), (a["spread"], a["exchanges"]))
    c.expect("adaptive: periods within [1, 6]", all(1 <= h[2] <= 6 for h in a["history"]), a["history"])
    c.expect("adaptive: a sync's decision stays in flight until the next step, which decides it first",
             all(s == n + f for s, n, f in a["flight"]) and any(f for *_, f in a["flight"])
             and all(n == s_prev for (s_prev, _, _), (_, n, _) in zip(a["flight"], a["flight"][1:])), a["flight"])
    b = out["balance"]
    c.expect("balance: normalised (FedNova) by default, the plain average with normalise=0, neither without balance",
             [list(d) for d in b["defaults"]] == [[True, ",balance=1"], [False, ",balance=1,normalise=0"], [False, ""]],
             b["defaults"])
    c.expect("balance: a step before set_budget() raises, naming it", b["no_budget"] and "set_budget" in b["no_budget"],
             b["no_budget"])
    c.expect("balance: the budget reached at a sync, the agreed count equal to the ranks' steps together",
             120 <= b["global"] <= 122 and b["completed"] == b["global"] == b["total_steps"], b)
    c.expect("balance: the 3x faster rank's plan has more steps from the third round (the first round, "
             "with the job's setup in it, is not timed; the last may be cut to the budget), twice as many "
             "once the smoothed speeds settle",
             b["plans"][:2] == [[3, 3], [3, 3]] and all(p[0] > p[1] for p in b["plans"][2:-1])
             and max(p[0] / p[1] for p in b["plans"]) >= 2 and len(b["plans"]) >= 5, b["plans"])
    c.expect("balance: at the smallest period the plan is equal (the fast rank waits)",
             b["plans_at_min"] and all(p == [2, 2] for p in b["plans_at_min"][:-1]), b["plans_at_min"])
    c.expect("balance: identical after finish", b["spread"] == 0.0, b["spread"])
    c.expect("balance: the agreed count and plan survive state_dict/load_state_dict", b["restored"], b["restored"])
    c.expect("balance: the sync is the plain mean of the ranks' models", b["average_err"] < 1e-6, b["average_err"])
    c.expect("balance: normalise=1 gives x0 + mean_i (mean H / H_i)(x_i - x0)", b["normalised_err"] < 1e-6,
             b["normalised_err"])
    c.expect("balance: different budgets on the ranks (by one batch, small or large) raise on every rank at the "
             "first step, naming set_budget",
             all(m is not None and "set_budget" in m for m in b["budget_mismatch"]), b["budget_mismatch"])
    w = b["warm"]
    c.expect("balance: warm-up averages around a plain optimizer count N batches each, no round: the agreed "
             "count equals the ranks' steps together, identical after finish",
             w["completed"] == w["steps"] and 30 <= w["steps"] <= 31 and w["spread"] == 0.0, w)
    f = out["all_bad"]
    c.expect("finite: finite_average with a NaN on every rank: each rank keeps its own values, 2 bad",
             f["bad"] == 2 and f["kept_own"], f)
    c.expect("finite: finite_average with rank 1 bad: both ranks get rank 0's values", f["one_bad"] == 1
             and f["one_bad_result"] == [1.0, 3.0], f)
    c.expect("finite: the non-finite flag travels in the average's own allreduce (one collective)",
             f["collectives"] == 1, f)
    e = out["gloo_event_error"]
    c.expect("event: EventTriggeredSGD under Gloo raises, naming the MPI controller",
             e is not None and "MPI controller" in e, e)


def main():
    global rank, size
    hvd.init()
    torch.set_num_threads(1)
    rank, size = hvd.rank(), hvd.size()
    out = {"rank": rank, "size": size, "h1": h1(), "local": local(), "adaptive": adaptive(),
           "balance": balance(), "all_bad": all_bad_average(), "gloo_event_error": gloo_event_error()}
    checks = Checks(rank)
    check(checks, out)
    checks.emit(**out)


if __name__ == "__main__":
    main()
