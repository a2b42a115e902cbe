"""The ewma feedback (hvd_ext.feedback.ewma, technique 4), under topk on simulated ranks."""
import pytest
import torch

from hvd_ext.spec import compression_from_spec

from helpers.sparse import info_for, make, sim_step


@pytest.mark.parametrize("n,scale", [(3, None), (2, 1.0)])  # op=Average (1/N) and op=Sum (1)
def test_ewma_conserves_over_200_steps(n, scale):
    sigma = 1.0 / n if scale is None else scale
    comps = make("topk:ratio=0.05,feedback=ewma,beta=0.8,lambda=0.7", n)
    g = torch.Generator().manual_seed(11)
    shape = {"w": (20, 10), "b": (10,)}
    bias = {k: torch.randn(s, generator=g) for k, s in shape.items()}  # persistent mean -> S predicts well
    total_applied = {k: torch.zeros(s, dtype=torch.float64) for k, s in shape.items()}
    total_grad = {k: torch.zeros(s, dtype=torch.float64) for k, s in shape.items()}
    predicted = 0.0
    for step in range(200):
        grads = [{k: bias[k] + torch.randn(s, generator=g) for k, s in shape.items()} for _ in range(n)]
        applied, sents, _ = sim_step(comps, step, grads, scale=scale)
        for k in shape:
            assert torch.equal(applied[0][k], applied[-1][k])  # every rank applies the same update
            total_applied[k] += applied[0][k].double()
            total_grad[k] += sigma * sum(gr[k].double() for gr in grads)
            plain = sigma * sum(s[k] for s in sents)
            predicted += float((applied[0][k] - plain).abs().sum())
    assert predicted > 1.0  # the prediction lambda*S was really applied on unsent coordinates
    for k in shape:
        mem = sigma * sum(c.feedback.memory[k].double() for c in comps)
        err = (total_applied[k] + mem - total_grad[k]).abs().max().item()
        assert err < 1e-3 * max(1.0, total_grad[k].abs().max().item()), err


def test_ewma_share_is_full_prediction_under_average():
    c = compression_from_spec("topk:ratio=0.5,feedback=ewma,beta=0.5,lambda=1,rate=0")
    # step 0: coordinate 0 sent by both -> S_0 = 0.5*G_0 ; step 1: nothing sent there
    g0 = [{"w": torch.tensor([4.0, 0.0])}, {"w": torch.tensor([4.0, 0.0])}]
    comps = [c, compression_from_spec("topk:ratio=0.5,feedback=ewma,beta=0.5,lambda=1,rate=0")]
    sim_step(comps, 0, g0)
    assert torch.equal(comps[0].feedback.memory["w\x00ewma_S"], torch.tensor([2.0, 0.0]))
    g1 = [{"w": torch.tensor([0.0, 1.0])}, {"w": torch.tensor([0.0, 1.0])}]
    applied, sents, us = sim_step(comps, 1, g1)
    assert torch.equal(applied[0]["w"], torch.tensor([2.0, 1.0]))  # lambda*S_0 predicted
    for cc in comps:  # each worker pays the full lambda*S_0 (averaging exchange)
        assert torch.equal(cc.feedback.memory["w"], torch.tensor([-2.0, 0.0]))


def test_ewma_rate_smooths_per_step_gradient():
    """rate=1: a coordinate that waited a steps contributes G/a to S; rate=0 contributes G."""
    spec = "topk:ratio=0.5,feedback=ewma,beta=0.5,lambda=0,rate={}"
    for rate, expect in ((1, 0.5 * 9.0 / 4), (0, 0.5 * 9.0)):  # coordinate 0 waited steps 0..3
        comps = [compression_from_spec(spec.format(rate))]
        # step 0: coordinate 1 sent (S_0 stays 0); steps 1-2: coordinate 1 again; step 3: coordinate 0
        sim_step(comps, 0, [{"w": torch.tensor([0.0, 5.0])}])
        sim_step(comps, 1, [{"w": torch.tensor([0.0, 5.0])}])
        sim_step(comps, 2, [{"w": torch.tensor([0.0, 5.0])}])
        sim_step(comps, 3, [{"w": torch.tensor([9.0, 0.0])}])
        S = comps[0].feedback.memory["w\x00ewma_S"]
        assert S[0].item() == pytest.approx(expect), (rate, S)
        if rate:
            age = comps[0].feedback.memory["w\x00ewma_age"]
            assert age.tolist() == [0.0, 1.0]


def test_ewma_lambda0_equals_residual_bitwise():
    a = make("topk:ratio=0.05,feedback=ewma,lambda=0,beta=0.9", 2)
    b = make("topk:ratio=0.05", 2)
    g = torch.Generator().manual_seed(5)
    for step in range(15):
        grads = [{"w": torch.randn(30, 20, generator=g)} for _ in range(2)]
        ra, _, _ = sim_step(a, step, grads)
        rb, _, _ = sim_step(b, step, grads)
        assert torch.equal(ra[0]["w"], rb[0]["w"])
        for x, y in zip(a, b):
            assert torch.equal(x.feedback.memory["w"], y.feedback.memory["w"])


def test_ewma_state_dict_roundtrip_and_discard():
    c = compression_from_spec("topk:ratio=0.1,feedback=ewma")
    x = {"w": torch.randn(50)}
    sim_step([c], 0, [x])
    sd = c.feedback.state_dict()
    assert "w\x00ewma_S" in sd["memory"] and "w" in sd["memory"]
    d = compression_from_spec("topk:ratio=0.1,feedback=ewma")
    d.feedback.load_state_dict(sd)
    ra, _, _ = sim_step([c], 1, [x])
    rb, _, _ = sim_step([d], 1, [x])
    assert torch.equal(ra[0]["w"], rb[0]["w"])
    before = {k: v.clone() for k, v in c.feedback.memory.items()}
    info = info_for(x["w"])
    u = c.feedback.compensate("w", x["w"], info)
    c.feedback.adjust("w", torch.zeros(50), info, torch.zeros(50, dtype=torch.bool))
    c.feedback.update("w", u, torch.zeros(50), info)
    c.feedback.discard()  # a skipped (non-finite) step leaves memory untouched
    assert all(torch.equal(before[k], c.feedback.memory[k]) for k in before)
