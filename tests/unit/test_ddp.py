"""hvd_ext.ddp on a one-process Gloo group: what the hook says at construction."""
import warnings

import pytest
import torch
import torch.distributed as dist

from hvd_ext import ddp


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    made = not dist.is_initialized()
    if made:
        store = tmp_path_factory.mktemp("gloo") / "store"
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    yield
    if made:
        dist.destroy_process_group()


@pytest.mark.parametrize("spec", ["dgc", "topk:ratio=0.01,feedback=dgc_momentum", "signum"])
def test_a_codec_applying_momentum_itself_warns_to_zero_the_optimizers(one_rank, spec):
    with pytest.warns(UserWarning, match="momentum=0"):
        ddp.HookState(spec)


@pytest.mark.parametrize("spec", ["dgc:momentum=0", "signum:beta=0", "topk:ratio=0.01", "qsgd:bits=8", "auto"])
def test_a_codec_without_its_own_momentum_says_nothing(one_rank, spec):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ddp.HookState(spec)


def optimizer(kind, momentum):
    p = [torch.nn.Parameter(torch.zeros(2))]
    return torch.optim.SGD(p, lr=0.1, momentum=momentum) if kind == "sgd" else torch.optim.Adam(p, betas=(momentum, 0.99))


@pytest.mark.parametrize("spec", ["dgc", "signum"])
def test_given_the_optimizer_momentum_twice_raises_and_momentum_zero_passes(one_rank, spec):
    for kind in ("sgd", "adam"):
        with pytest.raises(ValueError, match="would apply twice.*momentum=0"):
            ddp.HookState(spec, optimizer=optimizer(kind, 0.9))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ddp.HookState(spec, optimizer=optimizer("sgd", 0.0))


@pytest.mark.parametrize("bad", ["sgd", 0.9, object()])
def test_an_optimizer_that_is_not_one_is_refused_naming_what_is_accepted(one_rank, bad):
    with pytest.raises(ValueError, match="accepted: None or a torch.optim.Optimizer"):
        ddp.HookState("qsgd:bits=8", optimizer=bad)
