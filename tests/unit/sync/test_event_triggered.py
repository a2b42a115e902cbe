"""hvd_ext.sync.event_triggered: the staleness weight and the trigger rule."""
import math

import pytest

from hvd_ext.sync import staleness_weight, trigger


# ---- unit: formulas -----------------------------------------------------------------------
def test_staleness_weight_formula():
    assert staleness_weight("none", 1.0, 1.0, 5.0, 7) == 1.0
    assert staleness_weight("inverse", tau=4) == 0.25
    assert staleness_weight("inverse", tau=0) == 1.0
    assert staleness_weight("loss", 1.0, loss_global=1.0, loss_local=2.0) == 0.5
    assert staleness_weight("loss", 2.0, loss_global=1.0, loss_local=2.0) == 0.25
    assert staleness_weight("loss", 1.0, loss_global=3.0, loss_local=2.0) == 1.0  # min(1, .)
    assert staleness_weight("loss", 0.0, loss_global=1.0, loss_local=4.0) == 1.0  # gamma 0: plain async
    assert math.isclose(staleness_weight("loss", 0.5, 1.0, 4.0), 0.5)
    assert staleness_weight("loss", 1.0, None, 2.0) == 1.0
    assert staleness_weight("loss", 1.0, 1.0, float("nan")) == 1.0
    with pytest.raises(ValueError):
        staleness_weight("bogus")


def test_trigger_rule():
    kw = dict(sigma=0.1, rho=0.5, eps=0.0, tau_min=3, tau_max=6)
    assert trigger(1e9, 1.0, 0, 2, **kw) is None            # never before tau_min
    assert trigger(1e9, 1.0, 0, 3, **kw) == "threshold"
    assert trigger(0.0, 1.0, 0, 5, **kw) is None
    assert trigger(0.0, 1.0, 0, 6, **kw) == "tau_max"       # always by tau_max
    assert trigger(0.09, 1.0, 0, 4, **kw) is None           # 0.09 < 0.1
    assert trigger(0.09, 1.0, 1, 4, **kw) == "threshold"    # decayed: 0.09 > 0.1 * 0.5
    assert trigger(0.09, 1.0, 0, 4, **{**kw, "eps": 0.0}) is None
