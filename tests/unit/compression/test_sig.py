"""The sig codec (hvd_ext.compression.sig): saliency-weighted selection and budget split."""
import pytest
import torch

from hvd_ext.compression._sparse import (
    unpack,
)
from hvd_ext.spec import compression_from_spec

from helpers.sparse import brute_topk, info_for, selected, sim_step


def _bucket(seed=2):
    g = torch.Generator().manual_seed(seed)
    grads = {"w1": torch.randint(-3, 4, (64, 32), generator=g).float() * 0.1,
             "b1": torch.randn(64, generator=g), "w2": torch.randn(10, 64, generator=g) * 0.3}
    params = {k: torch.randn(v.shape, generator=g) for k, v in grads.items()}
    return grads, params


@pytest.mark.parametrize("sig_split,topk_scope", [("layer", "layer"), ("global", "model")])
def test_sig_alpha0_equals_topk(sig_split, topk_scope):
    grads, params = _bucket()
    for mode in ("exact", "sampled"):
        s = compression_from_spec(f"sig:ratio=0.03,alpha=0,split={sig_split},mode={mode}")
        t = compression_from_spec(f"topk:ratio=0.03,scope={topk_scope},mode={mode}")
        for step in range(3):  # memories evolve identically too
            (a1,), (s1,), _ = sim_step([s], step, [grads], params)
            (a2,), (s2,), _ = sim_step([t], step, [grads], params)
            for k in grads:
                assert torch.equal(s1[k], s2[k]) and torch.equal(a1[k], a2[k])


def test_sig_alpha0_single_tensor_equals_topk_for_every_split():
    x = torch.randint(-5, 6, (3000,), generator=torch.Generator().manual_seed(4)).float()
    w = torch.randn(3000)
    ref, _ = selected(compression_from_spec("topk:ratio=0.02"), x)
    for split in ("mass", "global", "layer"):
        s = compression_from_spec(f"sig:ratio=0.02,alpha=0,split={split}")
        (_, info, u), = [("w", info_for(x, param=w), x)]
        s.prepare_bucket([(u, info)])
        idx, _ = unpack(s.compress(u, info)[0], x.numel())
        assert idx.tolist() == ref


def test_sig_alpha_changes_selection_by_saliency():
    u = torch.tensor([1.0, 1.0, 0.5, 0.5, 0.2])
    w = torch.tensor([0.0, 10.0, 0.1, 100.0, 1.0])
    c = compression_from_spec("sig:ratio=0.4,alpha=1,eps=0.001,split=layer")
    idx, _ = selected(c, u, param=w)
    score = u.abs() * (w.abs() + 0.001)
    assert idx == brute_topk(score, 2) == [1, 3]


def test_sig_mass_split_follows_layer_saliency():
    # layer a has 3x the saliency mass of layer b, same size: budget 3:1
    a = torch.full((1000,), 3.0)
    b = torch.full((1000,), 1.0)
    c = compression_from_spec("sig:ratio=0.02,alpha=0,split=mass")
    items = [(a, info_for(a, "a")), (b, info_for(b, "b"))]
    c.prepare_bucket(items)
    ka = unpack(c.compress(a, items[0][1])[0], 1000)[0].numel()
    kb = unpack(c.compress(b, items[1][1])[0], 1000)[0].numel()
    assert (ka, kb) == (30, 10)
    assert not c._plan  # plan consumed
