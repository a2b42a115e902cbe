"""hvd_ext.spec: every spec string to a compressor; the registry's names; errors naming the problem."""
import pytest

import hvd_ext


def test_list_compressors_has_foundation_names():
    names = hvd_ext.list_compressors()
    for n in ("none", "fp16", "bf16", "randomk"):
        assert n in names
    assert names == sorted(names)


@pytest.mark.parametrize("spec,fragment", [
    ("nosuch", "unknown compressor 'nosuch'"),
    ("randomk:ratio=0", "0 < ratio <= 1"),
    ("randomk:ratio=1.5", "0 < ratio <= 1"),
    ("randomk:ratio=abc", "expected float"),
    ("randomk:bogus=1", "unknown key(s) 'bogus'"),
    ("randomk:feedback=nosuch", "unknown feedback 'nosuch'"),
    ("randomk:ratio", "not of the form key=value"),
    ("randomk:ratio=0.1,ratio=0.2", "given twice"),
    ("", "empty"),
    ("fp16:ratio=0.1", "accepted: feedback"),
])
def test_bad_specs_raise_value_error_naming_the_problem(spec, fragment):
    with pytest.raises(ValueError) as e:
        hvd_ext.compression_from_spec(spec)
    assert fragment in str(e.value)


def test_bad_spec_lists_accepted_values():
    with pytest.raises(ValueError) as e:
        hvd_ext.compression_from_spec("nosuch")
    for n in ("none", "fp16", "randomk"):
        assert n in str(e.value)


def test_spec_round_trip_and_feedback_default():
    c = hvd_ext.compression_from_spec("randomk:ratio=0.05,seed=3")
    assert c.ratio == 0.05 and c.seed == 3 and c.feedback.name == "residual"
    assert hvd_ext.compression_from_spec(c.spec()).opts == c.opts
    assert hvd_ext.compression_from_spec("randomk:feedback=none").feedback.name == "none"
    assert hvd_ext.compression_from_spec("fp16").feedback.name == "none"
