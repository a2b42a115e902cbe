"""hvd_ext.sync.balance: the speed-proportional step plan, the normalised update and the round clock
(the multi-rank run of ``adaptive:balance=1`` is in tests/multirank/test_sync.py)."""
import math
import time

import pytest
import torch

from hvd_ext.sync import sync_from_spec
from hvd_ext.sync.balance import RoundClock, normalise_updates, plan_steps


@pytest.mark.parametrize("period,seconds,remaining,plan", [
    (4, [0.1, 0.2], None, [8, 4]),            # the slowest rank takes the period, a 2x faster one twice it
    (1, [0.1, 0.2], None, [2, 1]),            # also at H = 1
    (3, [0.1, 0.1, 0.3, 0.15], None, [9, 9, 3, 6]),
    (4, [0.2, 0.2], None, [4, 4]),            # equal speeds: the plain period
    (4, [0.0, 0.2], None, [4, 4]),            # a rank without a measurement: equal
    (4, [math.nan, 0.2], None, [4, 4]),
    (4, [math.inf, 0.2], None, [4, 4]),
    (4, [0.1, 0.2], 6, [4, 2]),               # the last round cut to the batches left
    (4, [0.1, 0.2], 12, [8, 4]),              # enough left: unchanged
    (4, [0.1, 0.2], 1, [1, 1]),               # every rank still takes one step
    (4, [0.1, 0.2], 0, [1, 1]),
])
def test_plan_steps(period, seconds, remaining, plan):
    assert plan_steps(period, seconds, remaining) == plan


def test_plan_steps_ends_near_the_budget():
    for remaining in range(2, 60):
        for sec in ([0.1, 0.25], [0.1, 0.1, 0.3], [0.05, 0.2, 0.2, 0.4]):
            full, plan = plan_steps(16, sec), plan_steps(16, sec, remaining)
            assert all(h >= 1 for h in plan)
            if sum(full) > remaining:   # cut: ends within one step per rank of the budget
                assert abs(sum(plan) - remaining) <= len(plan), (remaining, sec, plan)
            else:
                assert plan == full


def test_normalise_updates():
    start = [torch.tensor([1.0, 2.0]), torch.tensor([[0.0]])]
    params = [torch.tensor([3.0, 0.0]), torch.tensor([[4.0]])]
    normalise_updates(params, start, 0.5)      # x0 + 0.5 (x - x0)
    assert torch.equal(params[0], torch.tensor([2.0, 1.0])) and torch.equal(params[1], torch.tensor([[2.0]]))
    before = [p.clone() for p in params]
    normalise_updates(params, start, 1.0)
    assert all(torch.equal(a, b) for a, b in zip(params, before))


def test_round_clock_on_cpu():
    clock = RoundClock(torch.device("cpu"))
    assert math.isnan(clock.seconds())        # no stop yet
    time.sleep(0.02)
    clock.stop()
    assert 0.015 < clock.seconds() < 1.0
    clock.start()
    assert math.isnan(clock.seconds())


@pytest.mark.parametrize("spec,needle", [
    ("adaptive:normalise=1", "'normalise'"),
    ("adaptive:balance=2", "'balance'"),
])
def test_balance_spec_errors(spec, needle):
    with pytest.raises(ValueError) as e:
        sync_from_spec(spec)
    assert needle in str(e.value)


def test_balance_spec_parses():
    f = sync_from_spec("adaptive:min=1,max=32,balance=1,normalise=1")
    assert f.options == {"min_period": 1, "max_period": 32, "balance": True, "normalise": True}
