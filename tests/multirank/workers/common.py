"""Helpers for worker scripts launched by the tests.

A worker runs the checks that concern its own rank in-process, as named checks, and emits them
beside the data the test still needs::

    checks = Checks(rank)
    checks.expect("fp16: average within half precision", err < 1e-3, err)
    checks.emit(data=...)          # RESULT {"rank": r, "checks": {name: {"ok": ..., "detail": ...}}, ...}

The test side (tests/helpers/checks.py, ``assert_checks``) fails naming every failed check with its
rank and detail. Name a check ``"<section>: <what must hold>"``: a test can assert one section.
"""
import json
import os
import sys

RESULTS_DIR_ENV = "HVDX_TEST_RESULTS_DIR"


def emit(**kw):
    """One RESULT: appended as a JSON line to this process's file under $HVDX_TEST_RESULTS_DIR (what
    tests.conftest.launch collects: a launcher may split or interleave long stdout lines), and printed
    as a ``RESULT`` line for a reader of the output."""
    line = json.dumps(kw)
    out_dir = os.environ.get(RESULTS_DIR_ENV)
    if out_dir:
        with open(os.path.join(out_dir, f"{os.getpid()}.jsonl"), "a") as f:
            f.write(line + "\n")
    print("RESULT " + line, flush=True)
    sys.stdout.flush()


class Checks:
    """Named pass/fail checks of one rank, emitted with its RESULT line.

    ``expect(name, cond, detail)`` records ``bool(cond)``; ``detail`` (any value, shown when the check
    fails) is kept short so the RESULT line stays short (launchers may interleave long lines). A name
    used twice keeps the first failure. Failed checks are also printed to stderr as they happen."""

    DETAIL = 300

    def __init__(self, rank=None):
        self.rank = rank
        self.results = {}

    def expect(self, name, cond, detail=""):
        ok = bool(cond)
        text = "" if ok else (detail if isinstance(detail, str) else repr(detail))[:self.DETAIL]
        prev = self.results.get(name)
        if prev is None or prev["ok"]:
            self.results[name] = {"ok": ok, "detail": text}
        if not ok:
            print(f"CHECK FAILED [rank {self.rank}] {name}: {text}", file=sys.stderr, flush=True)
        return ok

    def section(self, prefix):
        """A view whose ``expect(what, ...)`` records ``"<prefix>: <what>"``."""
        return _Section(self, prefix)

    def failed(self):
        return [n for n, c in self.results.items() if not c["ok"]]

    def emit(self, **data):
        """One RESULT line: ``rank``, ``checks`` and ``data`` (the values the test compares across ranks)."""
        if self.rank is not None:
            data.setdefault("rank", self.rank)
        emit(checks=self.results, **data)


class _Section:
    def __init__(self, checks, prefix):
        self.checks, self.prefix = checks, prefix

    def expect(self, what, cond, detail=""):
        return self.checks.expect(f"{self.prefix}: {what}", cond, detail)


def report(rank, res, check):
    """The end of a worker: ``check(checks, res)`` records the named checks of this rank, then one
    RESULT line carries them with ``res``."""
    checks = Checks(rank)
    check(checks, res)
    checks.emit(**res)


def init_horovod(hvd, mpi_world=False, **init_kw):
    """``hvd.init(**init_kw)`` (on the MPI world mpi4py shares, for the parameter server, if
    ``mpi_world``) with one torch thread; returns (rank, size)."""
    import torch

    if mpi_world:
        from mpi4py import MPI

        hvd.init(comm=MPI.COMM_WORLD, **init_kw)
    else:
        hvd.init(**init_kw)
    torch.set_num_threads(1)
    return hvd.rank(), hvd.size()


def small_model():
    """The 6-8-3 MLP of the recipe workers, the same initial weights on every rank."""
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))


def small_batch(rank, i):
    """Batch ``i`` of rank ``rank`` for :func:`small_model`: 5 samples, 3 classes, its own per rank."""
    import torch

    g = torch.Generator().manual_seed(1000 * rank + i)
    return torch.randn(5, 6, generator=g), torch.randint(0, 3, (5,), generator=g)


def flat_params(model):
    """The model's parameters as one flat tensor (detached)."""
    import torch

    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def exchanged_steps(m, opt, make_model, rank, steps):
    """Train ``m`` (inputs 16 x 20, 5 classes) for ``steps`` steps through ``opt``. Returns per step
    the raw local gradients (recomputed on a copy of the model before the exchange overwrites
    them), the exchanged gradients and the bytes this rank received."""
    import torch
    import torch.nn.functional as F

    raw, real, recv = [], [], []
    for step in range(steps):
        g = torch.Generator().manual_seed(100 * rank + step)
        x, y = torch.randn(16, 20, generator=g), torch.randint(0, 5, (16,), generator=g)
        opt.zero_grad()
        F.cross_entropy(m(x), y).backward()
        m2 = make_model()
        m2.load_state_dict(m.state_dict())
        F.cross_entropy(m2(x), y).backward()
        raw.append({n: p.grad.detach().clone() for n, p in m2.named_parameters()})
        opt.step()
        real.append({n: p.grad.detach().clone() for n, p in m.named_parameters()})
        recv.append(opt.stats.last["bytes_received"])
    return raw, real, recv
