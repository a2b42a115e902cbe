"""hvd_ext.feedback.base: which memory entries a rank resuming behind the others takes from the most
advanced one (shared state, velocities) and which stay its own (error memories)."""
import pytest
import torch

from hvd_ext.feedback.base import SEP
from hvd_ext.spec import make_feedback
from hvd_ext.testing.harness import run_pipeline


def test_shared_state_moves_and_own_memory_stays():
    root, lag = make_feedback("residual"), make_feedback("residual")
    root.memory = {"w": torch.ones(3), "w" + SEP + "residual_m": torch.full((3,), 2.0)}
    lag.memory = {"w": torch.full((3,), 5.0), "v": torch.zeros(2)}
    shared = root.shared_state_dict()
    assert set(shared["memory"]) == {"w" + SEP + "residual_m"}
    lag.load_shared_state_dict(shared)
    assert torch.equal(lag.memory["w"], torch.full((3,), 5.0))  # this rank's residual is its own
    assert torch.equal(lag.memory["w" + SEP + "residual_m"], torch.full((3,), 2.0))
    assert set(lag.memory) == {"w", "v", "w" + SEP + "residual_m"}


def test_an_error_memory_offered_as_shared_is_not_taken():
    lag = make_feedback("dgc_momentum")
    lag.memory = {"w" + SEP + "dgc_v": torch.ones(3)}
    lag.load_shared_state_dict({"memory": {"w" + SEP + "dgc_v": torch.full((3,), 9.0),
                                           "w" + SEP + "dgc_u": torch.full((3,), 2.0)}})
    assert torch.equal(lag.memory["w" + SEP + "dgc_v"], torch.ones(3))
    assert torch.equal(lag.memory["w" + SEP + "dgc_u"], torch.full((3,), 2.0))


def _grads(steps=4, size=2):
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(steps):
        per = []
        for _ in range(size):
            w = torch.randn(64, generator=g)
            w[:8] *= 50   # the first coordinates dominate every selection: sparse reduce-scatter rebalances
            per.append({"w": w, "b": torch.randn(8, generator=g)})
        out.append(per)
    return out


# spec -> the memory entries of tensor "w" that are rank-shared (every other entry is an error memory)
CASES = {
    "topk:ratio=0.25,feedback=residual,momentum=0.9": {"residual_u"},
    "topk:ratio=0.25,feedback=residual,momentum=0.9,velocity=exchanged": {"residual_m", "residual_t"},
    "topk:ratio=0.25,feedback=ewma,momentum=0.9": {"ewma_S", "ewma_age", "ewma_u"},
    "dgc:ratio=0.25": {"dgc_u"},
}


@pytest.mark.parametrize("spec", sorted(CASES))
def test_after_real_steps_only_shared_entries_travel(spec):
    run = run_pipeline(spec, _grads(), size=2, route="allgather")[0]
    fb = run.pipeline.feedback
    of_w = {k[len("w" + SEP):] for k in fb.memory if k.startswith("w" + SEP)}
    shared = {k[len("w" + SEP):] for k in fb.shared_state_dict()["memory"] if k.startswith("w" + SEP)}
    assert shared == CASES[spec] & of_w and shared, (of_w, shared)
    errors = set(fb.memory) - set(fb.shared_state_dict()["memory"])
    assert "w" in errors or "w" + SEP + "dgc_v" in errors, errors   # each rank keeps what it has not sent


def test_a_rank_resuming_behind_takes_the_owner_ranges_not_the_owner_residual():
    root = run_pipeline("topk:ratio=0.1", _grads(16), size=2, route="twophase")[0].pipeline
    bounds = {k: v for k, v in root.owner_memory.memory.items() if k.endswith(":bounds")}
    assert bounds and any(int(v[1]) != 36 for v in bounds.values()), root.owner_memory.memory  # moved
    lag = run_pipeline("topk:ratio=0.1", _grads(1), size=2, route="twophase")[1].pipeline
    own = {k: v.clone() for k, v in lag.owner_memory.memory.items() if not k.endswith(":bounds")}
    lag.load_shared_state_dict(root.shared_state_dict())
    assert lag.step == root.step
    for k, v in bounds.items():
        assert torch.equal(lag.owner_memory.memory[k], v)
    for k, v in own.items():
        assert torch.equal(lag.owner_memory.memory[k], v)


def test_the_taken_momentum_travels_with_the_shared_state():
    """What a feedback took over from the optimizer is every rank's: a rank resuming behind takes it."""
    import warnings

    fb = make_feedback("dgc_momentum")
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(3))], lr=0.1, momentum=0.8, weight_decay=1e-4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fb.bind_optimizer(opt)
    lag = make_feedback("dgc_momentum")
    lag.load_shared_state_dict(fb.shared_state_dict())
    assert float(lag.memory[SEP + "taken_momentum"]) == 0.8 and lag.momentum == 0.8
    assert float(lag.memory[SEP + "taken_weight_decay"]) == 1e-4
