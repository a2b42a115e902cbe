"""Sparsifying codecs through Horovod on 2 ranks: the ranks agree bit for bit."""
from hvd_ext.compression._sparse import count_for


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
