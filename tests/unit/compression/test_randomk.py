"""The randomk codec (hvd_ext.compression.randomk): payload, indices, aggregate."""
import torch

import hvd_ext

from helpers.codecs import info


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
    assert s.collective == "allreduce"
    assert torch.equal(s.indices(info(step=3, rank=0)), s.indices(info(step=3, rank=1)))
    assert len(torch.unique(a)) == len(a) == 50


def test_randomk_aggregate_is_sum_of_decodes():
    c = hvd_ext.compression_from_spec("randomk:ratio=0.2")
    ts = [torch.randn(300) for _ in range(3)]
    datas = [c.compress(t, info(shape=(300,), rank=r))[0] for r, t in enumerate(ts)]
    agg = c.aggregate(datas, None, info(shape=(300,)))
    ref = sum(c.decode(d, None, info(shape=(300,))) for d in datas)
    assert torch.allclose(agg, ref)
