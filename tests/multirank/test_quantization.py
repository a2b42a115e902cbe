"""Quantization and low-rank codecs through Horovod on 2 ranks: sign vote, PowerSGD, qdist.
The checks run on each rank (tests/multirank/workers/sign_vote.py)."""
from helpers.checks import assert_checks


def test_two_ranks_vote_powersgd_qdist(run_ranks):
    res = run_ranks("sign_vote.py", np=2)
    assert_checks(res)
    for r in res:
        for sec in ("signsgd", "powersgd", "qdist"):
            assert any(n.startswith(sec + ":") for n in r["checks"]), sec
