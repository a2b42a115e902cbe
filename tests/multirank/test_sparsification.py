"""Sparsifying codecs through Horovod on 2 ranks: the ranks agree bit for bit. The checks run on
each rank (tests/multirank/workers/sparse_agree.py)."""
from helpers.checks import assert_checks

SPECS = ["topk:ratio=0.01,scope=layer", "topk:ratio=0.01,mode=sampled,values=fp16,scope=layer",
         "topk:ratio=0.02,scope=model,feedback=ewma,lambda=0.5", "threshold:tau=0.002",
         "dgc:ratio=0.01,mode=exact,ramp_steps=2,ramp_stages=2,clip=5", "sig:ratio=0.01,alpha=1"]


def test_two_ranks_agree_bit_for_bit(run_ranks):
    res = run_ranks("sparse_agree.py", np=2)
    assert [r["size"] for r in res] == [2, 2]
    assert_checks(res)
    for r in res:
        assert list(r["specs"]) == SPECS
    for spec in SPECS:  # the same sparsity on both ranks
        assert res[0]["specs"][spec]["nonzero"] == res[1]["specs"][spec]["nonzero"], spec
