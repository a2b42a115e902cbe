"""The dgc codec (hvd_ext.compression.dgc): warm-up schedule, default sampled mode."""
import pytest
import torch

from hvd_ext.compression._sparse import (
    count_for,
)
from hvd_ext.spec import compression_from_spec

from helpers.sparse import make, selected, sim_step


def test_dgc_warmup_schedule():
    c = compression_from_spec("dgc:ratio=0.001,start_ratio=0.25,ramp_steps=400,ramp_stages=4,mode=exact")
    dens = [c.density(s) for s in (0, 99, 100, 199, 200, 300, 399, 400, 10_000)]
    r = (0.001 / 0.25) ** 0.25
    exp = [0.25, 0.25, 0.25 * r, 0.25 * r, 0.25 * r ** 2, 0.25 * r ** 3, 0.25 * r ** 3, 0.001, 0.001]
    assert dens == pytest.approx(exp, rel=1e-12)
    assert c.sparsity(0) == 0.75 and c.sparsity(400) == pytest.approx(0.999)
    x = torch.randn(20_000, generator=torch.Generator().manual_seed(0))
    counts = [len(selected(compression_from_spec(
        "dgc:ratio=0.001,ramp_steps=400,mode=exact,momentum=0"), x, step=s)[0]) for s in (0, 150, 250, 350, 400)]
    assert counts == [count_for(c.density(s), 20_000) for s in (0, 150, 250, 350, 400)]
    assert counts == sorted(counts, reverse=True) and counts[0] == 5000 and counts[-1] == 20
    cont = compression_from_spec("dgc:ratio=0.01,start_ratio=0.1,ramp_steps=10,ramp_stages=0")
    assert cont.density(5) == pytest.approx(0.1 * 0.1 ** 0.5) and cont.density(10) == 0.01
    assert compression_from_spec("dgc:ratio=0.01").density(0) == 0.01  # no warm-up by default


def test_dgc_default_sampled_mode_counts_and_conservation():
    comps = make("dgc:ratio=0.01", 2)  # sampled threshold, momentum 0.9 (the paper's setting)
    g = torch.Generator().manual_seed(12)
    k = count_for(0.01, 20_000)
    for step in range(5):
        grads = [{"w": torch.randn(20_000, generator=g)} for _ in comps]
        applied, sents, us = sim_step(comps, step, grads)
        for r, c in enumerate(comps):
            assert k / 2 <= int((sents[r]["w"] != 0).sum()) <= 1.3 * k
            assert torch.equal(sents[r]["w"] + c.feedback.memory["w\x00dgc_v"], us[r]["w"])
        assert torch.equal(applied[0]["w"], applied[1]["w"])
