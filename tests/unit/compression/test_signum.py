"""The signum codec (hvd_ext.compression.signum): its momentum state."""
import torch

from hvd_ext.spec import compression_from_spec as C

from helpers.quant import roundtrip


def test_signum_momentum_state():
    comp = C("signum:beta=0.5")
    g1, g2 = torch.tensor([1.0, -1.0, 2.0]), torch.tensor([-3.0, 0.5, -1.0])
    roundtrip(comp, g1, step=0)
    comp.commit()
    state = comp.state_dict()
    # a skipped step (non-finite somewhere) leaves the momentum as it was
    roundtrip(comp, torch.tensor([float("nan"), 1.0, 1.0]), step=1)
    comp.discard()
    assert torch.equal(comp.momentum["w"], state["momentum"]["w"])
    _, d = roundtrip(comp, g2, step=1)
    comp.commit()
    # m = 0.5*(0.5*g1) + 0.5*g2 = [-1.25, 0, 0]  -> signs (>= 0 -> +)
    assert torch.allclose(comp.momentum["w"], torch.tensor([-1.25, 0.0, 0.0]))
    # default scale=l1: signs times mean|m| / (1 - beta) = (1.25 / 3) / 0.5
    assert torch.allclose(d, torch.tensor([-1.0, 1.0, 1.0]) * (1.25 / 3) / 0.5)
    _, bare = roundtrip(C("signum:beta=0.5,scale=none"), g2, step=0)
    assert bare.tolist() == [-1, 1, -1]  # scale=none: the bare signs of m = 0.5 * g2
    other = C("signum:beta=0.5")
    other.load_state_dict(state)
    _, d2 = roundtrip(other, g2, step=1)
    other.commit()
    assert torch.equal(d, d2) and torch.equal(other.momentum["w"], comp.momentum["w"])
