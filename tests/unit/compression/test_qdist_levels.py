"""hvd_ext.compression.qdist_levels: per-bucket scale codes, and the optimal level fit."""
import torch

from helpers.quant import _heavy_tailed


def test_qdist_bucket_scales_cover_and_decode():
    from hvd_ext.compression.qdist_levels import bucket_scale_codes, bucket_scales
    x = _heavy_tailed(4096, 16)
    x[100:200] = 0.0  # an all-zero bucket (bucket 256 would be half zero)
    v = x.view(-1, 64)
    amax = v.abs().amax(1)
    amax[3] = 0.0
    M = float(amax.max())
    codes = bucket_scale_codes(amax, M)
    s = bucket_scales(codes, torch.tensor(M))
    assert int(codes[3]) == 255 and float(s[3]) == 0.0
    nz = amax > 0
    assert bool((s[nz] >= amax[nz]).all()) and bool((s[nz] <= amax[nz] * 2 ** (1 / 16) * 1.0001).all())
    assert float(s[int(amax.argmax())]) == M
    # tiny buckets next to a huge one keep a scale that covers them (floor of the code range)
    a = torch.tensor([1.0, 1e-12, 3e-6])
    sa = bucket_scales(bucket_scale_codes(a, 1.0), torch.tensor(1.0))
    assert bool((sa >= a).all())


def test_qdist_fitted_levels_are_optimal_on_the_grid():
    """dp_levels returns the exact minimum of the sampled stochastic-rounding error over level sets
    on its grid: compare with exhaustive search for 4 levels."""
    from hvd_ext.compression.qdist_levels import dp_levels, fit_edges
    E = fit_edges().numel() - 1
    g = torch.Generator().manual_seed(5)
    z = (torch.randn(3000, generator=g) * 0.2).clamp(-1, 1)
    z[:5] = torch.tensor([-1.0, 1.0, 0.0, 0.9, -0.7])
    w = torch.rand(3000, generator=g) + 0.1
    e = fit_edges()
    idx = dp_levels(z, w, 4)
    assert idx.numel() == 4 and int(idx[0]) == 0 and int(idx[-1]) == E and bool((idx[1:] > idx[:-1]).all())

    def err(lv):
        zz, ww = z.double(), w.double()
        i = (torch.searchsorted(lv, zz, right=True) - 1).clamp(0, lv.numel() - 2)
        return float((ww * (zz - lv[i]) * (lv[i + 1] - zz)).sum())

    best = err(e[idx])
    cand = torch.arange(1, E)  # exhaustive over pairs: none beats the DP
    for i in cand.tolist():
        for j in cand[cand > i].tolist():
            assert err(torch.stack([e[0], e[i], e[j], e[-1]])) >= best - 1e-9
    # fitted levels beat uniform ones on the sample
    assert best < err(torch.linspace(-1, 1, 4, dtype=torch.float64))
