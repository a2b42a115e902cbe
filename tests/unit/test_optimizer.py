"""hvd_ext.DistributedOptimizer in one process: arguments checked before any collective; its state
through Horovod elastic's TorchState commit/restore (size 1)."""


import pytest
import torch

import hvd_ext


def test_distributed_optimizer_rejects_bad_arguments_before_any_collective():
    # horovod is imported but NOT initialised: validation must fail first.
    import horovod.torch as hvd

    model = torch.nn.Linear(3, 2)

    def make(**kw):
        return hvd_ext.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                            named_parameters=model.named_parameters(), **kw)

    cases = [
        (dict(compression="nosuch"), "unknown compressor"),
        (dict(compression=42), "unsupported value"),
        (dict(compression=hvd_ext.compression.registry()["none"]), "pass an instance"),
        (dict(backward_passes_per_step=0), "backward_passes_per_step"),
        (dict(backward_passes_per_step=1.5), "backward_passes_per_step"),
        (dict(op="mean"), "op must be one of"),
        (dict(gradient_predivide_factor=0), "gradient_predivide_factor"),
        (dict(gradient_predivide_factor=2.0, op=hvd.Sum), "op != Average"),
        (dict(bucket_bytes=0), "bucket_bytes"),
        (dict(compression="randomk", op=hvd.Adasum), "Adasum"),
    ]
    for kw, fragment in cases:
        with pytest.raises(ValueError) as e:
            make(**kw)
        assert fragment in str(e.value), (kw, str(e.value))
    with pytest.raises(ValueError, match="torch.optim.Optimizer"):
        hvd_ext.DistributedOptimizer(object())


def test_torchstate_commit_restore_carries_hvd_ext_state():
    """hvd.elastic.TorchState saves optimizer.state_dict() on commit and loads it on restore (after a
    failed collective): the pipeline step, worker residuals and compressor state come back with it."""
    import horovod.torch as hvd
    import torch

    import hvd_ext

    hvd.init()
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    opt = hvd_ext.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       named_parameters=model.named_parameters(),
                                       compression="powersgd:rank=1,warmup=0")

    def train_step():
        opt.zero_grad()
        model(torch.randn(16, 8)).pow(2).mean().backward()
        opt.step()

    state = hvd.elastic.TorchState(model=model, optimizer=opt, batch=0)
    train_step()
    state.batch = 1
    state.commit()
    saved = opt.state_dict()["hvd_ext"]
    assert saved["step"] == 1 and saved["feedback"]["memory"] and saved["compressor"]["q_memory"]
    train_step()
    train_step()
    assert opt._pipeline.step == 3
    state.restore()
    now = opt.state_dict()["hvd_ext"]
    assert now["step"] == 1 and state.batch == 1
    for part, key in (("feedback", "memory"), ("compressor", "q_memory")):
        assert now[part][key].keys() == saved[part][key].keys()
        assert all(torch.equal(now[part][key][k], v) for k, v in saved[part][key].items())
    train_step()
    assert opt._pipeline.step == 2


@pytest.mark.parametrize("spec,warmup", [("topk:ratio=0.1,warmup=2", 2), ("topk:ratio=0.1,variance_warmup=2", 2),
                                         ("powersgd:rank=1", 100), ("topk:ratio=0.1", 0)])
def test_the_dense_warmup_runs_under_any_optimizer(spec, warmup):
    """``warmup=N`` (compression.common) sends the first N exchanges dense under SGD too, not only where
    an adaptive optimizer's second moment is frozen; no error-feedback memory is kept during it."""
    import horovod.torch as hvd

    hvd.init()
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    opt = hvd_ext.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                       named_parameters=model.named_parameters(), compression=spec)
    pipe = opt._pipeline
    assert pipe.warmup == warmup and (pipe.warmup_policy is not None) == (warmup > 0)
    for step in range(min(warmup, 3) + 1):
        dense = step < warmup
        assert all(pipe._in_warmup(b.comp) == dense for b in pipe.buckets), step
        opt.zero_grad()
        model(torch.randn(16, 8)).pow(2).mean().backward()
        opt.step()
        assert bool(opt._compression.feedback.memory) == (step >= warmup), step


@pytest.mark.parametrize("spec", ["sig:ratio=0.1,warmup=2", "topk:ratio=0.1,feedback=ewma,warmup=2",
                                  "dgc:ratio=0.1,warmup=2", "signum:warmup=2"])
def test_steps_that_bypass_the_feedback_keep_the_taken_momentum(spec):
    """A feedback that took SGD's momentum and weight decay over (Signum's compressor: the momentum
    only) gives them back to the optimizer for steps that bypass it -- the dense warm-up and the
    gradient exchange switched off (local SGD) -- and takes them over again at the next step through it."""
    import warnings

    import horovod.torch as hvd

    hvd.init()
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt = hvd_ext.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9,
                                                           weight_decay=1e-3),
                                           named_parameters=model.named_parameters(), compression=spec)
    group = opt.param_groups[0]
    held = (0.0, 1e-3) if spec.startswith("signum") else (0.0, 0.0)   # signum leaves the decay to SGD

    def step():
        opt.zero_grad()
        model(torch.randn(16, 8)).pow(2).mean().backward()
        opt.step()
        return group["momentum"], group["weight_decay"]

    assert (group["momentum"], group["weight_decay"]) == (0.9, 1e-3)   # the dense warm-up: the optimizer's
    assert step() == (0.9, 1e-3) and step() == (0.9, 1e-3)
    assert "momentum_buffer" in opt.state[next(model.parameters())]    # torch applied it in the warm-up
    assert step() == held                                               # through the feedback: taken again
    opt.set_gradient_exchange(False)                                    # local steps (LocalSGD)
    assert (group["momentum"], group["weight_decay"]) == (0.9, 1e-3)
    assert "momentum_buffer" not in opt.state[next(model.parameters())]  # the warm-up's, stale: dropped
    assert step() == (0.9, 1e-3)
    group["momentum"] = 0.85                                            # a schedule during the local steps
    opt.set_gradient_exchange(False)                                    # LocalSGD calls it every step: once
    assert step() == (0.85, 1e-3)
    opt.set_gradient_exchange(True)
    assert step() == held


def test_signum_keeps_what_it_took_through_a_checkpoint():
    """An optimizer restored before it is wrapped has momentum 0 already: signSGD takes the momentum it
    took (and its beta) from the checkpoint, and hands it back for bypassed steps."""
    import warnings

    from hvd_ext.spec import compression_from_spec

    p = torch.nn.Parameter(torch.zeros(4))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        first = compression_from_spec("signsgd")
        first.bind_optimizer(torch.optim.SGD([p], lr=0.1, momentum=0.9))
        restored = torch.optim.SGD([p], lr=0.1, momentum=0.0)
        again = compression_from_spec("signsgd")
        again.bind_optimizer(restored)
    assert again.beta == 0.0
    again.load_state_dict(first.state_dict())
    assert again.beta == 0.9
    again.hand_back_momentum()
    assert restored.param_groups[0]["momentum"] == 0.9


def test_nothing_handed_back_that_was_not_taken():
    """An optimizer created with momentum=0 (as the takeover warning advises) keeps momentum 0 and its
    weight decay through the dense warm-up and local steps: the feedback gives back only what it took."""
    import warnings

    import horovod.torch as hvd

    hvd.init()
    model = torch.nn.Linear(8, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt = hvd_ext.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.0,
                                                           weight_decay=5e-4),
                                           named_parameters=model.named_parameters(),
                                           compression="dgc:ratio=0.1,warmup=2")
    group = opt.param_groups[0]
    for exchange in (True, True, True, False, False):
        opt.set_gradient_exchange(exchange)
        opt.zero_grad()
        model(torch.randn(16, 8)).pow(2).mean().backward()
        opt.step()
        assert (group["momentum"], group["weight_decay"]) == (0.0, 5e-4)
