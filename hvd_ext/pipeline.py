"""The gradient pipeline of one step, bucket by bucket (DESIGN.md "Architecture").

    Feedback.compensate -> Compressor.compress -> Exchange (fused, async)
    -> Compressor.decompress / aggregate -> Feedback.adjust / update

Buckets are fixed at construction from the parameter list alone (reverse
registration order, roughly the order backward produces gradients, filled up
to ``bucket_bytes`` dense bytes, as PyTorch DDP does), so every rank builds the
same buckets and names the same collectives. A bucket's collective starts as
soon as its last gradient is ready -- during backward -- and the rest start at
``flush()``.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import torch

from .compression.base import Compressor, Continue, TensorInfo
from .exchange import Exchange
from .feedback.base import Feedback, NoFeedback


@dataclass
class _Bucket:
    index: int
    names: List[str]
    params: List[torch.Tensor]
    ready: set = field(default_factory=set)
    pending: Any = None
    items: List[Tuple[str, TensorInfo, torch.Tensor, Any, Any]] = field(default_factory=list)


def plan_buckets(named_params: List[Tuple[str, torch.Tensor]], bucket_bytes: int) -> List[List[int]]:
    """Greedy buckets over ``named_params`` in reverse order, each up to ``bucket_bytes`` dense bytes."""
    buckets: List[List[int]] = []
    cur: List[int] = []
    cur_bytes = 0
    for i in reversed(range(len(named_params))):
        p = named_params[i][1]
        nb = p.numel() * p.element_size()
        if cur and cur_bytes + nb > bucket_bytes:
            buckets.append(cur)
            cur, cur_bytes = [], 0
        cur.append(i)
        cur_bytes += nb
    if cur:
        buckets.append(cur)
    return buckets


class GradientPipeline:
    def __init__(self, named_params: List[Tuple[str, torch.Tensor]], compressor: Compressor,
                 feedback: Optional[Feedback], exchange: Exchange, bucket_bytes: int):
        self.compressor = compressor
        self.feedback = feedback if feedback is not None else NoFeedback()
        self.exchange = exchange
        self.step = 0  # exchanges completed; identical on every rank
        self.compress_s = 0.0
        self.buckets: List[_Bucket] = []
        self.bucket_of: Dict[int, _Bucket] = {}
        for bi, idxs in enumerate(plan_buckets(named_params, bucket_bytes)):
            b = _Bucket(bi, [named_params[i][0] for i in idxs], [named_params[i][1] for i in idxs])
            self.buckets.append(b)
            for p in b.params:
                self.bucket_of[id(p)] = b
        hvd = exchange.hvd
        self.rank = exchange.process_set.rank() if hasattr(exchange.process_set, "rank") else hvd.rank()
        self.size = exchange.size

    @property
    def in_flight(self) -> bool:
        return any(b.pending is not None or b.ready for b in self.buckets)

    # ---- called from the backward hooks --------------------------------------------------
    def mark_ready(self, p: torch.Tensor) -> None:
        b = self.bucket_of[id(p)]
        if b.pending is not None:
            raise AssertionError("hvd_ext: gradient computed again after its bucket was sent; "
                                 "call step()/synchronize() between backward passes or raise "
                                 "backward_passes_per_step")
        b.ready.add(id(p))
        if len(b.ready) == len(b.params):
            self._launch(b)

    def flush(self) -> None:
        """Start every bucket not started yet (parameters without gradients send zeros)."""
        for b in self.buckets:
            if b.pending is None:
                self._launch(b)

    # ---- launch and finish -------------------------------------------------------------------
    def _launch(self, b: _Bucket) -> None:
        t0 = time.perf_counter()
        comp, fb = self.compressor, self.feedback
        payloads, items = [], []
        nonfinite = False
        compensated = []
        scale = self.exchange.scale()
        for name, p in zip(b.names, b.params):
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            g = p.grad
            if g.is_sparse:
                g = g.to_dense()
            if not bool(torch.isfinite(g).all()):
                nonfinite = True
            info = TensorInfo(name=name, shape=g.shape, step=self.step, rank=self.rank, size=self.size,
                              param=p.detach())
            info.extra["scale"] = scale  # factor applied to the sum over ranks (feedbacks read it)
            src = g if comp.exchange == "allreduce" else g.float()
            compensated.append((name, info, fb.compensate(name, src, info)))
        # Optional hook: budgets spanning the tensors of a bucket (topk scope=model, sig).
        prepare = getattr(comp, "prepare_bucket", None)
        if prepare is not None:
            prepare([(u, info) for _, info, u in compensated])
        for name, info, u in compensated:
            payload, ctx = comp.compress(u, info)
            payloads.append(payload)
            items.append((name, info, u, payload, ctx))
        kind = comp.exchange
        if kind == "allreduce":
            b.pending = (kind, self.exchange.start_allreduce(f"hvd_ext.ar.b{b.index}", payloads, nonfinite))
        else:
            b.pending = (kind, self.exchange.start_allgather(f"hvd_ext.ag.b{b.index}", payloads, nonfinite))
        b.items = items
        self.compress_s += time.perf_counter() - t0

    def finish(self) -> bool:
        """Wait for every bucket, write the averaged gradients into ``p.grad``.

        Returns True when some rank had a non-finite gradient (same answer on
        every rank); the feedback memory is then left as it was."""
        self.flush()
        nonfinite = False
        comp, fb = self.compressor, self.feedback
        use_fb = not isinstance(fb, NoFeedback)
        scale = self.exchange.scale()
        for b in self.buckets:
            kind, pending = b.pending
            if kind == "allreduce":
                results, nf = self._finish_allreduce(b, pending)
                supports = [None] * len(results)
            else:
                per_tensor, nf = self.exchange.finish_allgather(pending)
                t0 = time.perf_counter()
                results, supports = [], []
                for (name, info, u, payload, ctx), datas in zip(b.items, per_tensor):
                    results.append(comp.aggregate(datas, ctx, info).mul_(scale))
                    supports.append(comp.support(datas, ctx, info) if getattr(fb, "needs_support", False)
                                    else None)
                self.compress_s += time.perf_counter() - t0
            nonfinite = nonfinite or nf
            t0 = time.perf_counter()
            for (name, info, u, payload, ctx), p, res, sup in zip(b.items, b.params, results, supports):
                if use_fb:
                    res = fb.adjust(name, res, info, sup)
                    sent = comp.local_contribution(payload, ctx, info, res)
                    fb.update(name, u, sent.reshape(u.shape), info)
                g = p.grad
                res = res.reshape(g.shape)
                if g.is_sparse:
                    p.grad = res.to(g.dtype)
                else:
                    g.copy_(res)
            self.compress_s += time.perf_counter() - t0
            b.pending = None
            b.ready.clear()
            b.items = []
        if nonfinite:
            fb.discard()
            comp.discard()
        else:
            fb.commit()
            comp.commit()
        self.step += 1
        return nonfinite

    def _finish_allreduce(self, b: _Bucket, pending):
        comp = self.compressor
        reduced, nf = self.exchange.finish_allreduce(pending)
        results: List[Optional[torch.Tensor]] = [None] * len(reduced)
        todo = list(range(len(reduced)))
        ctxs = [it[4] for it in b.items]
        rnd = 1
        while todo:
            again, payloads = [], []
            for j, i in enumerate(todo):
                out = comp.decompress(reduced[j], ctxs[i], b.items[i][1])
                if isinstance(out, Continue):
                    ctxs[i] = out.ctx
                    again.append(i)
                    payloads.append(out.payload)
                else:
                    results[i] = out
            if not again:
                break
            rnd += 1
            pend = self.exchange.start_allreduce(f"hvd_ext.ar.b{b.index}.r{rnd}", payloads, False)
            reduced, _ = self.exchange.finish_allreduce(pend)
            todo = again
        # keep the final ctx for local_contribution (multi-round codecs read it)
        b.items = [(n, info, u, payload, ctx) for (n, info, u, payload, _), ctx in zip(b.items, ctxs)]
        return results, nf

    # ---- checkpoint --------------------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        return {"step": self.step, "feedback": self.feedback.state_dict(),
                "compressor": self.compressor.state_dict(), "spec": self.compressor.spec()}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.step = int(state.get("step", 0))
        self.feedback.load_state_dict(state.get("feedback", {}))
        self.compressor.load_state_dict(state.get("compressor", {}))
