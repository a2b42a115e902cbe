"""Ranks configured differently: every rank must raise a ValueError naming what differs, at
construction, within seconds (no hang, no garbage). One case after another in one job. Each rank
checks its results in-process (named checks, common.Checks)."""
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))

import horovod.torch as hvd  # noqa: E402
import torch  # noqa: E402

import hvd_ext  # noqa: E402
from hvd_ext.exchange import calibration  # noqa: E402
from common import report, init_horovod  # noqa: E402

RANK = None  # set by main() after hvd.init()


def model_fn(width=8):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, width), torch.nn.ReLU(), torch.nn.Linear(width, 3))


def attempt(build):
    t0 = time.perf_counter()
    try:
        build()
        return {"error": None, "s": time.perf_counter() - t0}
    except ValueError as e:
        return {"error": str(e), "s": time.perf_counter() - t0}


def opt_with(spec, width=8, **kw):
    m = model_fn(width)
    return hvd_ext.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), named_parameters=m.named_parameters(),
                                        compression=spec, **kw)


def with_calibration(paths, spec="topk:ratio=0.1"):
    """Build with HVD_EXT_CALIBRATION set to ``paths[RANK]`` (None: unset) on this rank."""
    def build():
        old = os.environ.pop(calibration.ENV, None)
        if paths[RANK] is not None:
            os.environ[calibration.ENV] = paths[RANK]
        try:
            opt_with(spec)
        finally:
            os.environ.pop(calibration.ENV, None)
            if old is not None:
                os.environ[calibration.ENV] = old
    return build


MISSING = "/nonexistent/hvd_ext_calibration.json"


def cases():
    return {
        "none_vs_fp16": lambda: opt_with("none" if RANK == 0 else "fp16"),
        "topk_vs_qsgd": lambda: opt_with("topk:ratio=0.01" if RANK == 0 else "qsgd:bits=8"),
        "qsgd4_vs_qsgd8": lambda: opt_with("qsgd:bits=4" if RANK == 0 else "qsgd:bits=8"),
        "feedback": lambda: opt_with("topk:ratio=0.1" if RANK == 0 else "topk:ratio=0.1,feedback=ewma"),
        "shapes": lambda: opt_with("none", width=8 if RANK == 0 else 9),
        "bucket_bytes": lambda: opt_with("none", bucket_bytes=1 << 20 if RANK == 0 else 64),
        "op": lambda: opt_with("none", op=hvd.Average if RANK == 0 else hvd.Sum),
        "passes": lambda: opt_with("none", backward_passes_per_step=1 if RANK == 0 else 2),
        "sync": lambda: hvd_ext.sync_from_spec("local:period=4" if RANK == 0 else "local:period=8")(
            opt_with("none"), model_fn()),
        # one rank cannot read the file the others can do without: every rank fails, none waits
        "calibration_one_rank": with_calibration([None, MISSING]),
        "calibration_every_rank": with_calibration([MISSING, MISSING]),
        "same": lambda: opt_with("topk:ratio=0.1"),
    }


# per case: the words the error must hold (what differs, both values)
WANT = {"none_vs_fp16": ("compression", "'none", "'fp16"),
        "topk_vs_qsgd": ("compression", "'topk:", "'qsgd:bits=8"),
        "qsgd4_vs_qsgd8": ("compression", "qsgd:bits=4", "qsgd:bits=8"),
        "feedback": ("compression", "feedback=residual", "feedback=ewma"),
        "shapes": ("parameters", "(8, 6)", "(9, 6)"),
        "bucket_bytes": ("bucket_bytes", "1048576", "64"),
        "op": ("op", "'average'", "'sum'"),
        "passes": ("backward_passes_per_step", "has 1", "has 2"),
        "sync": ("sync", "period=4", "period=8"),
        "calibration_one_rank": ("calibration", "None", "cannot be read", MISSING)}


def collectives_per_step(res):
    """the check runs once, at construction: time it against a training step"""
    m = model_fn(64)
    t0 = time.perf_counter()
    opt = hvd_ext.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), named_parameters=m.named_parameters())
    res["construct_s"] = time.perf_counter() - t0
    collectives = []
    x = torch.randn(16, 6)
    for i in range(3):
        before = opt.exchange.stats.collectives
        opt.zero_grad()
        m(x).sum().backward()
        opt.step()
        collectives.append(opt.exchange.stats.collectives - before)
    res["collectives_per_step"] = collectives


def check(c, res):
    for case, words in WANT.items():
        err = res[case]["error"]
        c.expect(f"{case}: a ValueError saying 'configured differently', naming {words}",
                 err is not None and "configured differently" in err and all(w in err for w in words), err)
        c.expect(f"{case}: raised within 30 s", res[case]["s"] < 30, res[case]["s"])
    err = res["calibration_every_rank"]["error"]
    c.expect("calibration_every_rank: every rank raises the file's own error, naming the file",
             err is not None and "cannot be read" in err and MISSING in err, err)
    c.expect("calibration_every_rank: raised within 30 s", res["calibration_every_rank"]["s"] < 30,
             res["calibration_every_rank"]["s"])
    c.expect("same: ranks configured alike construct without error", res["same"]["error"] is None,
             res["same"]["error"])
    # once at construction, nothing per step: the first step adds one agreement collective only
    c.expect("after the first step, one collective per step (no per-step agreement)",
             res["collectives_per_step"][1:] == [1, 1], res["collectives_per_step"])


def main():
    global RANK
    RANK, _ = init_horovod(hvd)
    res = {"rank": RANK}
    for name, build in cases().items():
        res[name] = attempt(build)
    collectives_per_step(res)
    report(RANK, res, check)


if __name__ == "__main__":
    main()
