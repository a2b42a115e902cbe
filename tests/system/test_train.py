"""scripts/train.py's checkpoints, in process (one rank): written atomically, checked on resume."""
from __future__ import annotations

import pytest


# ---- checkpoints of the main job: atomic, checked on resume (in process, one rank) ----------------
def _train_module():
    import importlib.util

    from conftest import ROOT

    spec = importlib.util.spec_from_file_location("hvd_ext_train_script", ROOT / "scripts" / "train.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_checkpoint_atomic_and_checked_on_resume(tmp_path, monkeypatch):
    import horovod.torch as hvd
    import torch

    import hvd_ext

    hvd.init()
    train = _train_module()
    args = train.parse_args(["--compression", "topk:ratio=0.1", "--sync", "local:period=4"])
    model = torch.nn.Sequential(torch.nn.Linear(4, 3))
    opt = hvd_ext.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       named_parameters=model.named_parameters(), compression=args.compression)
    sync = hvd_ext.sync_from_spec(args.sync)(opt, model)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1)
    config = train._run_config(args, model)
    path = tmp_path / "ck.pt"
    train._save_checkpoint(str(path), hvd, 7, model, opt, sched, sync, [], config, 1.0)
    good = path.read_bytes()
    assert train.read_checkpoint(str(path), config, hvd.size())["step"] == 7

    # a crash while writing leaves the previous checkpoint as it was
    def boom(obj, f, *a, **k):
        f.write(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", boom)
    with pytest.raises(OSError):
        train._save_checkpoint(str(path), hvd, 8, model, opt, sched, sync, [], config, 2.0)
    monkeypatch.undo()
    assert path.read_bytes() == good and sorted(p.name for p in tmp_path.iterdir()) == ["ck.pt"]

    # truncated / garbage files: ValueError naming the file
    for name, data in (("trunc.pt", good[: len(good) // 2]), ("junk.pt", b"\x00not a checkpoint" * 10)):
        bad = tmp_path / name
        bad.write_bytes(data)
        with pytest.raises(ValueError, match=f"{name} is unreadable or corrupt"):
            train.read_checkpoint(str(bad), config, hvd.size())
    other = tmp_path / "other.pt"
    torch.save({"weights": 1}, other)
    with pytest.raises(ValueError, match="not a scripts/train.py checkpoint"):
        train.read_checkpoint(str(other), config, hvd.size())

    # written with another method or another model
    with pytest.raises(ValueError, match=r"compression 'topk:ratio=0.1', this run has 'qsgd:bits=8'"):
        train.read_checkpoint(str(path), {**config, "compression": "qsgd:bits=8"}, hvd.size())
    with pytest.raises(ValueError, match=r"sync 'local:period=4', this run has 'every'"):
        train.read_checkpoint(str(path), {**config, "sync": "every"}, hvd.size())
    wider = train._run_config(args, torch.nn.Sequential(torch.nn.Linear(4, 5)))
    with pytest.raises(ValueError, match=r"written with model \('0.weight', \(3, 4\)\), this run has \('0.weight', \(5, 4\)\)"):
        train.read_checkpoint(str(path), wider, hvd.size())
    with pytest.raises(ValueError, match="has 1 ranks, this job 2"):
        train.read_checkpoint(str(path), config, 2)


@pytest.mark.parametrize("argv,needle", [
    (["--sync", "adaptive:balance=1"], "needs --budget global"),
    (["--sync", "local:period=4", "--budget", "global"], "--budget global needs"),
    (["--sync", "adaptive:balance=1", "--budget", "global", "--checkpoint", "c.pt"], "no --checkpoint"),
    (["--sync", "adaptive:normalise=1"], "'normalise'"),
])
def test_budget_and_balance_arguments_refused(argv, needle, capsys):
    train = _train_module()
    with pytest.raises(SystemExit):
        train.parse_args(argv)
    assert needle in capsys.readouterr().err


def test_balanced_adaptive_on_a_global_budget_parses():
    args = _train_module().parse_args(["--sync", "adaptive:balance=1", "--budget", "global"])
    assert args.budget == "global"
