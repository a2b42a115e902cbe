"""BatchNorm running statistics across ranks: Horovod's gradient averaging leaves them
different on every rank; hvd_ext.sync.average_buffers equalises them, and the parameter-
averaging sync strategies (local, event) end with equal buffers. One MPI launch; each rank checks
its results in-process (tests/multirank/workers/sync_buffers_checks.py)."""
from conftest import launch
from helpers.checks import assert_checks


def test_bn_buffers_across_ranks():
    res = launch("sync_buffers_checks.py", np=2, launcher="mpi", timeout=240)
    assert len(res) == 2
    assert_checks(res)
    for r in res:
        assert len(r["checks"]) == 8, sorted(r["checks"])
