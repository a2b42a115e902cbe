"""Momentum correction with momentum-factor masking (hvd_ext.feedback.velocity) where sparsifiers use
it by default: ``sig``'s residual feedback and the ``ewma`` feedback take over a ``torch.optim.SGD``
optimizer's momentum, accumulate each rank's velocity before selection and forget it where the
rank sent. Other optimizers and explicit specs are left alone."""
from __future__ import annotations

import warnings

import pytest
import torch

import hvd_ext

from helpers.codecs import bound as _bound
from helpers.sparse import make, sim_step




def _param():
    return torch.nn.Parameter(torch.zeros(8))


@pytest.mark.parametrize("spec", ["sig:ratio=0.001", "topk:ratio=0.001,feedback=ewma", "sig:feedback=ewma"])
def test_sgd_momentum_taken_over_with_masking(spec):
    opt = torch.optim.SGD([_param()], lr=0.05, momentum=0.8)
    comp, warned = _bound(spec, opt)
    fb = comp.feedback
    assert opt.param_groups[0]["momentum"] == 0.0 and fb.momentum == 0.8
    assert any("momentum correction" in w for w in warned)
    assert getattr(fb, "masking", True) and getattr(fb, "velocity", "local") == "local"


@pytest.mark.parametrize("spec", ["sig:momentum=0", "topk:feedback=ewma,momentum=0", "topk", "dgc:feedback=dgc_momentum,momentum=0"])
def test_explicit_momentum_0_and_plain_topk_leave_sgd_alone(spec):
    opt = torch.optim.SGD([_param()], lr=0.05, momentum=0.9)
    comp, _ = _bound(spec, opt)
    assert opt.param_groups[0]["momentum"] == 0.9 and not comp.feedback.momentum


@pytest.mark.parametrize("make_opt", [
    lambda ps: torch.optim.SGD(ps, lr=0.05),                    # no momentum: nothing to take over
    lambda ps: torch.optim.Adam(ps, lr=1e-3),                   # keeps its first moment
    lambda ps: torch.optim.RMSprop(ps, lr=1e-3, momentum=0.9),  # not refused: these feedbacks apply none
])
@pytest.mark.parametrize("spec", ["sig", "topk:feedback=ewma"])
def test_other_optimizers_keep_their_momentum(make_opt, spec):
    opt = make_opt([_param()])
    before = [dict(g) for g in opt.param_groups]
    comp, _ = _bound(spec, opt)
    assert not comp.feedback.momentum
    assert [{k: g[k] for k in b if k != "params"} for g, b in zip(opt.param_groups, before)] == \
           [{k: v for k, v in b.items() if k != "params"} for b in before]


def _taken(spec, n, momentum):
    comps = make(spec, n)
    for c in comps:
        c.bind_optimizer(torch.optim.SGD([_param()], lr=0.05, momentum=momentum))
    return comps


@pytest.mark.parametrize("spec", ["sig:ratio=0.25,mode=exact", "topk:ratio=0.25,mode=exact,feedback=ewma"])
def test_velocity_accumulated_before_selection_and_masked_where_sent(spec):
    m = 0.5
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        comps = _taken(spec, 2, m)
    g = torch.Generator().manual_seed(3)
    key = comps[0].feedback.VELOCITY_KEY
    u_prev = [torch.zeros(16) for _ in comps]
    for step in range(6):
        grads = [{"w": torch.randn(16, generator=g)} for _ in comps]
        before = [c.feedback.memory.get("w") for c in comps]
        _, sents, us = sim_step(comps, step, grads)
        for r, c in enumerate(comps):
            vel = m * u_prev[r] + grads[r]["w"]
            mem = torch.zeros(16) if before[r] is None else before[r]
            assert torch.allclose(us[r]["w"], vel + mem, atol=1e-6)  # what was offered: velocity + memory
            sent = sents[r]["w"] != 0
            assert sent.any() and (~sent).any()
            u_now = c.feedback.memory["w" + key]
            assert torch.equal(u_now[sent], torch.zeros(int(sent.sum())))  # masked where this rank sent
            assert torch.allclose(u_now[~sent], vel[~sent], atol=1e-6)     # kept elsewhere
            u_prev[r] = u_now.clone()


def test_skipped_step_keeps_the_velocity():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        (c,) = _taken("sig:ratio=0.25,mode=exact", 1, 0.9)
    sim_step([c], 0, [{"w": torch.arange(1.0, 9.0)}])
    fb = c.feedback
    saved = {k: v.clone() for k, v in fb.memory.items()}
    fb.compensate("w", torch.ones(8), None)
    fb.update("w", torch.ones(8), torch.zeros(8), None)
    fb.discard()
    assert saved.keys() == fb.memory.keys() and all(torch.equal(saved[k], fb.memory[k]) for k in saved)


def test_masked_velocity_keeps_sig_off_the_node_aware_route():
    """Inside a node everything is sent, so masking there would zero the velocity every step: a
    residual memory with masking is not kept at node level (the flat route is used)."""
    from hvd_ext.exchange.routes.choice import codec_node_aware_reason

    comp = hvd_ext.compression_from_spec("sig")
    assert codec_node_aware_reason(comp) is None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        comp.bind_optimizer(torch.optim.SGD([_param()], lr=0.05, momentum=0.9))
    assert "sent mask" in codec_node_aware_reason(comp)
    plain = hvd_ext.compression_from_spec("sig:momentum=0.9")  # momentum correction without masking
    assert codec_node_aware_reason(plain) is None


@pytest.mark.parametrize("make_opt", [
    lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, nesterov=True),
    lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, dampening=0.1),
    lambda ps: torch.optim.SGD([{"params": ps[:1], "momentum": 0.9}, {"params": ps[1:], "momentum": 0.0}], lr=0.05),
    lambda ps: torch.optim.SGD([{"params": ps[:1], "momentum": 0.9}, {"params": ps[1:], "momentum": 0.5}], lr=0.05),
])
@pytest.mark.parametrize("spec", ["sig", "topk:feedback=ewma"])
def test_a_momentum_not_reproduced_exactly_stays_with_the_optimizer(make_opt, spec):
    """By default only a plain SGD momentum (one value, no Nesterov, no dampening) is taken over; any
    other stays the optimizer's, and nothing is refused (an explicit momentum= still takes it)."""
    opt = make_opt([torch.nn.Parameter(torch.zeros(4)), torch.nn.Parameter(torch.zeros(2))])
    before = [g["momentum"] for g in opt.param_groups]
    comp, warned = _bound(spec, opt)
    assert [g["momentum"] for g in opt.param_groups] == before and not comp.feedback.momentum
    assert not any("took over" in w for w in warned)


@pytest.mark.parametrize("spec", ["sig:ratio=0.25,mode=exact", "topk:ratio=0.25,mode=exact,feedback=ewma"])
def test_taken_momentum_survives_a_checkpoint_restored_before_wrapping(spec):
    """Saved after a takeover the optimizer holds momentum 0; restored before it is wrapped there is
    nothing to take, and the feedback's state brings back the momentum, still masked."""
    p = torch.nn.Parameter(torch.zeros(8))
    opt = torch.optim.SGD([p], lr=0.05, momentum=0.9)
    comp, _ = _bound(spec, opt)
    sim_step([comp], 0, [{"w": torch.arange(1.0, 9.0)}])
    opt2 = torch.optim.SGD([torch.nn.Parameter(torch.zeros(8))], lr=0.05, momentum=0.9)
    opt2.load_state_dict(opt.state_dict())
    comp2, _ = _bound(spec, opt2)
    comp2.feedback.load_state_dict(comp.feedback.state_dict())
    assert comp2.feedback.momentum == 0.9 and opt2.param_groups[0]["momentum"] == 0.0
    _, sents, _ = sim_step([comp2], 1, [{"w": torch.ones(8)}])
    u = comp2.feedback.memory["w" + comp2.feedback.VELOCITY_KEY]
    sent = sents[0]["w"] != 0
    assert sent.any() and torch.equal(u[sent], torch.zeros(int(sent.sum()))) and (u[~sent] != 0).all()


@pytest.mark.parametrize("spec", ["sig:ratio=0.25,mode=exact", "topk:ratio=0.25,mode=exact,feedback=ewma",
                                  "dgc:ratio=0.25,mode=exact"])
def test_weight_decay_taken_over_with_the_momentum_and_added_before_it(spec):
    """torch's SGD adds wd * p to the gradient before its momentum: taken over, the velocity must add
    it too (else the decay acts 1 - m times as strongly), and the optimizer runs with wd 0."""
    m, wd = 0.5, 0.1
    p = torch.nn.Parameter(torch.linspace(-1.0, 1.0, 8))
    opt = torch.optim.SGD([p], lr=0.05, momentum=m, weight_decay=wd)
    comp, warned = _bound(spec, opt)
    fb = comp.feedback
    assert opt.param_groups[0]["weight_decay"] == 0.0 and fb.weight_decay == wd
    assert any("weight decay 0.1" in w for w in warned)
    g = torch.arange(1.0, 9.0)
    _, sents, _ = sim_step([comp], 0, [{"w": g}], params={"w": p.detach()})
    u = fb.memory["w" + fb.VELOCITY_KEY]
    sent = sents[0]["w"] != 0
    assert torch.allclose(u[~sent], (g + wd * p.detach())[~sent])
    # a checkpoint restored before wrapping brings the decay back
    opt2 = torch.optim.SGD([torch.nn.Parameter(p.detach().clone())], lr=0.05, momentum=m, weight_decay=wd)
    opt2.load_state_dict(opt.state_dict())
    comp2, _ = _bound(spec, opt2)
    comp2.feedback.load_state_dict(fb.state_dict())
    assert comp2.feedback.weight_decay == wd and opt2.param_groups[0]["weight_decay"] == 0.0


@pytest.mark.parametrize("spec", ["sig", "topk:feedback=ewma"])
def test_different_weight_decays_leave_the_optimizer_alone(spec):
    a, b = torch.nn.Parameter(torch.zeros(4)), torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([{"params": [a], "weight_decay": 1e-4}, {"params": [b], "weight_decay": 0.0}],
                          lr=0.05, momentum=0.9)
    comp, _ = _bound(spec, opt)
    assert [g["momentum"] for g in opt.param_groups] == [0.9, 0.9]
    assert [g["weight_decay"] for g in opt.param_groups] == [1e-4, 0.0] and not comp.feedback.momentum


def test_restored_optimizer_is_watched_so_a_scheduler_cannot_double_the_momentum():
    spec = "sig:ratio=0.25,mode=exact"
    p = torch.nn.Parameter(torch.zeros(8))
    opt = torch.optim.SGD([p], lr=0.05, momentum=0.9)
    comp, _ = _bound(spec, opt)
    opt2 = torch.optim.SGD([torch.nn.Parameter(torch.zeros(8))], lr=0.05, momentum=0.9)
    opt2.load_state_dict(opt.state_dict())            # momentum 0 in its groups: nothing to take
    comp2, _ = _bound(spec, opt2)
    comp2.feedback.load_state_dict(comp.feedback.state_dict())
    opt2.param_groups[0]["momentum"] = 0.85           # a cycling scheduler writes it back
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sim_step([comp2], 1, [{"w": torch.ones(8)}])
    assert opt2.param_groups[0]["momentum"] == 0.0 and comp2.feedback.momentum == 0.85


def test_auto_candidate_sig_does_not_reconfigure_the_shared_memory():
    comp = hvd_ext.compression_from_spec("auto:candidates=none,sig:ratio=0.01,efsignsgd")
    opt = torch.optim.SGD([_param()], lr=0.05, momentum=0.9)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        comp.bind_optimizer(opt)
    # neither sig (momentum correction) nor efsignsgd (compressed momentum) reconfigures it for itself:
    # the optimizer keeps its momentum, and efsignsgd, which needs its own, is not eligible
    assert not comp.feedback.masking and comp.feedback.velocity == "local" and not comp.feedback.momentum
    assert opt.param_groups[0]["momentum"] == 0.9
    assert [comp.allowed(i) for i in range(3)] == [True, True, False]
