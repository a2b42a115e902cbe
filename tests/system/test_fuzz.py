"""Property-based fuzzing of every public entry point: spec strings, optimizer and
sync arguments. Bad input raises ValueError naming what is accepted -- never another exception
type, never a hang. In process, one rank (no launches)."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import hvd_ext
from hvd_ext.spec import list_compressors

COMPRESSORS = sorted(list_compressors())
SYNCS = ["every", "local", "adaptive", "event"]
KEYS = ["ratio", "bits", "levels", "bucket", "feedback", "beta", "lambda", "rate", "mode", "values", "scope",
        "sample", "seed", "shared", "tau", "rank", "warm_start", "min_compression", "start_step", "clip",
        "momentum", "split", "alpha", "eps", "norm", "dist", "budget", "chunk", "stochastic", "exchange",
        "period", "warmup", "min", "max", "delta_lo", "delta_hi", "sigma", "rho", "tau_min", "tau_max",
        "staleness", "gamma", "progress", "sync_buffers", "sync_momentum", "route", "hierarchy", "variance",
        "variance_warmup", "ramp_steps", "warmup_steps", "nope", ""]
NUMBERS = st.one_of(st.integers(-10**30, 10**30).map(str), st.floats(allow_nan=True, allow_infinity=True).map(repr),
                    st.sampled_from(["nan", "inf", "-inf", "1e309", "0x10", "1_000", "", " ", "true", "no",
                                     "exact", "fp16", "residual", "ewma", "l2", "mass", "loss", "é", "１"]))
VALUE = st.one_of(NUMBERS, st.text(max_size=8))
PAIR = st.tuples(st.one_of(st.sampled_from(KEYS), st.text(max_size=6)), VALUE)


def spec_strings(names):
    structured = st.builds(lambda n, kv, sep: n + (":" + sep.join(f"{k}={v}" for k, v in kv) if kv else ""),
                           st.one_of(st.sampled_from(names), st.text(max_size=6)), st.lists(PAIR, max_size=4),
                           st.sampled_from([",", ", ", ",,", ";"]))
    return st.one_of(structured, st.text(max_size=40))


def _accepts(msg: str) -> bool:
    """The message says what is accepted (syntax errors: the form, or 'given twice')."""
    low = msg.lower()
    return any(w in low for w in ("accepted", "accepts", "expected", "must be", "of the form key=value", "given twice"))


FAST = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FAST
@given(spec_strings(COMPRESSORS))
def test_compression_from_spec_only_valueerror(spec):
    try:
        comp = hvd_ext.compression_from_spec(spec)
    except ValueError as e:
        assert _accepts(str(e)), (spec, str(e))
        return
    # accepted: the spec round-trips to a compressor of the named kind
    assert comp.name in COMPRESSORS
    assert hvd_ext.compression_from_spec(comp.spec()).spec() == comp.spec()


@FAST
@given(spec_strings(SYNCS))
def test_sync_from_spec_only_valueerror(spec):
    try:
        factory = hvd_ext.sync_from_spec(spec)
    except ValueError as e:
        assert _accepts(str(e)), (spec, str(e))
        return
    assert factory.name in SYNCS
    assert hvd_ext.sync_from_spec(factory.spec()).spec() == factory.spec()


def test_duplicate_and_empty_specs_named():
    for bad in ["", ":", "topk:ratio=0.1,ratio=0.2", "topk:ratio", "topk:=1"]:
        with pytest.raises(ValueError) as ei:
            hvd_ext.compression_from_spec(bad)
        assert _accepts(str(ei.value)), (bad, str(ei.value))
    for bad in ["local:period=2,period=3", "local:period=nan", "local:period=-1", "adaptive:min=4,max=2",
                "local:warmup=1e400", "event:staleness=é", "nope"]:
        with pytest.raises(ValueError) as ei:
            hvd_ext.sync_from_spec(bad)
        assert _accepts(str(ei.value)), (bad, str(ei.value))


# ---- DistributedOptimizer and sync constructors: one rank, real Horovod ------------------------
@pytest.fixture(scope="module")
def hvd1():
    import horovod.torch as hvd

    hvd.init()
    return hvd


ARG = st.one_of(st.none(), st.booleans(), st.integers(-5, 10**12), st.floats(allow_nan=True), st.text(max_size=5),
                st.lists(st.integers(), max_size=2), st.just(object()))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(bpps=ARG, predivide=ARG, bucket=ARG, compression=st.one_of(ARG, spec_strings(COMPRESSORS)),
       op=st.one_of(ARG, st.sampled_from(["average", "sum"])))
def test_distributed_optimizer_args_only_valueerror(hvd1, bpps, predivide, bucket, compression, op):
    model = torch.nn.Linear(3, 2)
    kw = {"backward_passes_per_step": bpps, "gradient_predivide_factor": predivide, "bucket_bytes": bucket,
          "compression": compression, "op": op}
    kw = {k: v for k, v in kw.items() if v is not None or k == "compression"}
    try:
        opt = hvd_ext.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                           named_parameters=model.named_parameters(), **kw)
    except ValueError as e:
        assert _accepts(str(e)) or "not supported with op" in str(e), (kw, str(e))
        return
    model(torch.randn(2, 3)).sum().backward()
    opt.step()
    assert all(torch.isfinite(p).all() for p in model.parameters()) or not math.isfinite(float(predivide or 1))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(name=st.sampled_from(["local", "adaptive"]),
       args=st.dictionaries(st.sampled_from(["period", "warmup", "warmup_steps", "sync_buffers", "sync_momentum", "min_period",
                                             "max_period", "delta_lo", "delta_hi", "bogus"]), ARG, max_size=3))
def test_sync_constructor_args_only_valueerror(hvd1, name, args):
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cls = {"local": hvd_ext.LocalSGD, "adaptive": hvd_ext.AdaptiveSync}[name]
    try:
        sync = cls(opt, model, **args)
    except ValueError as e:
        assert _accepts(str(e)), (args, str(e))
        return
    except TypeError as e:  # an unknown keyword is Python's TypeError, as for any function
        assert "bogus" in str(e) or "unexpected keyword" in str(e)
        return
    model(torch.randn(2, 3)).sum().backward()
    sync.step()
    sync.finish()
