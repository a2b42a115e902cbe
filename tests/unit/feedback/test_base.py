"""hvd_ext.feedback.base: the rank-shared memory entries (a resuming rank takes them; its own stay)."""
import torch

from hvd_ext.feedback.base import SHARED
from hvd_ext.spec import make_feedback

def test_shared_state_moves_and_own_memory_stays():
    root, lag = make_feedback("residual"), make_feedback("residual")
    root.memory = {"w": torch.ones(3), "w" + SHARED + "residual_m": torch.full((3,), 2.0)}
    lag.memory = {"w": torch.full((3,), 5.0), "v": torch.zeros(2)}
    shared = root.shared_state_dict()
    assert set(shared["memory"]) == {"w" + SHARED + "residual_m"}
    lag.load_shared_state_dict(shared)
    assert torch.equal(lag.memory["w"], torch.full((3,), 5.0))  # this rank's residual is its own
    assert torch.equal(lag.memory["w" + SHARED + "residual_m"], torch.full((3,), 2.0))
    assert set(lag.memory) == {"w", "v", "w" + SHARED + "residual_m"}
