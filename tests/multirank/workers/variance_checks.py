"""Adam under a lossy codec on real Horovod ranks (hvd_ext.variance_freeze): dense warm-up, then the
frozen second moment, identical on every rank; checkpoint round trip; Horovod's resume recipe
(rank 0 loads, broadcast) keeps the ranks identical. Each rank checks its results in-process (named
checks, common.Checks) and prints one RESULT line."""
import copy
import os
import sys
import warnings

sys.path.insert(0, os.path.dirname(__file__))

import horovod.torch as hvd  # noqa: E402
import torch  # noqa: E402

import hvd_ext  # noqa: E402
from common import Checks, exchanged_steps  # noqa: E402

SPEC = sys.argv[1] if len(sys.argv) > 1 else "topk:ratio=0.05,warmup=3"
WARM = 3


def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(20, 16), torch.nn.ReLU(), torch.nn.Linear(16, 5))


def make(spec=SPEC):
    m = make_model()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt = hvd_ext.DistributedOptimizer(torch.optim.Adam(m.parameters(), lr=1e-2),
                                           named_parameters=m.named_parameters(), compression=spec)
    hvd.broadcast_parameters(m.state_dict(), root_rank=0)
    return m, opt, [str(w.message) for w in caught]


def flat(m):
    return torch.cat([p.detach().reshape(-1) for p in m.parameters()])


def spread(m, tag):
    allp = hvd.allgather(flat(m).unsqueeze(0), name=f"variance.{tag}")
    return float((allp - allp[0:1]).abs().max())


def second_moment(opt):
    return torch.cat([opt.state[p]["exp_avg_sq"].reshape(-1) / (1 - 0.999 ** float(opt.state[p]["step"]))
                      for g in opt.param_groups for p in g["params"]])


def warmup_then_frozen(rank):
    """8 steps (warm-up 3), then 2 more: which exchanges were the exact mean, the second moment held."""
    m, opt, msgs = make()
    raw, real, recv = exchanged_steps(m, opt, make_model, rank, 8)
    # Warm-up exchanges are the exact mean of the ranks' raw gradients.
    exact = []
    for step in range(8):
        means = {n: hvd.allreduce(g, op=hvd.Average, name=f"variance.mean.{step}.{n}") for n, g in raw[step].items()}
        exact.append(all(torch.allclose(real[step][n], means[n], atol=1e-6) for n in means))
    # Two more steps: the optimizer's second moment stays where the freeze holds it (the floor may only
    # raise a coordinate whose gradient outgrew it).
    v0 = second_moment(opt)
    exchanged_steps(m, opt, make_model, rank, 2)
    v1 = second_moment(opt)
    res = {"warned": any("variance=live" in s for s in msgs), "exact": exact, "recv": recv,
           "never_lower": bool(torch.all(v1 >= v0 * (1 - 1e-4))),
           "unchanged": float((torch.isclose(v1, v0, rtol=1e-4, atol=1e-12)).float().mean())}
    return m, opt, res


def resume(m, opt, rank, res):
    """Checkpoint round trip, then Horovod's resume recipe; returns the recipe's model."""
    # Checkpoint round trip: continuing and resuming from the state_dict give the same parameters.
    sd_model = {k: v.clone() for k, v in m.state_dict().items()}
    sd_opt = copy.deepcopy(opt.state_dict())  # torch's state_dict holds live tensors
    res["has_variance"] = "variance" in sd_opt.get("hvd_ext", {})
    exchanged_steps(m, opt, make_model, rank, 3)
    cont = flat(m)
    m2, opt2, _ = make()
    m2.load_state_dict(sd_model)
    opt2.load_state_dict(sd_opt)
    exchanged_steps(m2, opt2, make_model, rank, 3)
    res["resumed_equal"] = bool(torch.equal(flat(m2), cont))

    # Horovod's resume recipe: rank 0 loads the checkpoint, the others start empty, then broadcast.
    m3, opt3, _ = make()
    if rank == 0:
        m3.load_state_dict(sd_model)
        opt3.load_state_dict(sd_opt)
    hvd.broadcast_parameters(m3.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt3, root_rank=0)
    exchanged_steps(m3, opt3, make_model, rank, 4)
    return m3


def check(c, r):
    c.expect("a warning names variance=live", r["warned"])
    c.expect(f"the {WARM} warm-up exchanges are the exact mean", r["exact"][:WARM] == [True] * WARM, r["exact"])
    c.expect("the exchanges after the warm-up are not (compressed)", not any(r["exact"][WARM:]), r["exact"])
    c.expect("compressed after the warm-up: under half the bytes", r["recv"][WARM] < 0.5 * r["recv"][0], r["recv"])
    c.expect("the frozen second moment never goes lower, mostly unchanged",
             r["never_lower"] and r["unchanged"] > 0.5, (r["never_lower"], r["unchanged"]))
    c.expect("the checkpoint holds the variance state, the resumed run equals the continued one",
             r["has_variance"] and r["resumed_equal"], (r["has_variance"], r["resumed_equal"]))
    c.expect("ranks identical, main run and resume recipe", r["spread_main"] == 0.0 and r["spread_recipe"] == 0.0,
             (r["spread_main"], r["spread_recipe"]))
    c.expect("parameters finite after the recipe", r["finite"])


def main():
    hvd.init()
    torch.set_num_threads(1)
    rank = hvd.rank()
    m, opt, res = warmup_then_frozen(rank)
    m3 = resume(m, opt, rank, res)
    res.update(spread_main=spread(m, "main"), spread_recipe=spread(m3, "recipe"),
               finite=bool(torch.isfinite(flat(m3)).all()))
    checks = Checks(rank)
    check(checks, res)
    checks.emit(**res)


if __name__ == "__main__":
    main()
