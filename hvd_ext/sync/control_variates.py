"""SCAFFOLD's drift correction for local steps against a parameter server (Karimireddy et al.,
"SCAFFOLD: Stochastic Controlled Averaging for Federated Learning", ICML 2020).

Rule. Worker i keeps a control variate c_i, the mean of its raw gradients over its last round of
local steps (the round between two exchanges); the server keeps c = (1/N) sum_i c_i, because each
worker adds (c_i_new - c_i) / N at its push. Every local step uses

    g - c_i + c        in place of its gradient g.

On label-skewed shards g estimates only the worker's own classes' gradient; g - c_i + c estimates
the gradient over every worker's data, so the local steps stop drifting toward the worker's own
classes (client drift). Under asynchrony each c_i on the server is simply the latest one its worker
pushed, so c stays the mean of the latest c_i whatever the order of the pushes.

c_i is the mean raw gradient of the round (SCAFFOLD's option II divides the model's displacement
by the sum of learning rates, which holds for plain SGD only; the gradient mean holds under any
optimizer). The correction is added on the device, with no host synchronisation; the flat copies
are made at the exchange only.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch


class ControlVariates:
    """c_i and c - c_i for ``params`` (see module doc); ``correct()`` before every optimizer step,
    ``delta()`` at a push, ``apply(c)`` after the pull."""

    def __init__(self, params: List[torch.Tensor], n: int):
        self.params = params
        self.n = int(n)
        self.numel = sum(p.numel() for p in params)
        self.c_local = [torch.zeros_like(p) for p in params]
        self.shift = [torch.zeros_like(p) for p in params]  # c - c_i
        self.grad_sum = [torch.zeros_like(p) for p in params]
        self.count = 0
        self._pending: Optional[torch.Tensor] = None

    def correct(self) -> None:
        """Accumulate this step's raw gradients, then shift them by c - c_i, in place."""
        idx = [j for j, p in enumerate(self.params) if p.grad is not None]
        if not idx:
            return
        grads = [self.params[j].grad for j in idx]
        torch._foreach_add_([self.grad_sum[j] for j in idx], grads)
        torch._foreach_add_(grads, [self.shift[j] for j in idx])
        self.count += 1

    def _flat(self, tensors: List[torch.Tensor]) -> torch.Tensor:
        return torch.cat([t.detach().reshape(-1).to(torch.float64).cpu() for t in tensors])

    def delta(self) -> torch.Tensor:
        """(c_i_new - c_i) / N, flat float64; c_i_new is kept until ``apply``. Zero after no step."""
        old = self._flat(self.c_local)
        if self.count == 0:
            self._pending = old
            return torch.zeros_like(old)
        import os
        beta = float(os.environ.get("CVBETA", "0"))
        self._pending = self._flat(self.grad_sum) / self.count
        if beta and float(old.abs().sum()) > 0:
            self._pending = beta * old + (1 - beta) * self._pending
        return (self._pending - old) / self.n

    def discard(self) -> None:
        """The push carried nothing (a non-finite value): keep c_i, start a new round."""
        self._pending = None
        self._reset_round()

    def apply(self, c: torch.Tensor) -> None:
        """After the pull: c_i = c_i_new, shift = c - c_i, a new round starts."""
        if self._pending is not None:
            self._set(self.c_local, self._pending)
        self._pending = None
        self._set(self.shift, c.to(torch.float64) - self._flat(self.c_local))
        self._reset_round()

    def _reset_round(self) -> None:
        for t in self.grad_sum:
            t.zero_()
        self.count = 0

    @staticmethod
    def _set(tensors: List[torch.Tensor], flat: torch.Tensor) -> None:
        off = 0
        for t in tensors:
            n = t.numel()
            t.copy_(flat[off:off + n].view_as(t).to(device=t.device, dtype=t.dtype))
            off += n

    def state_dict(self) -> Dict[str, Any]:
        return {"c_local": self._flat(self.c_local), "shift": self._flat(self.shift),
                "grad_sum": self._flat(self.grad_sum), "count": self.count}

    def load_state_dict(self, sd: Dict[str, Any]) -> None:
        for key in ("c_local", "shift", "grad_sum"):
            if sd[key].numel() != self.numel:
                raise ValueError(f"ControlVariates.load_state_dict: '{key}' has {sd[key].numel()} entries, "
                                 f"the model has {self.numel}")
        self._set(self.c_local, sd["c_local"])
        self._set(self.shift, sd["shift"])
        self._set(self.grad_sum, sd["grad_sum"])
        self.count = int(sd["count"])
        self._pending = None
