"""The topk codec (hvd_ext.compression.topk): exact and sampled selection, scope=model."""
import pytest
import torch

from hvd_ext.compression._sparse import (
    count_for,
)
from hvd_ext.spec import compression_from_spec

from helpers.sparse import brute_topk, info_for, selected, sim_step


@pytest.mark.parametrize("n,ratio", [(1, 0.5), (17, 0.2), (500, 0.01), (500, 0.3), (4096, 1.0)])
def test_topk_matches_brute_force_with_ties(n, ratio):
    g = torch.Generator().manual_seed(n)
    x = torch.randint(-4, 5, (n,), generator=g).float()  # many ties
    c = compression_from_spec(f"topk:ratio={ratio},scope=layer")  # fixed size: per-layer exact top-k
    idx, payload = selected(c, x)
    k = count_for(ratio, n)
    assert idx == brute_topk(x.abs(), k)
    assert payload.numel() == c.wire_bytes(n)
    # the decoded dense contribution carries exactly those values
    d = c.decode(payload, None, info_for(x))
    assert torch.equal(d[idx], x[idx]) and int((d != 0).sum()) == int((x[idx] != 0).sum())


def test_sampled_mode_through_compressor_is_deterministic():
    x = torch.randn(100_000, generator=torch.Generator().manual_seed(3))
    c = compression_from_spec("topk:ratio=0.01,mode=sampled")
    a, pa = selected(c, x, step=5)
    b, pb = selected(c, x, step=5)
    assert a == b and torch.equal(pa, pb)
    assert 500 <= len(a) <= 2000 and c.wire_bytes(x.numel()) is None


def test_topk_scope_model_is_one_global_topk():
    g = torch.Generator().manual_seed(1)
    grads = {"a": torch.randn(300, generator=g) * 3, "b": torch.randint(-2, 3, (50, 4), generator=g).float(),
             "c": torch.randn(7, generator=g) * 0.01}
    c = compression_from_spec("topk:ratio=0.05,scope=model")
    (applied,), (sent,), _ = sim_step([c], 0, [grads])
    cat = torch.cat([v.reshape(-1) for v in grads.values()])
    ref = brute_topk(cat.abs(), count_for(0.05, cat.numel()))
    got, off = [], 0
    for name, v in grads.items():
        got += [off + i for i in (sent[name].reshape(-1) != 0).nonzero().squeeze(1).tolist()]
        off += v.numel()
    nz_ref = [i for i in ref if cat[i] != 0]
    assert got == nz_ref
    assert sent["c"].abs().sum() == 0 and (sent["a"] != 0).sum() > (sent["b"] != 0).sum() // 10


def test_constructor_kwargs_are_validated():
    from hvd_ext.compression.topk import TopKCompressor
    with pytest.raises(ValueError, match="ratio"):
        TopKCompressor(ratio=0.0)
    with pytest.raises(ValueError, match="unknown option"):
        TopKCompressor(k=3)
    assert TopKCompressor(ratio=1).ratio == 1.0
