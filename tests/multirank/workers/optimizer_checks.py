"""Multi-rank checks of hvd_ext.DistributedOptimizer (launched by tests/multirank/test_optimizer.py).

Each check returns a dict of facts; EXPECT[name] checks them in-process as named checks
("<name>: <what must hold>", see common.Checks), which the test asserts. Usage:
    horovodrun -np 2 python optimizer_checks.py CHECK [CHECK ...]
"""
import copy
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import horovod.torch as hvd  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import hvd_ext  # noqa: E402
from common import Checks  # noqa: E402

RANK, SIZE = None, None  # set by main() after hvd.init()


def model_and_data(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    g = torch.Generator().manual_seed(100 + RANK)
    xs = [torch.randn(8, 12, generator=g) for _ in range(6)]
    ys = [torch.randint(0, 3, (8,), generator=g) for _ in range(6)]
    return model, xs, ys


def flat_params(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def max_param_spread(model):
    """max |param_rank_r - param_rank_0| over ranks (0 when all ranks agree)."""
    allp = hvd.allgather(flat_params(model).unsqueeze(0), name="check.params")
    return float((allp - allp[0:1]).abs().max())


def local_grads(model, x, y):
    m = copy.deepcopy(model)
    F.cross_entropy(m(x), y).backward()
    return {n: p.grad.detach().clone() for n, p in m.named_parameters()}


def check_average(spec):
    """The exchanged gradient equals the mean of the ranks' gradients."""
    model, xs, ys = model_and_data()
    opt = hvd_ext.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       named_parameters=model.named_parameters(), compression=spec)
    mine = local_grads(model, xs[0], ys[0])
    opt.zero_grad()
    F.cross_entropy(model(xs[0]), ys[0]).backward()
    opt.synchronize()
    err = 0.0
    for n, p in model.named_parameters():
        allg = hvd.allgather(mine[n].unsqueeze(0), name=f"check.g.{n}")
        err = max(err, float((p.grad - allg.mean(0)).abs().max()))
    with opt.skip_synchronize():
        opt.step()
    st = opt.stats.last
    expected_bytes = sum(opt.compression.wire_bytes(p.numel()) for p in model.parameters()) + \
        (4 if opt.compression.name == "none" else 2)  # + the non-finite flag element
    return {"max_err": err, "bytes_sent": st["bytes_sent"], "expected_bytes": expected_bytes,
            "spread": max_param_spread(model)}


def check_identical(spec, steps=5, opt_name="sgd"):
    model, xs, ys = model_and_data()
    base = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9) if opt_name == "sgd" else \
        torch.optim.Adam(model.parameters(), lr=0.01)
    opt = hvd_ext.DistributedOptimizer(base, named_parameters=model.named_parameters(), compression=spec)
    before = flat_params(model)
    for i in range(steps):
        opt.zero_grad()
        F.cross_entropy(model(xs[i]), ys[i]).backward()
        opt.step()
    return {"spread": max_param_spread(model), "moved": float((flat_params(model) - before).abs().max()),
            "is_instance": isinstance(opt, type(base)), "steps": opt.stats.steps}


def check_randomk_bytes_and_mass():
    """randomk: bytes counted = exact buffer layout; sent + memory = input on every tensor."""
    model, xs, ys = model_and_data()
    opt = hvd_ext.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       named_parameters=model.named_parameters(),
                                       compression="randomk:ratio=0.25")
    comp, fb = opt.compression, opt.compression.feedback
    worst = 0.0
    for i in range(3):
        opt.zero_grad()
        old_mem = {n: fb.memory.get(n, torch.zeros_like(p).reshape(-1)).clone()
                   for n, p in model.named_parameters()}
        raw = local_grads(model, xs[i], ys[i])
        F.cross_entropy(model(xs[i]), ys[i]).backward()
        opt.synchronize()
        for n, p in model.named_parameters():
            u = raw[n].reshape(-1) + old_mem[n].reshape(-1)
            idx = comp.indices(hvd_ext.TensorInfo(name=n, shape=p.shape, step=i, rank=RANK, size=SIZE))
            mask = torch.zeros(p.numel(), dtype=torch.bool)
            mask[idx] = True
            mem = fb.memory[n].reshape(-1)
            # sent coordinates leave nothing behind; the others are remembered exactly
            worst = max(worst, float(mem[mask].abs().max()), float((mem[~mask] - u[~mask]).abs().max()))
            worst = max(worst, abs(int(mask.sum()) - (-(-p.numel() // 4))))
        with opt.skip_synchronize():
            opt.step()
    n_t = len(list(model.parameters()))
    expected = 8 + 4 * n_t + sum(((comp.wire_bytes(p.numel()) + 3) // 4) * 4 for p in model.parameters())
    st = opt.stats.last
    return {"bytes_sent": st["bytes_sent"], "expected_bytes": expected,
            "bytes_received": st["bytes_received"], "expected_received": expected * (SIZE - 1),
            "mass_err": worst, "spread": max_param_spread(model)}


def check_nan_skip():
    """A NaN on rank 1 at step 2 makes every rank skip that step; feedback memory untouched."""
    model, xs, ys = model_and_data()
    opt = hvd_ext.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                       named_parameters=model.named_parameters(),
                                       compression="randomk:ratio=0.5")
    fb = opt.compression.feedback
    changed = None
    mem_same = None
    for i in range(4):
        opt.zero_grad()
        loss = F.cross_entropy(model(xs[i]), ys[i])
        if i == 2 and RANK == SIZE - 1:
            loss = loss * float("nan")
        loss.backward()
        before = flat_params(model)
        mem_before = {k: v.clone() for k, v in fb.memory.items()}
        opt.step()
        if i == 2:
            changed = float((flat_params(model) - before).abs().max())
            mem_same = all(torch.equal(mem_before[k], fb.memory[k]) for k in mem_before) and \
                set(mem_before) == set(fb.memory)
    return {"changed_on_nan_step": changed, "memory_untouched": mem_same,
            "skipped": opt.stats.skipped_steps, "finite": bool(torch.isfinite(flat_params(model)).all()),
            "spread": max_param_spread(model)}


def _train(model, opt, xs, ys, steps):
    for i in steps:
        opt.zero_grad()
        F.cross_entropy(model(xs[i % len(xs)]), ys[i % len(ys)]).backward()
        opt.step()


def check_checkpoint(spec):
    """Checkpoint at step 3, resume in fresh objects, end bit-identical to the uninterrupted run."""
    model, xs, ys = model_and_data()

    def make(m):
        return hvd_ext.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9),
                                            named_parameters=m.named_parameters(), compression=spec)

    opt = make(model)
    _train(model, opt, xs, ys, range(3))
    ckpt = {"model": copy.deepcopy(model.state_dict()), "opt": copy.deepcopy(opt.state_dict())}
    _train(model, opt, xs, ys, range(3, 7))
    straight = flat_params(model)

    model2, _, _ = model_and_data(seed=123)  # different init: everything must come from the checkpoint
    model2.load_state_dict(ckpt["model"])
    opt2 = make(model2)
    opt2.load_state_dict(ckpt["opt"])
    _train(model2, opt2, xs, ys, range(3, 7))
    resumed = flat_params(model2)
    has_memory = bool(ckpt["opt"]["hvd_ext"]["feedback"].get("memory"))
    return {"identical": bool(torch.equal(straight, resumed)), "diff": float((straight - resumed).abs().max()),
            "checkpoint_has_memory": has_memory}


def check_backward_passes():
    """backward_passes_per_step=2 exchanges the sum of two local passes, averaged over ranks."""
    model, xs, ys = model_and_data()
    opt = hvd_ext.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       named_parameters=model.named_parameters(), backward_passes_per_step=2)
    g0, g1 = local_grads(model, xs[0], ys[0]), local_grads(model, xs[1], ys[1])
    opt.zero_grad()
    for i in range(2):
        F.cross_entropy(model(xs[i]), ys[i]).backward()
    opt.synchronize()
    err = 0.0
    for n, p in model.named_parameters():
        allg = hvd.allgather((g0[n] + g1[n]).unsqueeze(0), name=f"check.bp.{n}")
        err = max(err, float((p.grad - allg.mean(0)).abs().max()))
    with opt.skip_synchronize():
        opt.step()
    return {"max_err": err, "exchanges": opt.stats.exchanges}


def check_overlap():
    """With small buckets, every bucket's collective is started by the backward hooks
    (before synchronize), and the result still equals the mean gradient."""
    model, xs, ys = model_and_data()
    opt = hvd_ext.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       named_parameters=model.named_parameters(), bucket_bytes=256)
    # a first step does the once-per-run agreements (resume state, sparse parameters); count the second
    opt.zero_grad()
    F.cross_entropy(model(xs[1]), ys[1]).backward()
    opt.step()
    mine = local_grads(model, xs[0], ys[0])
    collectives0 = opt.exchange.stats.collectives
    opt.zero_grad()
    F.cross_entropy(model(xs[0]), ys[0]).backward()
    buckets = opt._pipeline.buckets
    started_in_backward = sum(bool(getattr(b, "started", getattr(b, "pending", None) is not None)) for b in buckets)
    opt.synchronize()
    err = max(float((p.grad - hvd.allgather(mine[n].unsqueeze(0), name=f"check.ov.{n}").mean(0)).abs().max())
              for n, p in model.named_parameters())
    with opt.skip_synchronize():
        opt.step()
    return {"buckets": len(buckets), "started_in_backward": started_in_backward, "max_err": err,
            "collectives": opt.exchange.stats.collectives - collectives0}


def check_overlap_thread(spec):
    """overlap=True (buckets compressed on the worker thread) trains to the same bits as
    overlap=False, every bucket handed over during backward; a bad setting raises first."""
    out = {}
    try:
        hvd_ext.DistributedOptimizer(torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1), overlap="yes")
    except ValueError as e:
        out["bad_setting"] = str(e)
    finals = {}
    for on in (False, True):
        model, xs, ys = model_and_data()
        start = flat_params(model)
        opt = hvd_ext.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                           named_parameters=model.named_parameters(), compression=spec,
                                           bucket_bytes=256, overlap=on)
        started = 0
        for i in range(6):
            opt.zero_grad()
            F.cross_entropy(model(xs[i]), ys[i]).backward()
            started = sum(bool(b.started) for b in opt._pipeline.buckets)
            opt.step()
        finals[on] = flat_params(model)
        out[f"overlap_{on}"] = {"resolved": opt.overlap, "stats": opt.stats.extra.get("overlap"),
                                "started_in_backward": started, "buckets": len(opt._pipeline.buckets)}
    out["identical"] = bool(torch.equal(finals[False], finals[True]))
    out["moved"] = float((finals[True] - start).abs().max())
    out["spread"] = max_param_spread(model)
    return out


CHECKS = {
    "overlap": check_overlap,
    "overlap_thread_topk": lambda: check_overlap_thread("topk:ratio=0.2"),
    "overlap_thread_qsgd": lambda: check_overlap_thread("qsgd:bits=4"),
    "average_none": lambda: check_average("none"),
    "average_fp16": lambda: check_average(hvd.Compression.fp16),
    "average_bf16": lambda: check_average("bf16"),
    "identical_none_adam": lambda: check_identical("none", opt_name="adam"),
    "identical_fp16": lambda: check_identical("fp16"),
    "identical_randomk": lambda: check_identical("randomk:ratio=0.1"),
    "identical_randomk_shared": lambda: check_identical("randomk:ratio=0.1,shared=1"),
    "randomk_bytes_mass": check_randomk_bytes_and_mass,
    "nan_skip": check_nan_skip,
    "checkpoint_randomk": lambda: check_checkpoint("randomk:ratio=0.2"),
    "backward_passes": check_backward_passes,
}

def expect_average(max_err_below=None, max_err_above=None, spread=False):
    def ex(c, r):
        if max_err_below == 0.0:
            c.expect("exchanged gradient is exactly the ranks' mean", r["max_err"] == 0.0, r["max_err"])
        else:
            c.expect(f"exchanged gradient within {max_err_below} of the ranks' mean"
                     + (f" (and not exact: above {max_err_above})" if max_err_above is not None else ""),
                     (max_err_above is None or max_err_above < r["max_err"]) and r["max_err"] < max_err_below,
                     r["max_err"])
        c.expect("bytes sent are the wire layout's", r["bytes_sent"] == r["expected_bytes"],
                 (r["bytes_sent"], r["expected_bytes"]))
        if spread:
            c.expect("ranks hold identical parameters", r["spread"] == 0.0, r["spread"])
    return ex


def expect_identical(c, r):
    c.expect("ranks agree on parameters", r["spread"] == 0.0, r["spread"])
    c.expect("parameters moved", r["moved"] > 1e-4, r["moved"])
    c.expect("the optimizer is an instance of the wrapped one's class, 5 steps counted",
             r["is_instance"] and r["steps"] == 5, r)


def expect_randomk_bytes_mass(c, r):
    c.expect("bytes sent are the buffer layout's", r["bytes_sent"] == r["expected_bytes"],
             (r["bytes_sent"], r["expected_bytes"]))
    c.expect("bytes received are the others' buffers", r["bytes_received"] == r["expected_received"],
             (r["bytes_received"], r["expected_received"]))
    c.expect("sent + memory = input on every tensor (mass conserved)", r["mass_err"] == 0.0, r["mass_err"])
    c.expect("ranks hold identical parameters", r["spread"] == 0.0, r["spread"])


def expect_nan_skip(c, r):
    c.expect("no parameter changed on the NaN step", r["changed_on_nan_step"] == 0.0, r["changed_on_nan_step"])
    c.expect("feedback memory untouched by the skipped step", r["memory_untouched"] is True, r["memory_untouched"])
    c.expect("one step skipped", r["skipped"] == 1, r["skipped"])
    c.expect("parameters finite, identical on the ranks", r["finite"] and r["spread"] == 0.0, r)


def expect_checkpoint(c, r):
    c.expect("the checkpoint holds the feedback memory", r["checkpoint_has_memory"])
    c.expect("the resumed run ends bit-identical to the uninterrupted one", r["identical"],
             f"resumed run differs by {r['diff']}")


def expect_backward_passes(c, r):
    c.expect("the exchanged gradient is the ranks' mean of the two passes' sums", r["max_err"] < 1e-6, r["max_err"])
    c.expect("one exchange for two backward passes", r["exchanges"] == 1, r["exchanges"])


def expect_overlap(c, r):
    c.expect("at least 3 buckets", r["buckets"] >= 3, r["buckets"])
    c.expect("every bucket started during backward", r["started_in_backward"] == r["buckets"], r)
    c.expect("one fused collective per bucket, not one per tensor", r["collectives"] == r["buckets"], r)
    c.expect("exchanged gradient is exactly the ranks' mean", r["max_err"] == 0.0, r["max_err"])


def expect_overlap_thread(c, r):
    c.expect("a bad overlap setting raises a clear error",
             "overlap must be 'auto', True or False" in r.get("bad_setting", ""), r.get("bad_setting"))
    c.expect("overlap=True resolves to True, reported in stats",
             r["overlap_True"]["resolved"] is True and r["overlap_True"]["stats"] is True, r["overlap_True"])
    c.expect("overlap=False resolves to False, reported in stats",
             r["overlap_False"]["resolved"] is False and r["overlap_False"]["stats"] is False, r["overlap_False"])
    for on in ("True", "False"):  # every bucket handed over (started) by the hooks, in backward
        o = r[f"overlap_{on}"]
        c.expect(f"overlap={on}: at least 3 buckets, every one started during backward",
                 o["buckets"] >= 3 and o["started_in_backward"] == o["buckets"], o)
    c.expect("overlap=True trains to the same bits as overlap=False", r["identical"],
             "overlap=True changed the numbers")
    c.expect("parameters moved, identical on the ranks", r["moved"] > 1e-4 and r["spread"] == 0.0,
             (r["moved"], r["spread"]))


EXPECT = {
    "overlap": expect_overlap,
    "overlap_thread_topk": expect_overlap_thread,
    "overlap_thread_qsgd": expect_overlap_thread,
    "average_none": expect_average(max_err_below=0.0, spread=True),
    "average_fp16": expect_average(max_err_below=1e-3),
    "average_bf16": expect_average(max_err_below=2e-2, max_err_above=0),  # Horovod has no bfloat16 collective
    "identical_none_adam": expect_identical,
    "identical_fp16": expect_identical,
    "identical_randomk": expect_identical,
    "identical_randomk_shared": expect_identical,
    "randomk_bytes_mass": expect_randomk_bytes_mass,
    "nan_skip": expect_nan_skip,
    "checkpoint_randomk": expect_checkpoint,
    "backward_passes": expect_backward_passes,
}


def main():
    global RANK, SIZE
    hvd.init()
    torch.set_num_threads(1)
    RANK, SIZE = hvd.rank(), hvd.size()
    checks = Checks(RANK)
    names = sys.argv[1:] or list(CHECKS)
    out = {"size": SIZE}
    for name in names:
        out[name] = CHECKS[name]()
        EXPECT[name](checks.section(name), out[name])
    checks.emit(**out)


if __name__ == "__main__":
    main()
