"""Sparsification family: topk, threshold, dgc, sig and the ewma / dgc_momentum feedbacks.

Single-process tests drive compressors and feedbacks exactly as
``hvd_ext.pipeline`` does (compensate -> prepare_bucket -> compress ->
aggregate * scale -> adjust -> update -> commit), simulating N ranks in one
process; one 2-rank horovodrun launch checks the real exchange.
"""

import pytest
import torch

from hvd_ext.spec import compression_from_spec
from hvd_ext.compression._sparse import (CHUNK, count_for, index_format, pack, payload_bytes, sampled_indices,
                                         split_budget, topk_indices, unpack, generator)
from hvd_ext.compression.base import TensorInfo


# ---- helpers ------------------------------------------------------------------------------

def brute_topk(score, k):
    """Reference: sort by (score descending, index ascending), keep k, return ascending indices."""
    s = score.tolist()
    order = sorted(range(len(s)), key=lambda i: (-s[i], i))
    return sorted(order[:k])


def sim_step(comps, step, grads, params=None, scale=None):
    """One step of N simulated ranks; ``grads[r]`` maps name -> gradient of rank r.

    Returns (applied[r][name], sent[r][name], u[r][name])."""
    n = len(comps)
    scale = 1.0 / n if scale is None else scale
    names = list(grads[0])
    per_rank = []
    for r, c in enumerate(comps):
        fb = c.feedback
        comp_items = []
        for name in names:
            g = grads[r][name]
            info = TensorInfo(name=name, shape=g.shape, step=step, rank=r, size=n,
                              param=None if params is None else params[name])
            info.scale = scale
            comp_items.append((name, info, fb.compensate(name, g.float(), info)))
        if hasattr(c, "prepare_bucket"):
            c.prepare_bucket([(u, info) for _, info, u in comp_items])
        per_rank.append([(name, info, u) + tuple(c.compress(u, info)) for name, info, u in comp_items])
    applied, sents, us = [], [], []
    for r, c in enumerate(comps):
        fb = c.feedback
        a, s, uu = {}, {}, {}
        for j, (name, info, u, payload, ctx) in enumerate(per_rank[r]):
            datas = [per_rank[q][j][3] for q in range(n)]
            res = c.aggregate(datas, ctx, info).mul_(scale)
            sup = c.support(datas, ctx, info) if getattr(fb, "needs_support", False) else None
            res = fb.adjust(name, res, info, sup)
            sent = c.local_contribution(payload, ctx, info, res).reshape(u.shape)
            fb.update(name, u, sent, info)
            a[name], s[name], uu[name] = res.reshape(u.shape).clone(), sent, u
        fb.commit()
        applied.append(a)
        sents.append(s)
        us.append(uu)
    return applied, sents, us


def rank0(res, name="w"):
    """(applied, sent, u) of rank 0 for tensor ``name`` from a sim_step result."""
    return tuple(x[0][name] for x in res)


def make(spec, n=1):
    return [compression_from_spec(spec) for _ in range(n)]


def info_for(t, name="w", step=0, rank=0, size=1, param=None):
    return TensorInfo(name=name, shape=t.shape, step=step, rank=rank, size=size, param=param)


def selected(comp, t, **kw):
    payload, _ = comp.compress(t, info_for(t, **kw))
    idx, val = unpack(payload, t.numel(), comp.value_dtype)
    return idx.tolist(), payload


# ---- wire format -----------------------------------------------------------------------------

@pytest.mark.parametrize("n,k,vd,fmt", [
    (1000, 10, torch.float32, "u16"),
    (CHUNK, 7, torch.float16, "u16"),
    (3 * CHUNK + 5, 2000, torch.float32, "chunk"),
    (3 * CHUNK + 5, 999, torch.float16, "chunk"),
    (3 * CHUNK + 5, 3, torch.float32, "i32"),
    (3 * CHUNK + 5, 5, torch.float16, "i32"),
    (10, 0, torch.float32, "u16"),
])
def test_pack_roundtrip_and_exact_bytes(n, k, vd, fmt):
    g = torch.Generator().manual_seed(n + k)
    idx = torch.randperm(n, generator=g)[:k].sort().values
    if k > 2:  # chunk boundaries and the last coordinate
        idx = torch.unique(torch.cat([idx[:-3], torch.tensor([min(CHUNK - 1, n - 1), min(CHUNK, n - 1), n - 1])]))
        k = idx.numel()
    vals = torch.randn(k, generator=g)
    data = pack(idx, vals, n, vd)
    assert index_format(n, k) == fmt
    assert data.dtype == torch.uint8 and data.numel() == payload_bytes(n, k, 2 if vd == torch.float16 else 4)
    i2, v2 = unpack(data, n, vd)
    assert torch.equal(i2, idx)
    assert torch.equal(v2, vals.to(vd).float())
    with pytest.raises(ValueError):
        unpack(data[:-1], n, vd)


def test_index_bytes_smaller_than_int32():
    # 1% of 1M floats: 16-bit chunked indices + fp16 values = 4 bytes/coordinate + 68 header bytes
    n, k = 1 << 20, count_for(0.01, 1 << 20)
    assert payload_bytes(n, k, 2) == 4 + 4 * 16 + 2 * k + 2 * k
    assert payload_bytes(n, k, 4) < 8 * k


def test_fp16_values_saturate_and_memory_keeps_the_rest():
    c = compression_from_spec("topk:ratio=0.5,values=fp16")
    x = torch.tensor([1e6, -2.0, 0.1, -7e5])
    a, s, u = rank0(sim_step([c], 0, [{"w": x}]))
    assert torch.isfinite(a).all()
    assert s[0].item() == 65504.0 and s[3].item() == -65504.0
    assert torch.equal(s + c.feedback.memory["w"], x)


# ---- selection -------------------------------------------------------------------------------

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


def test_topk_indices_tie_break_lowest_index():
    x = torch.tensor([1.0, 3.0, 2.0, 3.0, 2.0, 2.0, 0.5])
    assert topk_indices(x, 3).tolist() == [1, 2, 3]
    assert topk_indices(x, 4).tolist() == [1, 2, 3, 4]
    assert topk_indices(x, 0).tolist() == [] and topk_indices(x, 9).tolist() == list(range(7))


def test_threshold_selects_strictly_above_tau():
    x = torch.tensor([0.5, -0.6, 0.25, 0.0, -0.25, 0.7])
    c = compression_from_spec("threshold:tau=0.25")
    idx, payload = selected(c, x)
    assert idx == [0, 1, 5]
    assert payload.numel() == payload_bytes(6, 3, 4) and c.wire_bytes(6) is None


@pytest.mark.parametrize("dist", ["normal", "laplace", "uniform", "heavy"])
@pytest.mark.parametrize("n,ratio", [(200_000, 0.01), (50_000, 0.001), (30_000, 0.05)])
def test_sampled_threshold_within_2x(dist, n, ratio):
    k = count_for(ratio, n)
    for seed in range(4):
        g = torch.Generator().manual_seed(seed)
        if dist == "normal":
            x = torch.randn(n, generator=g)
        elif dist == "laplace":
            e = torch.rand(n, generator=g)
            x = torch.sign(e - 0.5) * torch.log1p(-2 * (e - 0.5).abs()).neg()
        elif dist == "uniform":
            x = torch.rand(n, generator=g)
        else:
            x = torch.randn(n, generator=g) ** 5
        idx = sampled_indices(x.abs(), k, generator(seed, 0, "t", 0), 0.01)
        assert k / 2 <= idx.numel() <= 2 * k, (dist, n, k, idx.numel())
        assert torch.equal(idx, idx.sort().values) and idx.unique().numel() == idx.numel()
        # what it keeps is (nearly) the top: the smallest kept |x| is above the 2k-th largest
        assert x.abs()[idx].min() >= torch.topk(x.abs(), 2 * k).values[-1]


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


# ---- conservation ------------------------------------------------------------------------------

@pytest.mark.parametrize("spec", ["topk:ratio=0.1", "topk:ratio=0.1,mode=sampled,values=fp16",
                                  "topk:ratio=0.1,scope=model", "threshold:tau=0.5",
                                  "sig:ratio=0.1,alpha=1", "sig:ratio=0.1,alpha=0.5,split=global",
                                  "dgc:ratio=0.1,momentum=0,mode=exact"])
def test_conservation_sent_plus_memory_equals_input(spec):
    comps = make(spec, 2)
    g = torch.Generator().manual_seed(7)
    params = {"a": torch.randn(40, 30, generator=g), "b": torch.randn(30, generator=g)}
    for step in range(4):
        grads = [{k: torch.randn(v.shape, generator=g) for k, v in params.items()} for _ in comps]
        mem_before = [dict(c.feedback.memory) for c in comps]
        applied, sents, us = sim_step(comps, step, grads, params)
        for r, c in enumerate(comps):
            key = (lambda k: k + "\x00dgc_v") if spec.startswith("dgc") else (lambda k: k)
            for k in params:
                prev = mem_before[r].get(key(k), torch.zeros_like(params[k]))
                # input = gradient + old memory; it is split exactly into sent + new memory
                assert torch.allclose(us[r][k], grads[r][k] + prev, atol=1e-6)
                assert torch.equal(sents[r][k] + c.feedback.memory[key(k)], us[r][k])
            assert any((sents[r][k] != 0).any() for k in params)
        for k in params:
            assert torch.equal(applied[0][k], applied[1][k])
            assert torch.equal(applied[0][k], (sents[0][k] + sents[1][k]) * 0.5)


# ---- sig ----------------------------------------------------------------------------------------

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


def test_split_budget_properties():
    assert split_budget(10, [3, 1], [100, 100]) == [8, 2]  # 7.5/2.5 -> largest remainder, ties to earlier
    assert split_budget(10, [100, 1, 1], [2, 50, 50]) == [2, 4, 4]  # cap then re-split
    assert split_budget(6, [0, 0], [10, 20]) == [2, 4]  # no mass: by size
    assert split_budget(5, [1, float("nan")], [3, 10]) == [3, 2]
    for seed in range(20):
        g = torch.Generator().manual_seed(seed)
        sizes = torch.randint(0, 50, (5,), generator=g).tolist()
        w = torch.rand(5, generator=g).tolist()
        K = int(torch.randint(0, sum(sizes) + 1, (1,), generator=g))
        out = split_budget(K, w, sizes)
        assert sum(out) == K and all(0 <= o <= s for o, s in zip(out, sizes))


# ---- ewma (technique 4) ----------------------------------------------------------------------------

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


# ---- DGC ------------------------------------------------------------------------------------------

def test_dgc_warmup_schedule():
    c = compression_from_spec("dgc:ratio=0.001,start_ratio=0.25,warmup_steps=400,warmup_stages=4,mode=exact")
    dens = [c.density(s) for s in (0, 99, 100, 199, 200, 300, 399, 400, 10_000)]
    r = (0.001 / 0.25) ** 0.25
    exp = [0.25, 0.25, 0.25 * r, 0.25 * r, 0.25 * r ** 2, 0.25 * r ** 3, 0.25 * r ** 3, 0.001, 0.001]
    assert dens == pytest.approx(exp, rel=1e-12)
    assert c.sparsity(0) == 0.75 and c.sparsity(400) == pytest.approx(0.999)
    x = torch.randn(20_000, generator=torch.Generator().manual_seed(0))
    counts = [len(selected(compression_from_spec(
        "dgc:ratio=0.001,warmup_steps=400,mode=exact,momentum=0"), x, step=s)[0]) for s in (0, 150, 250, 350, 400)]
    assert counts == [count_for(c.density(s), 20_000) for s in (0, 150, 250, 350, 400)]
    assert counts == sorted(counts, reverse=True) and counts[0] == 5000 and counts[-1] == 20
    cont = compression_from_spec("dgc:ratio=0.01,start_ratio=0.1,warmup_steps=10,warmup_stages=0")
    assert cont.density(5) == pytest.approx(0.1 * 0.1 ** 0.5) and cont.density(10) == 0.01
    assert compression_from_spec("dgc:ratio=0.01").density(0) == 0.01  # no warm-up by default


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


def test_dgc_local_gradient_clipping():
    c = compression_from_spec("dgc:ratio=1,mode=exact,momentum=0,clip=2")
    g = torch.tensor([3.0, 4.0])  # norm 5
    info = info_for(g, size=4)  # limit 2 / sqrt(4) = 1
    v = c.feedback.compensate("w", g, info)
    assert torch.allclose(v, torch.tensor([0.6, 0.8]))
    small = torch.tensor([0.3, 0.4])
    assert torch.equal(compression_from_spec("dgc:momentum=0,clip=2").feedback.compensate(
        "w", small, info), small)


# ---- arguments ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("spec", [
    "topk:ratio=0", "topk:ratio=-0.1", "topk:ratio=1.5", "topk:ratio=nan", "topk:mode=fast",
    "topk:values=int8", "topk:scope=world", "topk:feedback=nope", "topk:ratio=0.1,feedback=ewma,beta=2",
    "topk:feedback=ewma,lambda=-1", "topk:colour=red", "threshold:tau=0", "threshold:tau=-1",
    "dgc:ratio=0.5,start_ratio=0.25,warmup_steps=10", "dgc:feedback=residual", "dgc:momentum=1", "dgc:clip=-1",
    "dgc:warmup_steps=-3", "sig:alpha=-1", "sig:eps=0", "sig:split=random", "sig:ratio=2",
    "topk:ratio=0.01,feedback=ewma,momentum=0.9",
])
def test_bad_arguments_raise_value_error(spec):
    with pytest.raises(ValueError):
        compression_from_spec(spec)


def test_constructor_kwargs_are_validated():
    from hvd_ext.compression.topk import TopKCompressor
    with pytest.raises(ValueError, match="ratio"):
        TopKCompressor(ratio=0.0)
    with pytest.raises(ValueError, match="unknown option"):
        TopKCompressor(k=3)
    assert TopKCompressor(ratio=1).ratio == 1.0


def test_aggregate_is_sum_of_decodes_and_support_is_union():
    c = compression_from_spec("topk:ratio=0.1")
    g = torch.Generator().manual_seed(9)
    xs = [torch.randn(200, generator=g) for _ in range(3)]
    payloads = [c.compress(x, info_for(x, rank=r))[0] for r, x in enumerate(xs)]
    info = info_for(xs[0])
    agg = c.aggregate(payloads, None, info)
    ref = torch.zeros(200)
    for p in payloads:
        ref = ref + c.decode(p, None, info)
    assert torch.equal(agg, ref)
    assert torch.equal(c.support(payloads, None, info), ref != 0)


def test_empty_and_tiny_tensors():
    for spec in ("topk:ratio=0.01", "sig:ratio=0.01", "threshold", "dgc:mode=exact"):
        c = compression_from_spec(spec)
        e = torch.zeros(0)
        (a,), _, _ = sim_step([c], 0, [{"e": e, "one": torch.tensor([0.5])}])
        assert a["e"].numel() == 0
    assert compression_from_spec("topk:scope=layer").wire_bytes(0) == payload_bytes(0, 0, 4) == 4
    assert compression_from_spec("topk").wire_bytes(0) is None  # default scope=model: size varies per tensor


# ---- 2 ranks through Horovod ------------------------------------------------------------------------

def test_two_ranks_agree_bit_for_bit(run_ranks):
    res = run_ranks("sparse_agree.py", np=2)
    assert [r["size"] for r in res] == [2, 2]
    for spec, rec in res[0]["specs"].items():
        assert rec["agree"] == [True, True, True], spec
        assert rec["params_agree"], spec
        assert all(0 < nz < rec["numel"] for nz in rec["nonzero"]), (spec, rec["nonzero"])
        assert res[1]["specs"][spec]["agree"] == [True, True, True]
    top = res[0]["specs"]["topk:ratio=0.01,scope=layer"]
    assert top["ref_ok"] is True
    assert top["bytes_ok"][0] == top["bytes_ok"][1]
    # about 2% nonzero after averaging two 1% selections
    assert max(res[0]["specs"]["topk:ratio=0.01,scope=layer"]["nonzero"]) <= 2 * sum(
        count_for(0.01, n) for n in (40 * 2000, 2000, 2000 * 3, 3))


@pytest.mark.parametrize("n,k,fmt", [(1000, 10, "u16"), (1 << 20, 10, "i32"), (3 * CHUNK - 100, 40, "chunk")])
def test_unpack_refuses_indices_outside_the_tensor(n, k, fmt):
    """A corrupt payload must not index outside the tensor: every format's indices are checked
    (on a device with the step's checks, the writes kept in range meanwhile)."""
    from hvd_ext.ops.device import Checks, deferred_checks, read_step
    from hvd_ext.testing.device import EmulatedDevice, to_device
    idx = torch.arange(k) * (n // k)
    data = pack(idx, torch.ones(k), n)
    assert index_format(n, k) == fmt
    assert torch.equal(unpack(data, n)[0], idx)
    bad = data.clone()  # the last index made n + 5 (i32), or 0xFFFF in the last chunk (16-bit formats)
    if fmt == "i32":
        bad[-4:] = torch.tensor([n + 5], dtype=torch.int32).view(torch.uint8)
    else:
        bad[-2:] = 0xFF
    with pytest.raises(ValueError, match="outside"):
        unpack(bad, n)
    with EmulatedDevice():
        checks = Checks()
        with deferred_checks(checks):
            i2, _ = unpack(to_device(bad), n)
        assert int(i2.max()) < n  # kept in range until the step reads its checks
        with pytest.raises(ValueError, match="outside"):
            read_step([], checks)


def test_unpack_refuses_a_size_that_holds_no_payload():
    data = pack(torch.arange(10), torch.ones(10), 1000)
    with pytest.raises(ValueError, match="does not hold"):
        unpack(data[:-1], 1000)
