"""DGC's feedback (hvd_ext.feedback.dgc_momentum): momentum correction, factor masking, local clipping."""
import torch

from hvd_ext.spec import compression_from_spec

from helpers.sparse import info_for, rank0, sim_step


def test_dgc_momentum_correction_and_factor_masking():
    m = 0.9
    c = compression_from_spec(f"dgc:ratio=0.25,mode=exact,momentum={m}")
    fb = c.feedback
    g1 = torch.tensor([4.0, 1.0, -0.5, 0.25, 2.0, -3.0, 0.1, 0.2])
    g2 = torch.tensor([1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0])
    _, s1, v1 = rank0(sim_step([c], 0, [{"w": g1}]))
    # step 0: u = g, v = g, top-2 of |v| = {0, 5}
    assert torch.equal(v1, g1) and (s1 != 0).nonzero().squeeze(1).tolist() == [0, 5]
    u_mem, v_mem = fb.memory["w\x00dgc_u"], fb.memory["w\x00dgc_v"]
    mask = torch.zeros(8, dtype=torch.bool)
    mask[[0, 5]] = True
    assert torch.equal(u_mem, g1.masked_fill(mask, 0))  # momentum factor masking
    assert torch.equal(v_mem, g1.masked_fill(mask, 0))
    _, s2, v2 = rank0(sim_step([c], 1, [{"w": g2}]))
    u_exp = m * u_mem + g2  # momentum correction: velocity accumulated before sparsification
    assert torch.allclose(v2, v_mem + u_exp)
    assert torch.equal(s2 + fb.memory["w\x00dgc_v"], v2)
    sent2 = s2 != 0
    assert torch.equal(fb.memory["w\x00dgc_u"], u_exp.masked_fill(sent2, 0))
    assert (fb.memory["w\x00dgc_u"][~sent2] != 0).all()


def test_dgc_local_gradient_clipping():
    c = compression_from_spec("dgc:ratio=1,mode=exact,momentum=0,clip=2")
    g = torch.tensor([3.0, 4.0])  # norm 5
    info = info_for(g, size=4)  # limit 2 / sqrt(4) = 1
    v = c.feedback.compensate("w", g, info)
    assert torch.allclose(v, torch.tensor([0.6, 0.8]))
    small = torch.tensor([0.3, 0.4])
    assert torch.equal(compression_from_spec("dgc:momentum=0,clip=2").feedback.compensate(
        "w", small, info), small)
