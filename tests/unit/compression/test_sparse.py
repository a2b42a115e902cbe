"""The sparsification family as a whole (topk, threshold, dgc, sig; hvd_ext.compression._sparse):
the wire format, selection helpers, conservation, bad arguments, aggregate and support.

Single-process tests drive compressors and feedbacks exactly as ``hvd_ext.pipeline`` does
(tests/helpers/sparse.py), simulating N ranks in one process."""
import pytest
import torch

from hvd_ext.compression._sparse import (
    CHUNK,
    count_for,
    generator,
    index_format,
    pack,
    payload_bytes,
    sampled_indices,
    split_budget,
    topk_indices,
    unpack,
)
from hvd_ext.spec import compression_from_spec

from helpers.sparse import info_for, make, rank0, sim_step


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


def test_topk_indices_tie_break_lowest_index():
    x = torch.tensor([1.0, 3.0, 2.0, 3.0, 2.0, 2.0, 0.5])
    assert topk_indices(x, 3).tolist() == [1, 2, 3]
    assert topk_indices(x, 4).tolist() == [1, 2, 3, 4]
    assert topk_indices(x, 0).tolist() == [] and topk_indices(x, 9).tolist() == list(range(7))


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


@pytest.mark.parametrize("spec", [
    "topk:ratio=0", "topk:ratio=-0.1", "topk:ratio=1.5", "topk:ratio=nan", "topk:mode=fast",
    "topk:values=int8", "topk:scope=world", "topk:feedback=nope", "topk:ratio=0.1,feedback=ewma,beta=2",
    "topk:feedback=ewma,lambda=-1", "topk:colour=red", "threshold:tau=0", "threshold:tau=-1",
    "dgc:ratio=0.5,start_ratio=0.25,ramp_steps=10", "dgc:feedback=residual", "dgc:momentum=1", "dgc:clip=-1",
    "dgc:ramp_steps=-3", "sig:alpha=-1", "sig:eps=0", "sig:split=random", "sig:ratio=2",
    "topk:ratio=0.01,feedback=ewma,momentum=1",
])
def test_bad_arguments_raise_value_error(spec):
    with pytest.raises(ValueError):
        compression_from_spec(spec)


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
