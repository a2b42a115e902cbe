"""BatchNorm running statistics across ranks: Horovod's gradient averaging leaves them
different on every rank; hvd_ext.sync.average_buffers equalises them, and the parameter-
averaging sync strategies (local, event) end with equal buffers. One MPI launch."""
from conftest import launch


def test_bn_buffers_across_ranks():
    res = launch("sync_buffers_checks.py", np=2, launcher="mpi", timeout=240)
    assert len(res) == 2
    for r in res:
        assert r["param_diff"] == 0.0                # gradients averaged: parameters identical
        assert r["every_spread"] > 0.05              # ... but the BN running stats are not
        assert r["avg_err"] < 1e-6                   # average_buffers = mean of the ranks' buffers
        assert r["every_spread_after"] == 0.0
        assert r["avg_bytes"] == 4 * 2 * 16          # running_mean + running_var (float32), not the int counter
        assert r["local_spread"] == 0.0
        assert r["event_spread_True"] == 0.0 and r["event_param_diff_True"] == 0.0
        assert r["event_spread_False"] > 0.05 and r["event_param_diff_False"] == 0.0
