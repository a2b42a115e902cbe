"""docs/extending.md's worked example, exactly as written there, through the real pipeline at N = 3.

The first ```python block under the heading "## Worked example: absmax" is executed in a fresh
module (registering the codec ``absmax``); the fixture removes it from the registry afterwards, so
tests that walk ``list_compressors()`` never see it."""
import math
import re
import sys
import types

import pytest
import torch

from hvd_ext.compression import base as comp_base
from hvd_ext.compression.base import TensorInfo
from hvd_ext.exchange.core import frame_size
from hvd_ext.spec import compression_from_spec, describe_compressors, list_compressors
from hvd_ext.testing.harness import run_pipeline

from conftest import ROOT

DOC = ROOT / "docs" / "extending.md"
HEADING = "## Worked example: absmax"
NAME = "absmax"
SIZE = 3
# odd sizes: payloads not multiples of 4 bytes, a single element, a 3-d tensor
SHAPES = {"w1": (37, 29), "b1": (37,), "w2": (5, 7, 3), "one": (1,), "odd": (1001,)}


def example_source() -> str:
    text = DOC.read_text()
    assert text.count(HEADING) == 1, f"{DOC.name}: expected one heading {HEADING!r}"
    after = text.split(HEADING, 1)[1]
    m = re.search(r"^```python\n(.*?)^```", after, re.S | re.M)
    assert m, f"{DOC.name}: no ```python block after {HEADING!r}"
    return m.group(1)


@pytest.fixture(scope="module")
def codec():
    assert NAME not in comp_base.registry(), f"{NAME!r} is already registered; the example would clash"
    mod = types.ModuleType("hvd_ext_docs_extending_example")
    mod.__file__ = str(DOC)
    sys.modules[mod.__name__] = mod
    try:
        exec(compile(example_source(), str(DOC), "exec"), mod.__dict__)
        yield comp_base.registry()[NAME]
    finally:
        comp_base._REGISTRY.pop(NAME, None)
        sys.modules.pop(mod.__name__, None)
    assert NAME not in list_compressors()


def make_grads(steps, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [[{k: torch.randn(*s, generator=g) * (1 + r) for k, s in SHAPES.items()} for r in range(SIZE)]
            for _ in range(steps)]


def expected_payload(numel, bits):  # the docstring's formula, computed independently of the codec
    return 4 + math.ceil(numel * bits / 8) if numel else 0


def test_example_registers_and_builds_from_a_spec(codec):
    comp = compression_from_spec(f"{NAME}:bits=5")
    assert isinstance(comp, codec) and comp.bits == 5 and comp.levels == 15
    assert comp.collective == "allgather" and comp.feedback.name == "residual"
    assert comp.spec() == f"{NAME}:bits=5"
    assert NAME in list_compressors() and describe_compressors()[NAME]["options"]["bits"][0] == 8
    x = torch.randn(123)
    info = TensorInfo(name="x", shape=x.shape)
    payload, ctx = comp.compress(x, info)
    assert payload.dtype == torch.uint8 and payload.numel() == comp.payload_size(info) == expected_payload(123, 5)
    s = float(x.abs().max())
    assert float((comp.decode(payload, ctx, info) - x).abs().max()) <= s / (2 * comp.levels) * (1 + 1e-5)
    zero_payload, _ = comp.compress(torch.zeros(9), TensorInfo(name="z", shape=torch.Size([9])))
    assert torch.equal(comp.decode(zero_payload, None, TensorInfo(name="z", shape=torch.Size([9]))), torch.zeros(9))


@pytest.mark.parametrize("bad", ["bits=1", "bits=9", "bits=four", "bits=2.5"])
def test_bad_option_value_names_the_key(codec, bad):
    with pytest.raises(ValueError, match=r"'bits'.*2 <= bits <= 8"):
        compression_from_spec(f"{NAME}:{bad}")


def test_example_through_the_pipeline_at_three_ranks(codec):
    bits, steps, nan_step = 6, 5, 3
    L = 2 ** (bits - 1) - 1
    grads = make_grads(steps, seed=1)
    grads[nan_step][1]["w1"][3, 4] = float("nan")  # one rank, one step
    memory_before = {}  # (rank, step) -> residual memory before the step (what compensate adds)

    def before(rank, step, pipe):
        memory_before[rank, step] = {k: v.clone() for k, v in pipe.feedback.memory.items()}

    runs = run_pipeline(f"{NAME}:bits={bits},feedback=residual,route=allgather", grads, SIZE,
                        before_step=before)
    ref = runs[0]

    # a NaN on one rank skips that step on every rank
    want_skipped = [s == nan_step for s in range(steps)]
    assert [r.skipped for r in runs] == [want_skipped] * SIZE
    assert all(r.routes == ["allgather"] * len(r.routes) for r in runs)

    for step in range(steps):
        # received bytes: the frames of the other N-1 ranks, each holding the declared payload sizes
        frames = sum(frame_size([expected_payload(math.prod(SHAPES[n]), bits) for n in b.names])
                     for b in ref.pipeline.buckets)
        assert [r.received[step] for r in runs] == [(SIZE - 1) * frames] * SIZE
        if want_skipped[step]:
            continue
        for name in SHAPES:
            got = ref.results[step][name]
            for r in runs[1:]:  # every rank the same bits
                assert torch.equal(r.results[step][name], got), (step, name)
            # each rank sent u = g + memory quantized within max|u| / (2L); the result is their mean
            us = [grads[step][r][name] + memory_before[r, step].get(name, 0) for r in range(SIZE)]
            mean_u = sum(us) / SIZE
            bound = sum(float(u.abs().max()) for u in us) / (2 * L * SIZE)
            err = float((got - mean_u).abs().max())
            assert err <= bound * (1 + 1e-4) + 1e-6, (step, name, err, bound)
            if step == 0:  # no memory yet: within that bound of the true average
                true_mean = sum(grads[0][r][name] for r in range(SIZE)) / SIZE
                assert float((got - true_mean).abs().max()) <= bound * (1 + 1e-4) + 1e-6

    # error feedback conserves the gradient: applied updates + what the ranks still remember
    # equal the sum of the true averages over the steps that were not skipped
    for name in SHAPES:
        applied = sum(ref.results[s][name] for s in range(steps) if not want_skipped[s])
        total = sum(grads[s][r][name] for s in range(steps) if not want_skipped[s] for r in range(SIZE)) / SIZE
        remembered = sum(r.pipeline.feedback.memory[name] for r in runs) / SIZE
        assert torch.allclose(applied + remembered, total, atol=1e-4), name
    # the skipped step left every memory as it was
    for r in range(SIZE):
        for k, v in memory_before[r, nan_step].items():
            assert torch.equal(memory_before[r, nan_step + 1][k], v)


def test_example_on_the_two_phase_route(codec):
    """The default ``recompress`` (= compress) lets the shard owners re-encode the average."""
    grads = make_grads(2, seed=2)
    runs = run_pipeline(f"{NAME}:bits=8,route=twophase", grads, SIZE)
    for step in range(2):
        for name in SHAPES:
            got = runs[0].results[step][name]
            assert all(torch.equal(r.results[step][name], got) for r in runs[1:])
        if step == 0:
            for name in SHAPES:
                true_mean = sum(grads[0][r][name] for r in range(SIZE)) / SIZE
                rel = float((runs[0].results[0][name] - true_mean).norm() / true_mean.norm())
                assert rel < 0.05, (name, rel)
