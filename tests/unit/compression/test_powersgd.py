"""The powersgd codec (hvd_ext.compression.powersgd), its allreduce rounds simulated in one process."""
import torch

from hvd_ext.compression.base import Continue, TensorInfo
from hvd_ext.spec import compression_from_spec as C

from helpers.quant import info


def powersgd_round(comps, mats, name="m", step=0):
    """Simulate the pipeline's allreduce(Average) rounds for several ranks in one process, and its
    commit of the finite step (the warm start's Q)."""
    infos = [info(name, m.shape, step, r) for r, m in enumerate(mats)]
    outs = [c.compress(m, i) for c, m, i in zip(comps, mats, infos)]
    payloads, ctxs = [o[0] for o in outs], [o[1] for o in outs]
    while True:
        avg = torch.stack(payloads).mean(0)
        res = [c.decompress(avg.clone(), ctx, i) for c, ctx, i in zip(comps, ctxs, infos)]
        if not isinstance(res[0], Continue):
            for c in comps:
                c.commit()
            return res, payloads, ctxs, infos
        payloads, ctxs = [r.payload for r in res], [r.ctx for r in res]


def test_powersgd_exact_for_low_rank_two_ranks():
    g = torch.Generator().manual_seed(4)
    A = torch.randn(40, 3, generator=g) @ torch.randn(3, 6, 5, generator=g).reshape(3, 30)
    A = A.reshape(40, 6, 5)  # 3-D tensor viewed as 40 x 30
    D = torch.randn(40, 6, 5, generator=g)
    comps = [C("powersgd:rank=3,warmup=0"), C("powersgd:rank=3,warmup=0")]
    for step in range(2):  # first step and warm-started step
        res, payloads, _, _ = powersgd_round(comps, [A + D, A - D], step=step)
        assert payloads[0].numel() == 30 * 3  # second round: m x r
        for r in res:
            assert r.shape == A.shape and torch.allclose(r, A, atol=1e-4), float((r - A).abs().max())
    assert torch.equal(comps[0].q_memory["m"], comps[1].q_memory["m"])
    assert comps[0].wire_bytes_for((40, 6, 5)) == 4 * (40 + 30) * 3


def test_powersgd_feedback_conserves_and_resumes():
    g = torch.Generator().manual_seed(5)
    comp = C("powersgd:rank=1,warmup=0")
    fb = comp.feedback
    total_in, total_applied = torch.zeros(30, 20), torch.zeros(30, 20)
    for step in range(4):
        grad = torch.randn(30, 20, generator=g)
        i = info("m", grad.shape, step)
        u = fb.compensate("m", grad, i)
        res, _, _, _ = powersgd_round([comp], [u], step=step)
        p, ctx = comp.compress(u, i)  # fresh ctx only to call local_contribution
        sent = comp.local_contribution(p, ("P",), i, res[0])
        assert torch.equal(sent, res[0])
        fb.update("m", u, sent, i)
        fb.commit()
        total_in += grad
        total_applied += res[0]
        if step == 1:
            state, fstate = comp.state_dict(), fb.state_dict()
    assert torch.allclose(total_applied + fb.memory["m"], total_in, atol=1e-4)
    assert float(fb.memory["m"].norm()) > 0.1  # really compressed (rank 1 of 30x20)
    # resume from the step-1 checkpoint: steps 2..3 give identical results
    g2 = torch.Generator().manual_seed(5)
    grads = [torch.randn(30, 20, generator=g2) for _ in range(4)]
    comp2 = C("powersgd:rank=1,warmup=0")
    comp2.load_state_dict(state)
    comp2.feedback.load_state_dict(fstate)
    for step in (2, 3):
        i = info("m", (30, 20), step)
        u = comp2.feedback.compensate("m", grads[step], i)
        res, _, _, _ = powersgd_round([comp2], [u], step=step)
        comp2.feedback.update("m", u, res[0], i)
        comp2.feedback.commit()
    assert torch.equal(comp2.q_memory["m"], comp.q_memory["m"])
    assert torch.equal(comp2.feedback.memory["m"], fb.memory["m"])


def test_powersgd_sends_vectors_and_tiny_dense():
    comp = C("powersgd:rank=4")
    for shape in ((50,), (3, 3), (2, 100)):
        x = torch.randn(*shape)
        i = info("t", shape)
        p, ctx = comp.compress(x, i)
        assert ctx[0] == "dense" and torch.equal(p, x.reshape(-1))
        assert torch.equal(comp.decompress(p, ctx, i), x)
        assert comp.wire_bytes_for(shape) == 4 * x.numel()
    late = C("powersgd:rank=1,warmup=3")
    assert late.compress(torch.randn(20, 20), info("t", (20, 20), step=2))[1][0] == "dense"
    assert late.compress(torch.randn(20, 20), info("t", (20, 20), step=3))[1][0] == "P"


def test_rounds_follow_what_compress_sends():
    """``rounds`` is 2 exactly where ``compress`` sends the low-rank P (then Q), 1 where it sends dense:
    vectors, matrices that low rank would not shrink, and every tensor during the warm-up."""
    comp = C("powersgd:warmup=3,rank=2")
    for shape in [(64, 48), (7,), (3, 2), (16, 8, 3, 3)]:
        for step in (0, 2, 3, 10):
            t_info = TensorInfo(name="t", shape=torch.Size(shape), step=step, rank=0, size=2)
            payload, ctx = comp.compress(torch.randn(shape), t_info)
            assert comp.rounds(t_info) == (2 if ctx[0] == "P" else 1), (shape, step)
            if ctx[0] == "P":  # each round's bytes: P now, Q after it is reduced
                second = comp.decompress(payload, ctx, t_info)
                assert comp.round_bytes(t_info) == [4 * payload.numel(), 4 * second.payload.numel()]
            else:
                assert comp.round_bytes(t_info) is None
    assert C("none").rounds(TensorInfo(name="t", shape=torch.Size([5, 5]), step=9)) == 1
