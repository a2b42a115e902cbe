"""hvd_ext.sync.adaptive: the adaptive period rule and the momentum divergence."""
import math

import torch

from hvd_ext.sync import momentum_divergence, next_period


def test_adaptive_rule():
    assert next_period(8, 0.9, 0.2, 0.5, 1, 32) == 4
    assert next_period(1, 0.9, 0.2, 0.5, 1, 32) == 1
    assert next_period(3, 0.9, 0.2, 0.5, 2, 32) == 2
    assert next_period(8, 0.1, 0.2, 0.5, 1, 32) == 9
    assert next_period(32, 0.1, 0.2, 0.5, 1, 32) == 32
    assert next_period(8, 0.3, 0.2, 0.5, 1, 32) == 8
    assert next_period(8, float("nan"), 0.2, 0.5, 1, 32) == 4
    assert momentum_divergence(torch.ones(4), torch.ones(4)) == 0.0
    assert math.isclose(momentum_divergence(torch.tensor([3.0, 0]), torch.tensor([1.0, 0])), 2.0)
