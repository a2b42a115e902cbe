"""Signum: signSGD with momentum and majority vote (Bernstein et al. 2018, "signSGD: Compressed
Optimisation for Non-Convex Problems", Algorithm "Signum").

Each rank keeps a momentum ``m <- beta * m + (1 - beta) * g`` per tensor (compressor
state, saved in ``state_dict`` so a checkpoint resumes exactly), sends
``sign(m)`` as one bit per coordinate, and every rank applies the majority vote
``sign(sum_r sign(m_r))`` (times the ranks' mean of ``mean|m| / (1 - beta)``
per ``bucket`` coordinates with ``scale=l1``, the default: see ``signsgd``). The
momentum lives here: a ``torch.optim.SGD`` optimizer's momentum is taken over
(``beta`` = its momentum, the optimizer's set to 0, with a warning). The new momentum is staged and becomes current only
when the step was finite on every rank (``commit``), so a skipped step leaves it
untouched.

Wire bytes (allgather, fixed size): ``ceil(n / 8)``.
"""
from __future__ import annotations

from ..options import Option
from .base import register
from .signsgd import VOTE_OPTIONS, MajorityVote


@register("signum")
class SignumCompressor(MajorityVote):
    options = dict(VOTE_OPTIONS, beta=Option(float, 0.9, "0 <= beta < 1", lambda v: 0 <= v < 1))
