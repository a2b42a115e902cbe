"""hvd_ext.world: the per-world state machine (NEW -> CHECKED -> AGREED, back to NEW on a new world),
and under Horovod elastic in one process (size 1): no collective at construction, the check and
agreement at the first exchange, the rebuild after a world change."""
import sys
import types

import pytest

from hvd_ext.world import World, fingerprint_mismatch, same_world, world_of


def test_elastic_defers_collectives_and_rebuilds_in_process(monkeypatch):
    """One process (size 1): under HOROVOD_ELASTIC construction makes no collective; the check and
    the agreement run at the first exchange; after a world change the pipeline is rebuilt with its
    step and worker residuals, and the owner-side memories are dropped."""
    import horovod.torch as hvd
    import torch

    import hvd_ext
    from hvd_ext.exchange import Exchange

    hvd.init()
    calls = []
    real = Exchange.allgather_object

    def counting(self, obj, name):
        calls.append(name)
        return real(self, obj, name)

    monkeypatch.setattr(Exchange, "allgather_object", counting)

    def build(elastic):
        if elastic:
            monkeypatch.setenv("HOROVOD_ELASTIC", "1")
        else:
            monkeypatch.delenv("HOROVOD_ELASTIC", raising=False)
        torch.manual_seed(0)
        model = torch.nn.Linear(8, 4)
        opt = hvd_ext.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                           named_parameters=model.named_parameters(),
                                           compression="topk:ratio=0.25")
        return model, opt

    def train_step(model, opt):
        opt.zero_grad()
        model(torch.randn(16, 8)).pow(2).mean().backward()
        opt.step()

    model, opt = build(elastic=False)
    assert calls == ["hvd_ext.calibration", "hvd_ext.config"]  # not elastic: checked at construction
    calls.clear()
    model, opt = build(elastic=True)
    assert calls == []                            # elastic: nothing at construction
    first = ["hvd_ext.config", "hvd_ext.resume.steps", "hvd_ext.sparse.names"]
    train_step(model, opt)
    assert calls == first
    train_step(model, opt)
    assert calls == first                         # once per world, no per-step cost
    pipe = opt._pipeline
    residual = {k: v.clone() for k, v in pipe.feedback.memory.items()}
    assert residual and pipe.step == 2
    pipe.owner_memory.memory["b0:owner"] = torch.ones(3)
    opt.reset_world()
    opt._before_exchange()
    assert opt._pipeline is not pipe and opt.world_changes == 1
    assert opt._pipeline.step == 2 and opt._pipeline.owner_memory.memory == {}
    assert opt._pipeline.feedback.memory.keys() == residual.keys()
    assert all(torch.equal(opt._pipeline.feedback.memory[k], v) for k, v in residual.items())
    assert calls[3:] == ["hvd_ext.config", "hvd_ext.resume.steps"]
    train_step(model, opt)                        # the sparse-gradient agreement is made again
    assert opt._pipeline.step == 3 and calls[5:] == ["hvd_ext.sparse.names"]

    # LocalSGD: no collective at construction under elastic; checks and agrees at its first step
    calls.clear()
    sync = hvd_ext.LocalSGD(opt, model, period=2)
    assert calls == [] and sync.world_changes == 0

    def train_step_sync():
        opt.zero_grad()
        model(torch.randn(16, 8)).pow(2).mean().backward()
        sync.step()

    train_step_sync()
    assert calls == ["hvd_ext.sync.config", "hvd_ext.sync.resume"]
    train_step_sync()
    assert len(calls) == 2 and sync.syncs == 1


@pytest.mark.parametrize("elastic", [False, True])
def test_a_calibration_file_this_rank_cannot_read_raises_where_the_ranks_compare_files(monkeypatch, tmp_path,
                                                                                      elastic):
    """A fixed-size job compares the files at construction, before pricing: it raises there. Under
    elastic nothing runs at construction: the routes are priced without the file, and the first
    exchange, where the ranks compare their files, raises the file's error."""
    import horovod.torch as hvd
    import torch

    import hvd_ext
    from hvd_ext.exchange import calibration

    hvd.init()
    monkeypatch.setattr(calibration, "_CACHE", {})
    monkeypatch.setenv(calibration.ENV, str(tmp_path / "missing.json"))
    if elastic:
        monkeypatch.setenv("HOROVOD_ELASTIC", "1")
    else:
        monkeypatch.delenv("HOROVOD_ELASTIC", raising=False)
    model = torch.nn.Linear(8, 4)

    def build():
        return hvd_ext.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                            named_parameters=model.named_parameters(), compression="topk:ratio=0.25")

    if not elastic:
        with pytest.raises(calibration.CalibrationError, match="cannot be read"):
            build()
        return
    opt = build()
    model(torch.randn(16, 8)).pow(2).mean().backward()
    with pytest.raises(calibration.CalibrationError, match="cannot be read"):
        opt.step()





class _Ex:
    def __init__(self, size=2, rank=0):
        self.size, self.rank = size, rank


@pytest.fixture
def mpi_ops(monkeypatch):
    """A stand-in for horovod.torch.mpi_ops: its handle table is replaced on every hvd.init()."""
    mod = types.SimpleNamespace(_handle_map={})
    monkeypatch.setitem(sys.modules, "horovod.torch.mpi_ops", mod)
    return mod


def test_fixed_size_job_checks_at_construction_and_agrees_once(mpi_ops, monkeypatch):
    monkeypatch.delenv("HOROVOD_ELASTIC", raising=False)
    w = World(_Ex(), included=True)
    assert not w.elastic and not w.check_due and w.agree_due and w.unsettled()
    w.agree_due = False
    assert not w.unsettled() and not w.moved()
    mpi_ops._handle_map = {}  # a re-initialisation is only followed under elastic
    assert not w.moved()


def test_elastic_job_defers_both_steps_and_repeats_them_in_a_new_world(mpi_ops, monkeypatch):
    monkeypatch.setenv("HOROVOD_ELASTIC", "1")
    ex = _Ex()
    w = World(ex, included=True)
    assert w.elastic and w.check_due and w.agree_due and w.changes == 0
    w.check_due = w.agree_due = False
    assert not w.unsettled() and not w.moved()
    mpi_ops._handle_map = {}  # hvd.init() again: same size, new world
    assert w.moved() and w.unsettled()
    w.enter()
    assert w.changes == 1 and w.check_due and w.agree_due and not w.moved()
    ex.size = 3
    assert w.moved()


def test_rank_outside_the_process_set_has_nothing_due(mpi_ops, monkeypatch):
    monkeypatch.setenv("HOROVOD_ELASTIC", "1")
    w = World(_Ex(), included=False)
    assert not w.elastic and not w.check_due and not w.agree_due


def test_forget_forces_a_new_world(mpi_ops, monkeypatch):
    monkeypatch.delenv("HOROVOD_ELASTIC", raising=False)
    w = World(_Ex(), included=True)
    w.agree_due = False
    w.forget()
    assert w.elastic and w.moved()


def test_same_world_needs_the_same_handle_table(mpi_ops):
    a = world_of(_Ex())
    assert same_world(a, world_of(_Ex()))
    assert not same_world(a, world_of(_Ex(size=3)))
    assert not same_world(None, a)


def test_fingerprint_mismatch_names_the_first_difference():
    ref = {"compression": "topk", "buckets": [["a", "b"], ["c"]]}
    assert fingerprint_mismatch([ref, dict(ref)]) is None
    msg = fingerprint_mismatch([ref, {"compression": "topk", "buckets": [["a", "b"], ["d"]]}])
    assert "buckets" in msg and "entry 1" in msg and "rank 1" in msg


def test_ranks_reading_different_calibrations_are_told_before_the_first_exchange(tmp_path, monkeypatch):
    """A fixed codec's routes follow HVD_EXT_CALIBRATION after the dense warm-up, when no check runs:
    the fingerprint the ranks compare at construction carries the file's content (a copy per rank is
    fine), so a rank without it, or with another file, is named instead of hanging later."""
    import json

    import torch

    from hvd_ext.exchange import calibration
    from hvd_ext.spec import compression_from_spec
    from hvd_ext.world import config_fingerprint

    def fingerprint(cal):
        monkeypatch.setattr(calibration, "_CACHE", {})
        if cal is None:
            monkeypatch.delenv(calibration.ENV, raising=False)
        else:
            path = tmp_path / f"cal{len(list(tmp_path.iterdir()))}.json"
            path.write_text(json.dumps(cal))
            monkeypatch.setenv(calibration.ENV, str(path))
        return config_fingerprint([("w", torch.zeros(3))], compression_from_spec("qsgd:bits=8"), "average", 1,
                                  1.0, 1024, False, [["w"]], ["allreduce"])

    cal = {"version": 1, "ranks": 2, "links": {"flat": {"lat": 1e-4, "bandwidth": 1e8}}}
    ref = fingerprint(cal)
    assert fingerprint_mismatch([ref, fingerprint(dict(cal))]) is None   # another copy of the same file
    for other in (None, {**cal, "ranks": 4}):
        msg = fingerprint_mismatch([ref, fingerprint(other)])
        assert msg is not None and "calibration" in msg, msg
