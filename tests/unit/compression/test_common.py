"""hvd_ext.compression.common: the options every codec takes, parsed once, with their old spellings."""
import pytest
import torch

import hvd_ext
from hvd_ext.compression import Compressor, register, registry
from hvd_ext.compression.common import COMMON_ALIASES, COMMON_OPTIONS
from hvd_ext.variance_freeze import VarianceFreeze

C = hvd_ext.compression_from_spec


def test_no_codec_declares_the_common_options_and_every_codec_takes_them():
    for name, cls in registry().items():
        assert not set(cls.options) & set(COMMON_OPTIONS), name
        comp = C(f"{name}:hierarchy=flat,hierarchy_trial=0,variance=live,warmup=4")
        assert (comp.hierarchy, comp.hierarchy_trial, comp.variance, comp.warmup) == ("flat", 0, "live", 4), name
        assert comp.warmup_length() == 4 and comp.warmup_length(frozen_moment=True) == 4
    with pytest.raises(RuntimeError, match="every codec takes these"):
        @register("declares_warmup")
        class _Bad(Compressor):
            options = {"warmup": COMMON_OPTIONS["warmup"]}


@pytest.mark.parametrize("old,new", [
    ("qsgd:bits=8,exchange=twophase", "qsgd:bits=8,route=twophase"),
    ("topk:variance_warmup=7", "topk:warmup=7"),
    ("powersgd:rank=2,start_step=3", "powersgd:rank=2,warmup=3"),
    ("dgc:ratio=0.001,warmup_steps=250,warmup_stages=2", "dgc:ratio=0.001,ramp_steps=250,ramp_stages=2"),
])
def test_old_keys_build_the_same_codec_and_print_the_new_name(old, new):
    assert C(old).spec() == C(new).spec() == new


@pytest.mark.parametrize("spec,words", [
    ("topk:warmup=3,variance_warmup=3", "'warmup' given twice"),
    ("powersgd:warmup=3,start_step=3", "'warmup' given twice"),
    ("topk:variance_warmup=-1", "bad value '-1' for 'variance_warmup'"),  # named as the user wrote it
    ("topk:warmup=-1", "bad value '-1' for 'warmup'"),
    ("fp16:route=twophase", "rides on allreduce; accepted: auto"),
    ("randomk:shared=1,route=allgather", "rides on allreduce"),
    ("topk:route=ring", "'route'"),
    ("topk:wormup=3", "accepted: .*warmup"),  # the unknown-key message lists the common keys too
])
def test_bad_common_values_are_named(spec, words):
    with pytest.raises(ValueError, match=words):
        C(spec)


@pytest.mark.parametrize("spec,plain,frozen", [
    ("topk", 0, 0),
    ("qsgd", 0, 0),
    ("powersgd", 100, 100),   # DDP's start_powerSGD_iter
    ("efsignsgd", 0, 200),    # 1-bit Adam's warm-up, only where the second moment is frozen
    ("onebit", 0, 200),
    ("randomk", 0, 10),
    ("auto", 5, 5),           # dense exchanges before auto's first decision
    ("auto:warmup=9", 9, 9),
    ("efsignsgd:warmup=0", 0, 0),
])
def test_default_warmup_per_codec(spec, plain, frozen):
    comp = C(spec)
    assert comp.warmup_length() == plain and comp.warmup_length(frozen_moment=True) == frozen


def test_auto_takes_variance_and_warmup_but_not_the_route_keys():
    assert C("auto:variance_warmup=4").warmup == 4
    with pytest.raises(ValueError, match="int >= 2"):
        C("auto:warmup=1")
    for key in ("route=twophase", "hierarchy=flat"):
        with pytest.raises(ValueError, match="unknown key"):
            C(f"auto:{key}")


def test_the_freeze_starts_when_the_warmup_ends():
    p = torch.nn.Parameter(torch.zeros(3))
    with pytest.warns(UserWarning):
        vf = VarianceFreeze.for_optimizer(torch.optim.Adam([p]), C("powersgd"), {p: "p"})
    assert vf.warmup == 100
    with pytest.warns(UserWarning):
        vf = VarianceFreeze.for_optimizer(torch.optim.Adam([p]), C("efsignsgd"), {p: "p"})
    assert vf.warmup == 200


def test_aliases_point_at_common_keys():
    assert set(COMMON_ALIASES.values()) <= set(COMMON_OPTIONS)
    for name, cls in registry().items():
        assert set(cls.aliases.values()) <= set(cls.options) | set(COMMON_OPTIONS), name
