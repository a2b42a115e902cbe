"""Residual error feedback (hvd_ext.feedback.residual): conservation and commit/discard; compressed
momentum (``velocity=exchanged``, after 1-bit Adam): the optimizer's momentum -- SGD's ``momentum``
or Adam's first moment ``betas[0]`` -- is taken over and the velocity every rank shares is
compressed instead. Single process, driving the feedback as the pipeline does."""
from __future__ import annotations

import pytest
import torch

import hvd_ext
from hvd_ext.compression.base import TensorInfo
from hvd_ext.feedback.residual import ResidualFeedback
from hvd_ext.variance_freeze import VarianceFreeze

from helpers.codecs import bound as _bound, info


def test_residual_feedback_conserves_mass_and_commits_only_on_commit():
    fb = ResidualFeedback()
    c = hvd_ext.compression_from_spec("randomk:ratio=0.1")
    g = torch.randn(500)
    total_in = torch.zeros(500)
    total_sent = torch.zeros(500)
    for step in range(20):
        i = info(shape=(500,), step=step)
        u = fb.compensate("w", g, i)
        payload, ctx = c.compress(u, i)
        sent = c.local_contribution(payload, ctx, i, None)
        fb.update("w", u, sent, i)
        fb.commit()
        total_in += g
        total_sent += sent
        assert torch.allclose(total_sent + fb.memory["w"], total_in, atol=1e-4)
    before = fb.memory["w"].clone()
    fb.update("w", g, torch.zeros(500), info(shape=(500,)))
    fb.discard()
    assert torch.equal(fb.memory["w"], before)
    sd = fb.state_dict()
    fb2 = ResidualFeedback()
    fb2.load_state_dict(sd)
    assert torch.equal(fb2.memory["w"], before)


ADAMS = {
    "adam": lambda ps: torch.optim.Adam(ps, lr=0.01),
    "adam_l2": lambda ps: torch.optim.Adam(ps, lr=0.01, weight_decay=0.1),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1),
    "radam": lambda ps: torch.optim.RAdam(ps, lr=0.01),
}




def _lossless_step(fb, p, grad, step):
    """One exchange on one rank where everything is sent (ratio 1): what the pipeline does."""
    info = TensorInfo(name="p", shape=p.shape, step=step, param=p.detach())
    u = fb.compensate("p", grad, info)
    result = fb.adjust("p", u.clone(), info)
    fb.update("p", u, u, info)
    fb.commit()
    p.grad = result.reshape(p.shape)


@pytest.mark.parametrize("kind", sorted(ADAMS))
def test_adam_first_moment_taken_over_reproduces_adam(kind):
    """Nothing dropped (ratio 1), second moment frozen from the first step on both sides: Adam with
    its first moment carried by the feedback (betas[0] = 0; exponential average and bias correction
    in the feedback) follows plain Adam step for step. (A live second moment would differ: it would
    average the squared moment the optimizer is handed, not the squared gradient.)"""
    torch.manual_seed(0)
    first = torch.randn(50).sign() * (1 + torch.rand(50))  # away from 0: the floor of the freeze stays idle
    grads = [first] + [torch.randn(50) * (1 + 3 * (s % 5 == 4)) for s in range(29)]
    ref = torch.nn.Parameter(torch.randn(50))
    p = torch.nn.Parameter(ref.detach().clone())
    start = ref.detach().clone()
    ref_opt, opt = ADAMS[kind]([ref]), ADAMS[kind]([p])
    comp, msgs = _bound("randomk:ratio=1,variance=freeze,warmup=0", opt)
    assert opt.param_groups[0]["betas"] == (0.0, 0.999)
    assert comp.feedback.momentum == 0.9 and comp.feedback.velocity == "exchanged"
    assert any("first moment" in m and "betas[0]=0.9" in m for m in msgs), msgs
    ref_vf, vf = VarianceFreeze(ref_opt, 0, {ref: "p"}), VarianceFreeze(opt, 0, {p: "p"})
    for s, g in enumerate(grads):
        ref.grad = g.clone()
        ref_vf.before_step(ref_opt, s)
        ref_opt.step()
        _lossless_step(comp.feedback, p, g.clone(), s)
        vf.before_step(opt, s)
        opt.step()
        if kind != "adam_l2":
            torch.testing.assert_close(p.detach(), ref.detach(), rtol=1e-5, atol=1e-6)
    moved = (ref.detach() - start).abs().max()
    assert moved > 0.05  # it did train
    # L2 weight decay (Adam adds it to the gradient) enters the handed-over moment at the current
    # parameters instead of through the average: the paths stay within 1% of the distance moved
    assert (p.detach() - ref.detach()).abs().max() < (0.01 * moved if kind == "adam_l2" else 1e-5)


def test_adam_takeover_conserves_what_is_not_sent():
    """Lossy (top-k): every coordinate's applied moment plus what stays in memory is the moment of
    the gradients seen, so no gradient is lost; and the bias correction reads the feedback's own count."""
    torch.manual_seed(1)
    p = torch.nn.Parameter(torch.zeros(40))
    opt = torch.optim.Adam([p], lr=0.01)
    comp, _ = _bound("topk:ratio=0.1,momentum=0.9,velocity=exchanged", opt)
    fb = comp.feedback
    m_true = torch.zeros(40)
    for s in range(12):
        g = torch.randn(40)
        m_true = 0.9 * m_true + 0.1 * g
        info = TensorInfo(name="p", shape=p.shape, step=s)
        u = fb.compensate("p", g, info)
        payload, ctx = comp.compress(u, info)
        sent = comp.decode(payload, ctx, info)
        applied = fb.adjust("p", sent.clone(), info)
        fb.update("p", u, sent, info)
        fb.commit()
        torch.testing.assert_close(applied, sent / (1 - 0.9 ** (s + 1)))
        # the velocity the feedback carries forward is what was applied (uncorrected) ...
        torch.testing.assert_close(fb.memory["p\x00residual_m"], sent)
        assert int(fb.memory["p\x00residual_t"]) == s + 1
    # ... and sent + memory = 0.9 * last velocity + 0.1 * g + old memory: nothing is lost
    assert torch.equal(fb.memory["p"] + sent, u)


@pytest.mark.parametrize("spec,expect_taken", [("randomk", True), ("topk", False), ("efsignsgd", False),
                                               ("randomk:velocity=local", False)])
def test_default_takeover_under_adam(spec, expect_taken):
    """randomk compresses Adam's first moment by default; codecs measured fine with the optimizer's
    own first moment (topk, and efsignsgd's 1-bit Adam warm-up) leave it alone, as does a spec
    asking for the local velocity."""
    p = torch.nn.Parameter(torch.zeros(4))
    opt = torch.optim.Adam([p], lr=1e-3)
    comp, _ = _bound(spec, opt)
    assert (opt.param_groups[0]["betas"][0] == 0.0) == expect_taken
    if expect_taken:
        assert comp.feedback.velocity == "exchanged" and comp.feedback.momentum == 0.9


def test_randomk_takes_over_sgd_momentum_and_leaves_nadam():
    p = torch.nn.Parameter(torch.zeros(4))
    sgd = torch.optim.SGD([p], lr=0.05, momentum=0.9)
    comp, _ = _bound("randomk", sgd)
    assert sgd.param_groups[0]["momentum"] == 0.0 and comp.feedback.momentum == 0.9
    assert comp.feedback.velocity == "exchanged"
    nadam = torch.optim.NAdam([p], lr=1e-3)  # its momentum schedule is not a plain average: left alone
    comp, _ = _bound("randomk", nadam)
    assert nadam.param_groups[0]["betas"] == (0.9, 0.999) and comp.feedback.momentum == 0.0


def test_adam_groups_with_different_betas_refused():
    a, b = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.Adam([{"params": [a], "betas": (0.9, 0.999)}, {"params": [b], "betas": (0.8, 0.999)}])
    with pytest.raises(ValueError, match=r"different betas\[0\]"):
        _bound("randomk", opt)


def test_scheduler_cycling_adam_betas_drives_the_feedback_momentum():
    """OneCycleLR cycles betas[0] on Adam: the feedback keeps owning the first moment (the optimizer's
    betas[0] is set back to 0 each step) instead of applying momentum twice."""
    p = torch.nn.Parameter(torch.zeros(8))
    opt = torch.optim.Adam([p], lr=1e-3)
    comp, _ = _bound("randomk:ratio=1", opt)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-2, total_steps=20)
    for s in range(5):
        _lossless_step(comp.feedback, p, torch.randn(8), s)
        assert opt.param_groups[0]["betas"][0] == 0.0
        opt.step()
        sched.step()


@pytest.mark.parametrize("kind", ["sgd", "adam"])
def test_taken_momentum_survives_a_checkpoint_restored_before_wrapping(kind):
    """The optimizer state saved after a takeover holds momentum 0 / betas[0] 0. Restored into a fresh
    optimizer before it is wrapped, nothing is left to take over: the feedback's own state brings the
    momentum back, so the resumed run continues as it started."""
    make = {"sgd": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
            "adam": lambda ps: torch.optim.Adam(ps, lr=1e-3)}[kind]
    p = torch.nn.Parameter(torch.zeros(6))
    opt = make([p])
    comp, _ = _bound("randomk", opt)
    _lossless_step(comp.feedback, p, torch.ones(6), 0)
    opt.step()
    saved_opt, saved_fb = opt.state_dict(), comp.feedback.state_dict()

    q = torch.nn.Parameter(p.detach().clone())
    opt2 = make([q])
    opt2.load_state_dict(saved_opt)  # restored before wrapping: momentum / betas[0] is already 0
    comp2, _ = _bound("randomk", opt2)
    assert comp2.feedback.momentum == 0.0
    comp2.feedback.load_state_dict(saved_fb)
    assert comp2.feedback.momentum == 0.9
    # and an older checkpoint without it keeps the value found at binding
    comp3, _ = _bound("randomk", make([torch.nn.Parameter(torch.zeros(6))]))
    comp3.feedback.load_state_dict({"memory": {}})
    assert comp3.feedback.momentum == 0.9 and comp3.feedback.state_dict()["memory"]
