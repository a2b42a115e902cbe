"""auto's accuracy guard (hvd_ext.accuracy_guard): which candidates a gradient can carry, measured
during auto's warm-up on simulated ranks."""
from __future__ import annotations

import pytest
import torch

import hvd_ext
from hvd_ext.auto import AutoTuner
from hvd_ext.testing.harness import run_pipeline

from helpers.auto import NAMES, _grads, _link


# ---- the accuracy guard (hvd_ext.accuracy_guard) ------------------------------------------------
def _sparse_grads(steps, size, seed=0, hot=0.01):
    """Gradients whose energy sits on the same 1% of coordinates every step (top-k keeps nearly all),
    plus a little noise."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        ranks = []
        for _ in range(size):
            d = {}
            for n, s in NAMES.items():
                t = 1e-3 * torch.randn(*s, generator=g)
                flat = t.view(-1)
                k = max(1, int(hot * flat.numel()))
                flat[:k] += 1.0 + torch.rand(k, generator=g)
                d[n] = t
            ranks.append(d)
        out.append(ranks)
    return out


def _guard(run):
    return run.pipeline.auto.report()["history"][0]["guard"]


def test_the_guard_keeps_a_coarse_codec_off_gradients_it_cannot_carry(monkeypatch):
    """Slow link: by speed alone top-1% wins. On noise-like gradients top-1% holds back most of each
    step (error ratio near 1): strict auto keeps it off and takes 8-bit QSGD; relaxed takes top-1%."""
    monkeypatch.setattr(AutoTuner, "_probe_link", _link(slow_from=0))
    grads = _grads(6, 2)
    cands = "candidates=none,qsgd:bits=8,topk:ratio=0.01,route=allgather"
    strict = run_pipeline(f"auto:warmup=4,trial=0,{cands}", grads, 2)
    relaxed = run_pipeline(f"auto:warmup=4,trial=0,accuracy=relaxed,{cands}", grads, 2)
    top, q8 = "topk:ratio=0.01,route=allgather", "qsgd:bits=8"
    for r in strict:
        g = _guard(r)
        assert g == _guard(strict[0])  # one verdict on every rank
        for row in g["error_ratio"]:
            assert row["none"] == 0.0 and row[q8] < 0.2 and row[top] > 0.8
        assert all(e == ["none", q8] for e in g["eligible"])
        assert set(r.pipeline.auto.report()["choice"]) == {q8}
    assert set(relaxed[0].pipeline.auto.report()["choice"]) == {top}
    assert _guard(relaxed[0]) is None


def test_the_guard_admits_top_k_where_the_gradient_is_sparse(monkeypatch):
    monkeypatch.setattr(AutoTuner, "_probe_link", _link(slow_from=0))
    runs = run_pipeline("auto:warmup=4,trial=0,candidates=none,topk:ratio=0.03,route=allgather",
                        _sparse_grads(6, 2), 2)
    g = _guard(runs[0])
    assert all(row["topk:ratio=0.03,route=allgather"] < 0.1 for row in g["error_ratio"])
    assert set(runs[0].pipeline.auto.report()["choice"]) == {"topk:ratio=0.03,route=allgather"}


def test_the_guard_verdict_does_not_depend_on_timing(monkeypatch):
    """Same gradients, a fast and a slow link (a quiet and a busy machine): the same error ratios and
    eligible sets; only the choice among the eligible may differ."""
    grads = _grads(6, 2, seed=5)
    spec = "auto:warmup=4,trial=0,candidates=none,fp16,qsgd:bits=8,topk:ratio=0.03,route=allgather"
    monkeypatch.setattr(AutoTuner, "_probe_link", _link())
    fast = run_pipeline(spec, grads, 2)
    monkeypatch.setattr(AutoTuner, "_probe_link", _link(slow_from=0))
    slow = run_pipeline(spec, grads, 2)
    assert _guard(fast[0]) == _guard(slow[0])
    assert "topk:ratio=0.03,route=allgather" not in _guard(fast[0])["eligible"][0]


def test_the_guard_error_ratio_is_the_residual_fraction():
    """q = sqrt(sum ||u - C(u)||^2 / sum ||u||^2) over the warm-up after its first step, u = g + shadow
    residual: checked against a direct computation for top-k."""
    from hvd_ext.accuracy_guard import AccuracyGuard

    class B:
        index, names = 0, ["w"]

    top = hvd_ext.compression_from_spec("topk:ratio=0.25")
    guard = AccuracyGuard([hvd_ext.compression_from_spec("none"), top], bound=0.5)

    def topk(c, b, us):
        u = us[0].reshape(-1)
        out = torch.zeros_like(u)
        i = u.abs().topk(max(1, u.numel() // 4)).indices
        out[i] = u[i]
        return [out]

    g = torch.Generator().manual_seed(1)
    gs = [torch.randn(64, generator=g) for _ in range(4)]
    e, num, den = torch.zeros(64), 0.0, 0.0
    for t, x in enumerate(gs):
        guard.keep("w", x)
        guard.measure([B], topk)
        u = x + e
        out = topk(None, None, [u])[0]
        e = u - out
        if t:
            num, den = num + float(e.pow(2).sum()), den + float(u.pow(2).sum())
    q = guard.local_ratios(1)
    assert q[0] == 0.0 and abs(q[1] - (num / den) ** 0.5) < 1e-5
    guard.decide(q, 1)
    assert guard.eligible(0, 0) and guard.eligible(0, 1) == (q[1] <= 0.5)


def test_the_guard_measures_a_codec_past_its_own_dense_warm_up(monkeypatch):
    """PowerSGD sends dense for its first ``warmup=`` exchanges (100 by default), longer than auto's
    warm-up: the guard codes it as it will compress, not as its dense start (whose error is 0)."""
    monkeypatch.setattr(AutoTuner, "_probe_link", _link(slow_from=0))
    q = {}
    for spec in ("powersgd:rank=1", "powersgd:rank=1,warmup=0"):
        runs = run_pipeline(f"auto:warmup=4,candidates=none,{spec}", _grads(5, 2), 2)
        q[spec] = [row[spec] for row in runs[0].pipeline.auto.guard_report()["error_ratio"]]
    assert q["powersgd:rank=1"] == q["powersgd:rank=1,warmup=0"]
    assert all(v > 0.1 for v in q["powersgd:rank=1"])
    # the shadow passes (and the codec timings) leave the codec's training state as it was: no warm
    # start was kept from them, since PowerSGD has not yet sent a low-rank step
    powersgd = runs[0].pipeline.auto.auto.candidates[1]
    assert powersgd.q_memory == {} and powersgd._staged_q == {}


def test_a_nonfinite_warmup_step_is_not_measured(monkeypatch):
    monkeypatch.setattr(AutoTuner, "_probe_link", _link(slow_from=0))
    grads = _grads(6, 2)
    grads[1][1]["w2"][0] = float("nan")
    runs = run_pipeline("auto:warmup=4,trial=0,candidates=none,qsgd:bits=8", grads, 2)
    g = _guard(runs[0])
    assert all(row["qsgd:bits=8"] < 0.2 for row in g["error_ratio"])  # finite: step 1 was left out
    assert set(runs[0].pipeline.auto.report()["choice"]) == {"qsgd:bits=8"}


def test_the_guard_verdict_survives_a_checkpoint(monkeypatch):
    monkeypatch.setattr(AutoTuner, "_probe_link", _link(slow_from=0))
    runs = run_pipeline("auto:warmup=4,trial=0,candidates=none,qsgd:bits=8,topk:ratio=0.01", _grads(5, 2), 2)
    sd = runs[0].pipeline.state_dict()
    assert sd["auto"]["guard"] == runs[0].pipeline.auto.guard.ratio

    def restore(rank, step, pipe):
        if step == 0:
            pipe.load_state_dict(sd)
    runs2 = run_pipeline("auto:warmup=4,trial=0,candidates=none,qsgd:bits=8,topk:ratio=0.01", _grads(1, 2), 2,
                         before_step=restore)
    assert runs2[0].pipeline.auto.guard.ratio == sd["auto"]["guard"]
    assert not runs2[0].pipeline.auto.eligible(0, 2)


def test_relaxed_accuracy_warns_and_bad_values_are_named():
    with pytest.warns(RuntimeWarning, match="relaxed"):
        run_pipeline("auto:warmup=2,accuracy=relaxed,candidates=none,fp16", _grads(1, 2), 2)
    for bad, words in [("auto:accuracy=loose", "strict"), ("auto:bound=0", "bound")]:
        with pytest.raises(ValueError, match=words):
            hvd_ext.compression_from_spec(bad)
