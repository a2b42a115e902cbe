"""hvd_ext.sync's front (sync_from_spec, the strategies' constructors): specs parsed, bad specs and
arguments refused before any communication."""
import pytest
import torch

import hvd_ext
from hvd_ext.sync import sync_from_spec


# ---- unit: specs and arguments ------------------------------------------------------------
@pytest.mark.parametrize("spec,name,opts", [
    ("every", "every", {}),
    ("local:period=8", "local", {"period": 8}),
    ("local:period=8,warmup=100", "local", {"period": 8, "warmup": 100}),
    ("local:period=8,warmup_steps=100", "local", {"period": 8, "warmup": 100}),  # the old key
    ("adaptive:min=1,max=32", "adaptive", {"min_period": 1, "max_period": 32}),
    ("event:sigma=0.01,tau_min=2,tau_max=9,staleness=inverse,gamma=0.5", "event",
     {"sigma": 0.01, "tau_min": 2, "tau_max": 9, "staleness": "inverse", "gamma": 0.5}),
])
def test_spec_parsing(spec, name, opts):
    f = sync_from_spec(spec)
    assert f.name == name and f.options == opts


@pytest.mark.parametrize("spec,needle", [
    ("bogus", "accepted: every, local, adaptive, event"),
    ("local:perod=3", "'perod'"),
    ("local:period=0", "'period'"),
    ("local:period=2.5", "'period'"),
    ("adaptive:min=5,max=2", "'min'"),
    ("adaptive:delta_lo=0.9,delta_hi=0.5", "'delta_lo'"),
    ("event:staleness=foo", "'loss', 'inverse', 'none'"),
    ("event:tau_min=5,tau_max=2", "'tau_max'"),
    ("event:gamma=-1", "'gamma'"),
    ("event:rho=0", "'rho'"),
    ("event:sigma=nan", "'sigma'"),
    ("every:period=3", "'period'"),
    ("local:period", "key=value"),
])
def test_bad_specs_raise_value_error(spec, needle):
    with pytest.raises(ValueError) as e:
        sync_from_spec(spec)
    assert needle in str(e.value)


def test_bad_constructor_arguments_raise_before_communication():
    m = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    cases = [
        (hvd_ext.LocalSGD, dict(period=0), "'period'"),
        (hvd_ext.LocalSGD, dict(warmup=-1), "'warmup'"),
        (hvd_ext.LocalSGD, dict(warmup_steps=-1), "'warmup'"),  # the old name
        (hvd_ext.LocalSGD, dict(warmup=3, warmup_steps=3), "given twice"),
        (hvd_ext.AdaptiveSync, dict(warmup=2, warmup_steps=3), "given twice"),
        (hvd_ext.LocalSGD, dict(period="x"), "'period'"),
        (hvd_ext.LocalSGD, dict(bogus=1), "'bogus'"),
        (hvd_ext.AdaptiveSync, dict(min_period=4, max_period=2), "'min_period'"),
        (hvd_ext.AdaptiveSync, dict(period=40), "'period'"),
        (hvd_ext.AdaptiveSync, dict(delta_lo=1.0, delta_hi=0.5), "'delta_lo'"),
        (hvd_ext.EventTriggeredSGD, dict(staleness="stale"), "'staleness'"),
        (hvd_ext.EventTriggeredSGD, dict(tau_min=0), "'tau_min'"),
        (hvd_ext.EventTriggeredSGD, dict(tau_min=4, tau_max=3), "'tau_max'"),
        (hvd_ext.EventTriggeredSGD, dict(progress="fast"), "'progress'"),
    ]
    for cls, kw, needle in cases:
        with pytest.raises(ValueError) as e:
            cls(opt, m, **kw)
        assert needle in str(e.value), (cls, kw, str(e.value))
    with pytest.raises(ValueError, match="optimizer"):
        hvd_ext.LocalSGD("sgd", m)
    with pytest.raises(ValueError, match="model"):
        hvd_ext.LocalSGD(opt, "model")
    with pytest.raises(ValueError, match="numel"):
        hvd_ext.ParameterServer(0)
