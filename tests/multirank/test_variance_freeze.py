"""Adam + topk with a dense warm-up and a frozen second moment on 2 real Horovod ranks
(tests/multirank/workers/variance_checks.py, which checks each rank in-process)."""
from __future__ import annotations

from helpers.checks import assert_checks


def test_two_ranks_adam_topk_warmup_freeze_checkpoint_and_resume_recipe():
    """Real Horovod, 2 ranks, Adam + topk with a 3-exchange warm-up: the warm-up exchanges are the
    exact mean, the later ones are not (compressed); the second moment then stays frozen; ranks
    stay identical; the checkpoint (with the frozen moment) resumes bit for bit, and Horovod's
    resume recipe (rank 0 loads, broadcast) keeps the ranks identical."""
    from conftest import launch

    res = launch("variance_checks.py", np=2, timeout=240)
    assert_checks(res)
    for r in res:
        assert len(r["checks"]) == 8, sorted(r["checks"])
