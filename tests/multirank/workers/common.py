"""Helpers for worker scripts launched by the tests."""
import json
import sys


def emit(**kw):
    """Print one RESULT line that tests.conftest.launch collects."""
    print("RESULT " + json.dumps(kw), flush=True)
    sys.stdout.flush()


def exchanged_steps(m, opt, make_model, rank, steps):
    """Train ``m`` (inputs 16 x 20, 5 classes) for ``steps`` steps through ``opt``. Returns per step
    the raw local gradients (recomputed on a copy of the model before the exchange overwrites
    them), the exchanged gradients and the bytes this rank received."""
    import torch
    import torch.nn.functional as F

    raw, real, recv = [], [], []
    for step in range(steps):
        g = torch.Generator().manual_seed(100 * rank + step)
        x, y = torch.randn(16, 20, generator=g), torch.randint(0, 5, (16,), generator=g)
        opt.zero_grad()
        F.cross_entropy(m(x), y).backward()
        m2 = make_model()
        m2.load_state_dict(m.state_dict())
        F.cross_entropy(m2(x), y).backward()
        raw.append({n: p.grad.detach().clone() for n, p in m2.named_parameters()})
        opt.step()
        real.append({n: p.grad.detach().clone() for n, p in m.named_parameters()})
        recv.append(opt.stats.last["bytes_received"])
    return raw, real, recv
