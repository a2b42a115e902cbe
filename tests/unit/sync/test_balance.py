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
    assert plan_steps(period, seconds, remaining)[0] == plan


def test_plan_steps_carries_fractions_so_steps_follow_speed():
    carry, taken = None, [0, 0]
    for _ in range(25):   # rank 0 is 2.28x as fast: 2.28 steps per round on average, never 2 forever
        plan, carry = plan_steps(1, [1.0, 2.28], None, carry)
        taken = [t + h for t, h in zip(taken, plan)]
    assert taken[1] == 25 and abs(taken[0] - 2.28 * 25) < 1.0, taken
    assert plan_steps(4, [0.1, 0.2], 6, [0.9, 0.0])[1] == [0.0, 0.0]   # the last round carries nothing
    assert plan_steps(4, [0.1, 0.2], None, [0.5])[0] == [8, 4]         # a carry of another world: ignored


def test_plan_steps_ends_near_the_budget():
    for remaining in range(2, 60):
        for sec in ([0.1, 0.25], [0.1, 0.1, 0.3], [0.05, 0.2, 0.2, 0.4]):
            full, plan = plan_steps(16, sec)[0], plan_steps(16, sec, remaining)[0]
            assert all(h >= 1 for h in plan)
            if sum(full) > remaining:   # cut: never short of the budget (no extra round), at most n-1 over
                assert remaining <= sum(plan) <= remaining + len(plan) - 1, (remaining, sec, plan)
                if min(plan) > 1:
                    assert sum(plan) == remaining, (remaining, sec, plan)
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
    clock = RoundClock(torch.device("cpu"), window=3)
    clock.stop()
    clock.lap(2)
    assert math.isnan(clock.seconds()) and clock.per_step() == 0.0   # never started: nothing timed
    clock.start()
    assert math.isnan(clock.seconds())                              # no stop yet
    time.sleep(0.02)
    clock.stop()
    assert 0.015 < clock.seconds() < 1.0
    clock.lap(2)
    assert 0.0075 < clock.per_step() < 0.5
    clock.start()
    assert math.isnan(clock.seconds())
    clock.laps.clear()
    clock.laps.extend([0.01, 5.0, 0.012])      # one slow round (an evaluation): the median ignores it
    assert clock.per_step() == 0.012
    clock.laps.append(0.011)                    # a window of 3: the oldest drops out
    assert list(clock.laps) == [5.0, 0.012, 0.011] and clock.per_step() == 0.012


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
