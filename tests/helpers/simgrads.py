"""Gradient sets for simulated-world tests: ``grads[step][rank][name]`` and their reference mean."""
import torch

SHAPES = {"w1": (60, 50), "b1": (60,), "w2": (7, 60), "b2": (7,)}


def make_grads(size, steps, seed=0, shapes=SHAPES):
    g = torch.Generator().manual_seed(seed)
    return [[{k: torch.randn(*s, generator=g) for k, s in shapes.items()} for _ in range(size)]
            for _ in range(steps)]


def mean_of(grads, step, size):
    return {k: sum(grads[step][r][k] for r in range(size)) / size for k in grads[0][0]}


def relerr(a, b):
    """Squared error of dict ``a`` against ``b``, relative to ``b``'s squared norm."""
    num = sum(float(((a[k] - b[k]) ** 2).sum()) for k in a)
    den = sum(float((b[k] ** 2).sum()) for k in b)
    return num / den
