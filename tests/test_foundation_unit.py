"""Unit tests (single process, no collectives) for specs, options, codecs, feedback and buckets."""
import pytest
import torch

import hvd_ext
from hvd_ext.compression.base import TensorInfo, as_bytes, from_bytes
from hvd_ext.feedback.residual import ResidualFeedback
from hvd_ext.options import Option, parse_spec
from hvd_ext.pipeline import plan_buckets


def info(name="w", shape=(1000,), step=0, rank=0):
    return TensorInfo(name=name, shape=torch.Size(shape), step=step, rank=rank, size=2)


def test_list_compressors_has_foundation_names():
    names = hvd_ext.list_compressors()
    for n in ("none", "fp16", "bf16", "randomk"):
        assert n in names
    assert names == sorted(names)


@pytest.mark.parametrize("spec,fragment", [
    ("nosuch", "unknown compressor 'nosuch'"),
    ("randomk:ratio=0", "0 < ratio <= 1"),
    ("randomk:ratio=1.5", "0 < ratio <= 1"),
    ("randomk:ratio=abc", "expected float"),
    ("randomk:bogus=1", "unknown key(s) 'bogus'"),
    ("randomk:feedback=nosuch", "unknown feedback 'nosuch'"),
    ("randomk:ratio", "not of the form key=value"),
    ("randomk:ratio=0.1,ratio=0.2", "given twice"),
    ("", "empty"),
    ("fp16:ratio=0.1", "accepted: feedback"),
])
def test_bad_specs_raise_value_error_naming_the_problem(spec, fragment):
    with pytest.raises(ValueError) as e:
        hvd_ext.compression_from_spec(spec)
    assert fragment in str(e.value)


def test_bad_spec_lists_accepted_values():
    with pytest.raises(ValueError) as e:
        hvd_ext.compression_from_spec("nosuch")
    for n in ("none", "fp16", "randomk"):
        assert n in str(e.value)


def test_spec_round_trip_and_feedback_default():
    c = hvd_ext.compression_from_spec("randomk:ratio=0.05,seed=3")
    assert c.ratio == 0.05 and c.seed == 3 and c.feedback.name == "residual"
    assert hvd_ext.compression_from_spec(c.spec()).opts == c.opts
    assert hvd_ext.compression_from_spec("randomk:feedback=none").feedback.name == "none"
    assert hvd_ext.compression_from_spec("fp16").feedback.name == "none"


def test_parse_spec_and_option_conversion():
    assert parse_spec(" TopK : ratio=0.1 , feedback=ewma ") == ("topk", {"ratio": "0.1", "feedback": "ewma"})
    opt = Option(int, 1, ">= 1", lambda v: v >= 1)
    assert opt.convert("x", "k", "4") == 4
    with pytest.raises(ValueError):
        opt.convert("x", "k", "2.5")
    with pytest.raises(ValueError):
        opt.convert("x", "k", True)
    b = Option(bool, False)
    assert b.convert("x", "b", "yes") is True and b.convert("x", "b", "0") is False


@pytest.mark.parametrize("spec,dtype", [("fp16", torch.float16), ("bf16", torch.bfloat16)])
def test_cast_codecs_round_trip(spec, dtype):
    c = hvd_ext.compression_from_spec(spec)
    t = torch.randn(37, 3)
    payload, ctx = c.compress(t, info(shape=t.shape))
    # both ride on allreduce (Horovod has no bfloat16 collective: the Exchange sums bf16 itself)
    assert c.exchange == "allreduce" and c.lossless
    assert payload.dtype == dtype and payload.numel() == t.numel()
    out = c.decompress(payload, ctx, info(shape=t.shape))
    assert out.dtype == torch.float32 and out.shape == t.shape
    tol = 1e-3 if dtype == torch.float16 else 1e-2
    assert torch.allclose(out, t, rtol=tol, atol=tol)
    assert c.wire_bytes(t.numel()) == 2 * t.numel()


def test_none_codec_is_identity():
    c = hvd_ext.compression_from_spec("none")
    t = torch.randn(5, 4)
    p, ctx = c.compress(t, info(shape=t.shape))
    assert torch.equal(c.decompress(p, ctx, info(shape=t.shape)), t)


def test_randomk_payload_bytes_and_decode():
    c = hvd_ext.compression_from_spec("randomk:ratio=0.1")
    t = torch.randn(1000)
    payload, ctx = c.compress(t, info())
    assert payload.dtype == torch.uint8 and payload.numel() == c.wire_bytes(1000) == 8 * 100
    dense = c.decode(payload, ctx, info())
    nz = dense != 0
    assert int(nz.sum()) == 100
    assert torch.equal(dense[nz], t[nz])


def test_randomk_indices_deterministic_per_step_rank_and_shared():
    c = hvd_ext.compression_from_spec("randomk:ratio=0.05")
    a = c.indices(info(step=3, rank=0))
    assert torch.equal(a, c.indices(info(step=3, rank=0)))
    assert not torch.equal(a, c.indices(info(step=4, rank=0)))
    assert not torch.equal(a, c.indices(info(step=3, rank=1)))
    s = hvd_ext.compression_from_spec("randomk:ratio=0.05,shared=1")
    assert s.exchange == "allreduce"
    assert torch.equal(s.indices(info(step=3, rank=0)), s.indices(info(step=3, rank=1)))
    assert len(torch.unique(a)) == len(a) == 50


def test_randomk_aggregate_is_sum_of_decodes():
    c = hvd_ext.compression_from_spec("randomk:ratio=0.2")
    ts = [torch.randn(300) for _ in range(3)]
    datas = [c.compress(t, info(shape=(300,), rank=r))[0] for r, t in enumerate(ts)]
    agg = c.aggregate(datas, None, info(shape=(300,)))
    ref = sum(c.decode(d, None, info(shape=(300,))) for d in datas)
    assert torch.allclose(agg, ref)


def test_residual_feedback_conserves_mass_and_commits_only_on_commit():
    fb = ResidualFeedback()
    c = hvd_ext.compression_from_spec("randomk:ratio=0.1")
    g = torch.randn(500)
    total_in = torch.zeros(500)
    total_sent = torch.zeros(500)
    for step in range(20):
        i = info(shape=(500,), step=step)
        u = fb.compensate("w", g, i)
        payload, ctx = c.compress(u, i)
        sent = c.local_contribution(payload, ctx, i, None)
        fb.update("w", u, sent, i)
        fb.commit()
        total_in += g
        total_sent += sent
        assert torch.allclose(total_sent + fb.memory["w"], total_in, atol=1e-4)
    before = fb.memory["w"].clone()
    fb.update("w", g, torch.zeros(500), info(shape=(500,)))
    fb.discard()
    assert torch.equal(fb.memory["w"], before)
    sd = fb.state_dict()
    fb2 = ResidualFeedback()
    fb2.load_state_dict(sd)
    assert torch.equal(fb2.memory["w"], before)


def test_bytes_helpers_alignment():
    idx = torch.arange(5, dtype=torch.int32)
    val = torch.randn(5)
    buf = as_bytes(idx, val)
    assert buf.numel() == 40
    odd = torch.cat([torch.zeros(1, dtype=torch.uint8), buf])  # misaligned by one byte
    got_idx, off = from_bytes(odd, 1, torch.int32, 5)
    got_val, _ = from_bytes(odd, off, torch.float32, 5)
    assert torch.equal(got_idx, idx) and torch.equal(got_val, val)
    with pytest.raises(ValueError):
        from_bytes(buf, 0, torch.float32, 11)


def test_plan_buckets_is_deterministic_and_bounded():
    params = [(f"p{i}", torch.zeros(n)) for i, n in enumerate([10, 300, 50, 700, 5])]
    b = plan_buckets(params, bucket_bytes=1200)
    assert b == plan_buckets(params, bucket_bytes=1200)
    assert sorted(i for bucket in b for i in bucket) == list(range(5))
    assert b[0][0] == 4  # reverse order: last parameter first (backward order)
    for bucket in b:
        if len(bucket) > 1:
            assert sum(params[i][1].numel() * 4 for i in bucket) <= 1200


def test_first_bucket_takes_the_tensor_that_crosses_its_size():
    """The first bucket (backward order) closes once it holds first_bucket_bytes, so a large last
    layer goes in it and its exchange overlaps the rest of backward; no bucket exceeds bucket_bytes
    unless it holds a single tensor."""
    params = [(f"p{i}", torch.zeros(n)) for i, n in enumerate([400, 300, 200, 250, 10])]
    b = plan_buckets(params, bucket_bytes=4000, first_bucket_bytes=800)
    assert b[0] == [4, 3]  # 40 B, then 1000 B crosses 800 B: both in the first bucket
    assert b[1:] == [[2, 1, 0]]
    assert plan_buckets(params, bucket_bytes=900, first_bucket_bytes=800)[0] == [4]  # never past bucket_bytes


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_any_nonfinite(dtype):
    from hvd_ext.ops.device import any_nonfinite

    big = torch.finfo(dtype).max
    ok = [torch.randn(1000).to(dtype), torch.full((8,), big, dtype=dtype), torch.arange(5)]  # the sum overflows
    assert not any_nonfinite(ok)
    assert not any_nonfinite([])
    for bad in (float("nan"), float("inf"), float("-inf")):
        t = torch.randn(300).to(dtype)
        t[123] = bad
        assert any_nonfinite(ok + [t])


def test_distributed_optimizer_rejects_bad_arguments_before_any_collective():
    # horovod is imported but NOT initialised: validation must fail first.
    import horovod.torch as hvd

    model = torch.nn.Linear(3, 2)

    def make(**kw):
        return hvd_ext.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                            named_parameters=model.named_parameters(), **kw)

    cases = [
        (dict(compression="nosuch"), "unknown compressor"),
        (dict(compression=42), "unsupported value"),
        (dict(compression=hvd_ext.compression.registry()["none"]), "pass an instance"),
        (dict(backward_passes_per_step=0), "backward_passes_per_step"),
        (dict(backward_passes_per_step=1.5), "backward_passes_per_step"),
        (dict(op="mean"), "op must be one of"),
        (dict(gradient_predivide_factor=0), "gradient_predivide_factor"),
        (dict(gradient_predivide_factor=2.0, op=hvd.Sum), "op != Average"),
        (dict(bucket_bytes=0), "bucket_bytes"),
        (dict(compression="randomk", op=hvd.Adasum), "Adasum"),
    ]
    for kw, fragment in cases:
        with pytest.raises(ValueError) as e:
            make(**kw)
        assert fragment in str(e.value), (kw, str(e.value))
    with pytest.raises(ValueError, match="torch.optim.Optimizer"):
        hvd_ext.DistributedOptimizer(object())
