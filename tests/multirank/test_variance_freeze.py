"""Adam + topk with a dense warm-up and a frozen second moment on 2 real Horovod ranks
(tests/multirank/workers/variance_checks.py)."""
from __future__ import annotations


def test_two_ranks_adam_topk_warmup_freeze_checkpoint_and_resume_recipe():
    """Real Horovod, 2 ranks, Adam + topk with a 3-exchange warm-up: the warm-up exchanges are the
    exact mean, the later ones are not (compressed); the second moment then stays frozen; ranks
    stay identical; the checkpoint (with the frozen moment) resumes bit for bit, and Horovod's
    resume recipe (rank 0 loads, broadcast) keeps the ranks identical."""
    from conftest import launch

    res = launch("variance_checks.py", np=2, timeout=240)
    for r in res:
        assert r["warned"]
        assert r["exact"][:3] == [True, True, True]
        assert not any(r["exact"][3:]), r["exact"]
        assert r["recv"][3] < 0.5 * r["recv"][0]  # compressed after the warm-up
        assert r["never_lower"] and r["unchanged"] > 0.5, r
        assert r["has_variance"] and r["resumed_equal"]
        assert r["spread_main"] == 0.0 and r["spread_recipe"] == 0.0
        assert r["finite"]
