"""hvd_ext.options: spec strings split into key=value options, typed conversion."""
import pytest

from hvd_ext.options import Option, parse_spec


def test_parse_spec_and_option_conversion():
    assert parse_spec(" TopK : ratio=0.1 , feedback=ewma ") == ("topk", {"ratio": "0.1", "feedback": "ewma"})
    opt = Option(int, 1, ">= 1", lambda v: v >= 1)
    assert opt.convert("x", "k", "4") == 4
    with pytest.raises(ValueError):
        opt.convert("x", "k", "2.5")
    with pytest.raises(ValueError):
        opt.convert("x", "k", True)
    b = Option(bool, False)
    assert b.convert("x", "b", "yes") is True and b.convert("x", "b", "0") is False
