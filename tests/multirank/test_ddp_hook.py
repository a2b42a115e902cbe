"""hvd_ext.ddp: every codec family as a DDP communication hook over gloo, in real processes at 2, 3 and
4 ranks: the averaged gradients equal the hvd_ext pipeline's on the same inputs (the simulated
world's, which the Horovod path matches), a non-finite gradient on one rank skips the step on every
rank, a rank configured differently fails on every rank, and the hook state checkpoints."""
import pytest
import torch

from helpers.torchdist import spawn_gloo
from multirank.workers.common import small_batch, small_model
from hvd_ext.testing.harness import run_pipeline

SPECS = ["none", "fp16", "powersgd:rank=2,warmup=0", "powersgd:rank=2,warmup=1", "qsgd:bits=8,exchange=allgather", "qsgd:bits=4,exchange=twophase",
         "efsignsgd:exchange=twophase", "topk:ratio=0.05,exchange=allgather", "topk:ratio=0.05,exchange=twophase"]
BIG = 1 << 62
# steps of the two whose bucket goes as DDP's flat buffer (GradientPipeline.takes_flat)
FLAT = {"none": 2, "fp16": 2, "powersgd:rank=2,warmup=1": 1}


def _worker(rank, size, mode):
    from torch.nn.parallel import DistributedDataParallel as DDP

    import hvd_ext.ddp as hddp

    res = {}
    if mode in ("mismatch", "calibration"):
        spec = "qsgd:bits=8" if rank == 0 or mode == "calibration" else "qsgd:bits=4"
        if mode == "calibration" and rank == 1:  # a file only rank 1 is told of, and cannot read
            import os
            os.environ["HVD_EXT_CALIBRATION"] = "/nonexistent/hvd_ext_calibration.json"
        model = DDP(small_model())
        hddp.register(model, spec)
        x, y = small_batch(rank, 0)
        try:
            torch.nn.functional.cross_entropy(model(x), y).backward()
            res["error"] = None
        except ValueError as e:
            res["error"] = str(e)
    elif mode == "auto":
        model = DDP(small_model())
        state = hddp.register(model, "auto:warmup=2,every=3")
        res["grads"] = []
        for step in range(6):
            x, y = small_batch(rank, step)
            model.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            res["grads"].append([p.grad.clone() for p in model.parameters()])
        auto = next(iter(state.pipelines.values()))[0].auto
        res["decisions"], res["choice"] = len(auto.decisions), auto.report()["choice"]
    elif mode == "resume":
        def grads_at(model, step):
            x, y = small_batch(rank, step)
            model.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            return {n: p.grad.clone() for n, p in model.module.named_parameters()}

        for spec in SPECS:
            a = DDP(small_model())
            hddp.register(a, spec)
            whole = [grads_at(a, s) for s in range(3)]
            b = DDP(small_model())
            sb = hddp.register(b, spec)
            for s in range(2):
                grads_at(b, s)
            saved = sb.state_dict()
            c = DDP(small_model())
            sc, hook = hddp.comm_hook(spec)
            sc.load_state_dict(saved)
            c.register_comm_hook(sc, hook)
            res[spec] = {"whole": whole[2], "resumed": grads_at(c, 2)}
    else:
        from hvd_ext.pipeline import GradientPipeline

        flat = []
        start = GradientPipeline.start_flat
        GradientPipeline.start_flat = lambda pipe, buf: (flat.append(1), start(pipe, buf))[1]
        for spec in SPECS:
            flat.clear()
            model = DDP(small_model())
            state, hook = hddp.comm_hook(spec)
            model.register_comm_hook(state, hook)
            local = small_model()
            names = {id(p): n for n, p in model.module.named_parameters()}
            steps = []
            for step in range(2):
                x, y = small_batch(rank, step)
                if mode == "nan" and rank == 1 and step == 1:
                    x = x.clone()
                    x[0, 0] = float("nan")
                model.zero_grad()
                torch.nn.functional.cross_entropy(model(x), y).backward()
                local.zero_grad()
                torch.nn.functional.cross_entropy(local(x), y).backward()
                assert list(state.layout) == [0], state.layout  # a small model: one DDP bucket
                hook_name = {n: state.name_of(p) for n, p in model.module.named_parameters()}
                steps.append({"avg": {hook_name[n]: p.grad.clone() for n, p in model.module.named_parameters()},
                              "local": {hook_name[n]: p.grad.clone() for n, p in local.named_parameters()},
                              "skip": state.skip_step,
                              "order": [hook_name[names[i]] for i in state.layout[0]],
                              "pipelines": len(state.pipelines)})
            res[spec] = {"steps": steps, "sd": state.state_dict(), "flat": len(flat)}
            if mode == "plain":
                fresh, _ = hddp.comm_hook(spec)
                fresh.load_state_dict(state.state_dict())
                res[spec]["reloaded"] = fresh.state_dict()["buckets"].keys() == state.state_dict()["buckets"].keys()
    return res


class TwoHeads(torch.nn.Module):
    """A trunk and two heads; each step uses one head, so the other is unused (find_unused_parameters)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.trunk, self.a, self.b = torch.nn.Linear(6, 8), torch.nn.Linear(8, 3), torch.nn.Linear(8, 3)

    def forward(self, x, head):
        return getattr(self, head)(torch.relu(self.trunk(x)))


UNUSED_SPECS = ["none", "topk:ratio=0.3,exchange=allgather"]
# (micro-batches of a step, each (head, synced?)): heads a, b, then two accumulated micro-batches, the
# first under no_sync()
UNUSED_STEPS = [[("a", True)], [("b", True)], [("a", False), ("a", True)]]


def _unused_worker(rank, size):
    """find_unused_parameters=True and gradient accumulation with no_sync(), per spec: each step's averaged
    gradients on this rank, and the mean over ranks of the local (accumulated) gradients."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import hvd_ext.ddp as hddp

    res = {}
    for spec in UNUSED_SPECS:
        model, local = DDP(TwoHeads(), find_unused_parameters=True), TwoHeads()
        hddp.register(model, spec)
        steps = []
        for t, micro in enumerate(UNUSED_STEPS):
            model.zero_grad(set_to_none=True)
            local.zero_grad(set_to_none=True)
            for m, (head, synced) in enumerate(micro):
                x, y = small_batch(rank, 10 * t + m)
                with (model.no_sync() if not synced else torch.enable_grad()):
                    torch.nn.functional.cross_entropy(model(x, head), y).backward()
                torch.nn.functional.cross_entropy(local(x, head), y).backward()
            mean = {}
            for n, p in local.named_parameters():
                g = p.grad if p.grad is not None else torch.zeros_like(p)
                parts = [torch.empty_like(g) for _ in range(size)]
                dist.all_gather(parts, g)
                mean[n] = torch.stack(parts).mean(0)
            steps.append({"avg": {n: None if p.grad is None else p.grad.clone()
                                  for n, p in model.module.named_parameters()}, "mean": mean})
        res[spec] = steps
    return res


MULTI_SPECS = ["none", "qsgd:bits=4,exchange=twophase", "topk:ratio=0.1,exchange=allgather"]


def _multi_bucket_worker(rank, size):
    """Several DDP buckets: for each spec, whether each bucket's future was still pending when its hook
    returned (all but the last: the exchange overlaps backward), the averaged and the local gradients."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import hvd_ext.ddp as hddp

    def net():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(6, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64), torch.nn.ReLU(),
                                   torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 3))

    res = {}
    for spec in MULTI_SPECS:
        model, local = DDP(net(), bucket_cap_mb=0.02), net()  # 20 kB buckets: one 64x64 layer each
        state, hook = hddp.comm_hook(spec)
        pending = []

        def watching(st, bucket):
            fut = hook(st, bucket)
            pending.append((bucket.index(), bucket.is_last(), fut.done()))
            return fut

        model.register_comm_hook(state, watching)
        steps = []
        for t in range(3):
            x, y = small_batch(rank, t)
            model.zero_grad()
            local.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            torch.nn.functional.cross_entropy(local(x), y).backward()
            mean = []
            for p in local.parameters():
                parts = [torch.empty_like(p.grad) for _ in range(size)]
                dist.all_gather(parts, p.grad)
                mean.append(torch.stack(parts).mean(0))
            steps.append({"avg": [p.grad.clone() for p in model.parameters()], "mean": mean})
        # a NaN in one layer's gradient on the last rank only: every bucket skipped, nothing kept
        before = state.state_dict()
        first = next(model.module.parameters())
        h = first.register_hook(lambda g: g * float("nan") if rank == size - 1 else g)
        x, y = small_batch(rank, 3)
        model.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        h.remove()
        nan_step = {"skip": state.skip_step, "zero": all(float(p.grad.abs().sum()) == 0.0 for p in model.parameters()),
                    "kept_nothing": same_state(before, state.state_dict())}
        res[spec] = {"steps": steps, "pending": pending, "buckets": len(state.layout), "nan_step": nan_step}
    return res


def same_state(a, b) -> bool:
    """Two hook state_dicts hold the same tensors and values (the step and skip counters aside)."""
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(k in ("step", "skipped_steps") or same_state(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same_state(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    return a == b


def _run(size, mode):
    return spawn_gloo(_worker, size, mode)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("size", [2, 3, 4])
def test_ddp_hook_equals_the_pipeline(size):
    got = _run(size, "plain")
    for spec in SPECS:
        runs = [got[r][spec]["steps"] for r in range(size)]
        # one pipeline per layout: DDP rebuilds its bucket after the first iteration, so the reference
        # is a fresh pipeline with the same layout for each layout the hook ran
        for s in range(2):
            order = runs[0][s]["order"]
            assert all(runs[r][s]["order"] == order for r in range(size))
            fresh = s == 0 or runs[0][s]["pipelines"] > runs[0][s - 1]["pipelines"]
            first = s if fresh else 0
            grads = [[{n: runs[r][t]["local"][n] for n in order} for r in range(size)] for t in range(first, s + 1)]
            ref = run_pipeline(spec, grads, size, bucket_bytes=BIG)
            for r in range(size):
                assert not runs[r][s]["skip"]
                for n in order:
                    mine, want = runs[r][s]["avg"][n], ref[r].results[-1][n]
                    if spec.startswith("powersgd") or spec == "none":  # float32 allreduce: gloo's summation order
                        torch.testing.assert_close(mine, want, rtol=1e-5, atol=1e-6)
                    else:
                        assert torch.equal(mine, want), (spec, n, s)
        assert all(got[r][spec]["reloaded"] for r in range(size))
        assert all(got[r][spec]["flat"] == FLAT.get(spec, 0) for r in range(size)), spec


@pytest.mark.timeout(300)
def test_ddp_hook_nonfinite_skips_on_every_rank():
    got = _run(2, "nan")
    for r in range(2):
        for spec in SPECS:
            s0, s1 = got[r][spec]["steps"]
            assert not s0["skip"] and s1["skip"], spec
            assert all(float(g.abs().sum()) == 0.0 for g in s1["avg"].values()), spec  # nothing applied


@pytest.mark.timeout(300)
def test_ddp_hook_configured_differently_fails_on_every_rank():
    got = _run(2, "mismatch")
    for r in range(2):
        assert got[r]["error"] and "configured differently" in got[r]["error"] and "spec" in got[r]["error"]


@pytest.mark.timeout(300)
def test_ddp_hook_a_rank_that_cannot_read_the_calibration_fails_with_every_rank():
    got = _run(2, "calibration")
    for r in range(2):
        err = got[r]["error"]
        assert err and "calibration" in err and "cannot be read" in err and "/nonexistent/" in err, err


@pytest.mark.timeout(300)
def test_ddp_hook_checkpoint_resumes_bit_exact():
    got = _run(2, "resume")
    for r in range(2):
        for spec in SPECS:
            whole, resumed = got[r][spec]["whole"], got[r][spec]["resumed"]
            assert all(torch.equal(whole[n], resumed[n]) for n in whole), spec


@pytest.mark.timeout(300)
def test_ddp_hook_runs_auto():
    got = _run(2, "auto")
    assert got[0]["decisions"] >= 1 and got[0]["choice"] == got[1]["choice"]
    for a, b in zip(got[0]["grads"], got[1]["grads"]):  # rank 0's choice for all: identical gradients
        assert all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("size", [2, 3])
def test_ddp_hook_unused_parameters_and_no_sync(size):
    """find_unused_parameters=True (a head unused per step) and accumulation under no_sync(): the hook
    averages what DDP hands it -- the accumulated gradient, zeros for the unused head -- and the ranks agree."""
    got = spawn_gloo(_unused_worker, size)
    for spec in UNUSED_SPECS:
        for t, micro in enumerate(UNUSED_STEPS):
            unused = "b" if micro[0][0] == "a" else "a"
            for r in range(size):
                avg, mean = got[r][spec][t]["avg"], got[r][spec][t]["mean"]
                for n, g in avg.items():
                    if n.startswith(unused):
                        assert g is None or float(g.abs().sum()) == 0.0, (spec, t, n)
                        continue
                    assert torch.equal(g, got[0][spec][t]["avg"][n]), (spec, t, n)  # every rank the same
                    if spec == "none":  # uncompressed: the mean over ranks of the accumulated local gradients
                        torch.testing.assert_close(g, mean[n], rtol=1e-5, atol=1e-7)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("size", [2, 3])
def test_ddp_hook_overlaps_buckets_and_finishes_them_in_order(size):
    """Several DDP buckets: every bucket but the last returns a pending future (its exchange runs while
    backward goes on); the last finishes them all. The averages are the same on every rank, and for
    `none` equal the mean of the local gradients. A NaN in one layer on one rank zeroes every bucket
    on every rank and keeps nothing of the step in any bucket's state."""
    got = spawn_gloo(_multi_bucket_worker, size)
    for spec in MULTI_SPECS:
        run = got[0][spec]
        assert run["buckets"] >= 2, run["buckets"]
        for index, last, done in run["pending"]:
            assert done == last, (spec, index, last, done)  # pending until the last bucket's hook
        for t in range(3):
            for r in range(size):
                for mine, ref in zip(got[r][spec]["steps"][t]["avg"], run["steps"][t]["avg"]):
                    assert torch.equal(mine, ref), (spec, t, r)
            if spec == "none":
                for mine, mean in zip(run["steps"][t]["avg"], run["steps"][t]["mean"]):
                    torch.testing.assert_close(mine, mean, rtol=1e-5, atol=1e-7)
        for r in range(size):  # NaN in the first layer on one rank: all buckets skipped on every rank
            assert got[r][spec]["nan_step"] == {"skip": True, "zero": True, "kept_nothing": True}, (spec, r)
