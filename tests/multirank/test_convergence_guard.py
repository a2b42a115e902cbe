"""Guard rails against divergence regressions.

One 2-rank Horovod launch (``tests/multirank/workers/guard_convergence.py``) trains a small MLP on
MNIST-1D for 150 steps with every registered compressor at its *default* options inside an
ordinary loop -- SGD (lr 0.05, momentum 0.9) -- and one compressor per family with Adam
(lr 1e-3). Each run's held-out cross-entropy must fall by at least half as much as the
uncompressed run's (from ln 10 = 2.30; none reaches about 1.37 with SGD, 1.53 with Adam).

Checked against the earlier defaults in the same loop (SGD): dgc (momentum applied
twice) ended at 3.90, signsgd (+-1 steps) at 2.33, signum at 668, randomk at 2.23 -- all
above the bound (about 1.84). The old efsignsgd/onebit (bucket 1024) ended at 1.58/1.50 here:
their failure on the main job's CNN shows only after more epochs, so this guard does not catch
it (benchmarks/defaults_check.py does).
"""
from __future__ import annotations

import math

import pytest

import hvd_ext

STEPS = 150
FRACTION = 0.5  # of none's loss decrease that every compressor must reach

# Known not to converge at default options in this loop; reported, not asserted (they warn at
# construction with the fix: see their bind_optimizer).
KNOWN: dict = {}


@pytest.fixture(scope="module")
def guard_runs():
    from conftest import launch

    res = launch("guard_convergence.py", "--steps", STEPS, np=2, timeout=900)  # ~4 min on a quiet 2-core machine
    assert len(res) == 2
    return res


def _by_key(res):
    return {(r["optimizer"], r["spec"]): r for r in res[0]["runs"]}


def test_every_compressor_is_guarded(guard_runs):
    got = {spec for opt, spec in _by_key(guard_runs) if opt == "sgd"}
    assert got == set(hvd_ext.list_compressors())


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_defaults_converge(guard_runs, optimizer):
    runs = _by_key(guard_runs)
    ref = runs[(optimizer, "none")]
    assert ref["before"] > 2.0 and ref["after"] < ref["before"] - 0.5, ref  # the loop itself learns
    bound = ref["before"] - FRACTION * (ref["before"] - ref["after"])
    bad, known = [], []
    for (opt, spec), r in sorted(runs.items()):
        if opt != optimizer:
            continue
        ok = r["finite"] and math.isfinite(r["after"]) and r["after"] < bound
        line = (f"{spec}: held-out loss {r['before']:.3f} -> {r['after']:.3f} (bound {bound:.3f}; none "
                f"{ref['after']:.3f}; {r['resolved']})")
        if (opt, spec) in KNOWN:
            known.append(f"{line} [known: {KNOWN[(opt, spec)]}; {'passes now' if ok else 'still fails'}]")
        elif not ok:
            bad.append(line)
    if known:
        print("\n".join(known))
    assert not bad, "diverged or too slow at default options:\n" + "\n".join(bad)


def test_ranks_agree(guard_runs):
    for r in guard_runs[0]["runs"]:
        assert r["agree"], f"{r['optimizer']} {r['spec']}: ranks ended with different parameters"
    assert [r["after"] for r in guard_runs[0]["runs"]] == [r["after"] for r in guard_runs[1]["runs"]]
