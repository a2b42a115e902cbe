"""Adaptive optimizers under lossy compression: a frozen second moment (hvd_ext.variance_freeze,
after 1-bit Adam). Single process; the 2-rank behaviour (every rank identical, checkpoint) is in
tests/multirank/test_variance_freeze.py and tests/multirank/workers/variance_checks.py."""
from __future__ import annotations

import math
import warnings

import pytest
import torch

import hvd_ext
from hvd_ext.variance_freeze import VarianceFreeze

OPTIMIZERS = {
    "adam": lambda ps: torch.optim.Adam(ps, lr=0.01),
    "adam_l2": lambda ps: torch.optim.Adam(ps, lr=0.01, weight_decay=0.1),
    "adam_amsgrad": lambda ps: torch.optim.Adam(ps, lr=0.01, amsgrad=True),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1),
    "nadam": lambda ps: torch.optim.NAdam(ps, lr=0.01),
    "radam": lambda ps: torch.optim.RAdam(ps, lr=0.01),
    "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=0.01),
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=0.01),
}


KEY = {"rmsprop": "square_avg", "adagrad": "sum"}


def _corrected(opt, p, kind):
    st = opt.state[p]
    v = st[KEY.get(kind, "exp_avg_sq")]
    if kind in KEY:
        return v.clone()
    b2 = opt.param_groups[0]["betas"][1]
    return v / (1 - b2 ** float(st["step"]))


FRESH = {"rmsprop": 0.01, "adagrad": 1.0}  # weight of g^2 in one update (Adam family: 1 - b2)


@pytest.mark.parametrize("kind", sorted(OPTIMIZERS))
def test_second_moment_stays_frozen(kind):
    """After the warm-up the optimizer's own update leaves its (bias-corrected) second moment at the
    value it had, whatever gradients come -- bursts up to 10x the warm-up scale included -- except where
    a gradient exceeds what one live update would hold (the floor, which only raises it)."""
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(200))
    opt = OPTIMIZERS[kind]([p])
    warm = 100 if kind in KEY else 5  # no bias correction: their moment needs longer to build up
    vf = VarianceFreeze(opt, warm, {p: "p"})
    fresh = FRESH.get(kind, 1 - 0.999)
    burst = {"rmsprop": 3.0, "adagrad": 1.0}.get(kind, 10.0)  # where one burst stays under the floor
    frozen, floor = None, torch.zeros(200)
    for step in range(warm + 35):
        p.grad = torch.randn(200) * (burst if step % 7 == 6 else 1.0)
        g = p.grad + 0.1 * p.detach() if kind == "adam_l2" else p.grad.clone()
        vf.before_step(opt, step)
        opt.step()
        if step == warm:
            frozen = _corrected(opt, p, kind)
        if step >= warm:
            floor = torch.maximum(floor, fresh * g * g)
            want = torch.maximum(frozen, floor)
            assert torch.allclose(_corrected(opt, p, kind), want, rtol=1e-4, atol=1e-6), step
            assert torch.allclose(vf.frozen["p"], want, rtol=1e-4, atol=1e-6)
    untouched = floor <= frozen
    assert untouched.float().mean() > 0.5  # most coordinates kept the warm-up's value exactly
    assert torch.isfinite(p).all()


def test_frozen_adam_is_linear_in_the_gradient():
    """The property error feedback needs: a burst of k times the gradient once moves the parameters as
    far as the gradient sent k times (live Adam moves a burst ~sqrt(k) times less)."""
    def run(schedule, freeze):
        torch.manual_seed(0)
        p = torch.nn.Parameter(torch.zeros(50))
        opt = torch.optim.Adam([p], lr=1e-3)
        vf = VarianceFreeze(opt, 20, {p: "p"}) if freeze else None
        g = torch.linspace(0.5, 2.0, 50)
        for step in range(20):  # warm-up on the same gradient: V ~ g^2
            p.grad = g.clone()
            if vf:
                vf.before_step(opt, step)
            opt.step()
        start = p.detach().clone()
        for step, k in enumerate(schedule):
            p.grad = g * k
            if vf:
                vf.before_step(opt, 20 + step)
            opt.step()
        return p.detach() - start

    spread = [1.0] * 10 + [0.0] * 200
    burst = [10.0] + [0.0] * 209
    d_spread, d_burst = run(spread, True), run(burst, True)
    assert torch.allclose(d_burst, d_spread, rtol=0.02)
    live_spread, live_burst = run(spread, False), run(burst, False)
    assert float(live_burst.norm()) < 0.7 * float(live_spread.norm())


def test_quiet_coordinate_is_raised_not_exploded():
    """A coordinate with no gradient during the warm-up (V = 0) that gets one afterwards moves as live
    Adam's first step would (about lr), not lr / eps."""
    p = torch.nn.Parameter(torch.zeros(4))
    opt = torch.optim.Adam([p], lr=0.01)
    vf = VarianceFreeze(opt, 3, {p: "p"})
    for step in range(3):
        p.grad = torch.tensor([1.0, 1.0, 1.0, 0.0])
        vf.before_step(opt, step)
        opt.step()
    before = p.detach().clone()
    p.grad = torch.tensor([1.0, 1.0, 1.0, 5.0])
    vf.before_step(opt, 3)
    opt.step()
    moved = (p.detach() - before).abs()
    assert torch.isfinite(p).all()
    assert float(moved[3]) < 0.01 * 1.0 / math.sqrt(1 - 0.999) + 1e-6  # live Adam's largest first step
    assert float(vf.frozen["p"][3]) > 0


def test_state_dict_round_trip():
    p = torch.nn.Parameter(torch.randn(10))
    opt = torch.optim.Adam([p], lr=0.01)
    vf = VarianceFreeze(opt, 1, {p: "p"})
    for step in range(4):
        p.grad = torch.randn(10)
        vf.before_step(opt, step)
        opt.step()
    other = VarianceFreeze(opt, 1, {p: "p"})
    other.load_state_dict(vf.state_dict())
    assert torch.equal(other.frozen["p"], vf.frozen["p"])
    other.frozen["p"].add_(1)
    assert not torch.equal(other.frozen["p"], vf.frozen["p"])  # a copy, not shared


def _decision(opt_kind, spec):
    p = torch.nn.Parameter(torch.zeros(3))
    opt = {"sgd": lambda: torch.optim.SGD([p], lr=0.1, momentum=0.9), "adam": lambda: torch.optim.Adam([p]),
           "adamax": lambda: torch.optim.Adamax([p])}[opt_kind]()
    comp = hvd_ext.compression_from_spec(spec)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        vf = VarianceFreeze.for_optimizer(opt, comp, {p: "p"})
    return vf, [str(w.message) for w in caught]


@pytest.mark.parametrize("opt_kind,spec,frozen", [
    ("sgd", "topk", False),                       # not adaptive
    ("adam", "none", False),                      # lossless
    ("adam", "fp16", False),
    ("adam", "topk", True),                       # error feedback: bursts
    ("adam", "dgc", True),
    ("adam", "efsignsgd", True),
    ("adam", "qsgd", True),                       # 4 bits: its noise inflates a live moment
    ("adam", "qsgd:bits=8", False),               # no memory, 8 bits: the live moment absorbs its noise
    ("adam", "signsgd", False),
    ("adam", "qsgd:variance=freeze", True),
    ("adam", "qsgd:variance=live", False),
    ("adam", "topk:variance=live", False),
    ("adam", "auto", False),                      # auto keeps it live and leaves codecs with memory out
    ("adam", "auto:variance=freeze", True),
    ("adamax", "topk", False),                    # a second moment hvd_ext cannot freeze: warned
])
def test_when_the_second_moment_is_frozen(opt_kind, spec, frozen):
    vf, msgs = _decision(opt_kind, spec)
    assert (vf is not None) == frozen
    if frozen and "variance=" not in spec:
        assert any("variance=live" in m for m in msgs)  # says how to turn it off
    if opt_kind == "adamax":
        assert any("stays live" in m for m in msgs)


def test_warmup_from_spec_and_bad_values():
    for spec in ("topk:warmup=7", "topk:warmup=7"):  # the old key still spells it
        vf, _ = _decision("adam", spec)
        assert vf.warmup == 7
    with pytest.raises(ValueError, match="variance.*auto.*freeze.*live"):
        hvd_ext.compression_from_spec("topk:variance=sometimes")
    with pytest.raises(ValueError, match="'warmup'"):
        hvd_ext.compression_from_spec("topk:warmup=-1")


def test_low_bit_qsgd_freezes_under_adam_and_says_why():
    vf, msgs = _decision("adam", "qsgd")
    said = [m for m in msgs if "second moment is frozen" in m]
    assert vf is not None and said and "noise" in said[0] and "variance=live" in said[0], msgs
    vf, msgs = _decision("sgd", "qsgd")
    assert vf is None and not msgs