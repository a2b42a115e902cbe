"""Exchange: the only code that calls Horovod collectives on the gradient path.

It moves payloads, it does not interpret them. One bucket of payloads becomes

* allreduce path: one flat tensor per dtype (payloads concatenated, plus one
  trailing flag element that carries "some rank had a non-finite gradient"),
  reduced by ``hvd.allreduce_async_`` with Horovod's pre/postscale factors;
* allgather path: one flat ``uint8`` buffer per rank, reduced by one
  ``hvd.allgather_async`` (ranks may contribute different sizes). Layout of a
  rank's buffer (little endian, 4-byte aligned)::

      u32 flags (bit 0: non-finite gradient) | u32 n | u32 len_0 .. len_{n-1}
      | payload_0 (padded to 4) | ... | payload_{n-1} (padded to 4)

Bytes counted: ``sent`` is what this rank contributes to the collective (the
flat buffer's size, header and padding included); ``received`` is what it gets
back from the other ranks (allgather: their buffers; allreduce: the reduced
buffer, same size as sent). These are payload bytes, independent of the
algorithm Horovod uses underneath (a ring allreduce moves about 2(N-1)/N of
them each way).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import torch

_HDR = 8  # flags + count


def _pad4(n: int) -> int:
    return (n + 3) & ~3


@dataclass
class ExchangeStats:
    bytes_sent: int = 0
    bytes_received: int = 0
    collectives: int = 0
    wait_s: float = 0.0

    def reset(self):
        self.bytes_sent = self.bytes_received = self.collectives = 0
        self.wait_s = 0.0


@dataclass
class _Pending:
    kind: str
    handles: List[Any]
    meta: Any
    extra: Dict[str, Any] = field(default_factory=dict)


class Exchange:
    """Fused Horovod collectives for buckets of payloads.

    ``op``, ``prescale_factor`` and ``postscale_factor`` follow
    ``hvd.allreduce``; on the allgather path the exchange returns every rank's
    payloads and the caller applies :meth:`scale` to the decoded sum.
    """

    def __init__(self, op=None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                 process_set=None):
        import horovod.torch as hvd

        self.hvd = hvd
        self.op = hvd.Average if op is None else op
        self.prescale_factor = float(prescale_factor)
        self.postscale_factor = float(postscale_factor)
        self.process_set = hvd.global_process_set if process_set is None else process_set
        self.stats = ExchangeStats()

    @property
    def size(self) -> int:
        return self.process_set.size()

    def scale(self) -> float:
        """Factor that turns a sum over ranks into what ``op`` asks for."""
        f = self.prescale_factor * self.postscale_factor
        if self.op == self.hvd.Average:
            f /= self.size
        return f

    # ---- allreduce ---------------------------------------------------------------
    def start_allreduce(self, name: str, payloads: List[torch.Tensor], nonfinite: bool) -> _Pending:
        """Reduce ``payloads`` (1-D tensors) with one collective per dtype."""
        hvd = self.hvd
        if self.op == hvd.Adasum:
            # Adasum is not elementwise-linear across a concatenation: one tensor each
            # (Horovod fuses them itself), the non-finite flag as its own scalar sum.
            handles = [hvd.allreduce_async_(p, name=f"{name}.{i}", op=hvd.Adasum,
                                            process_set=self.process_set) for i, p in enumerate(payloads)]
            flag = torch.tensor([1.0 if nonfinite else 0.0])
            handles.append(hvd.allreduce_async_(flag, name=f"{name}.flag", op=hvd.Sum,
                                                process_set=self.process_set))
            nbytes = sum(p.numel() * p.element_size() for p in payloads) + 4
            self._count(nbytes, nbytes, len(handles))
            return _Pending("adasum", handles, None)
        groups: Dict[torch.dtype, List[int]] = {}
        for i, p in enumerate(payloads):
            groups.setdefault(p.dtype, []).append(i)
        handles, metas = [], []
        flag_value = 1.0 if nonfinite else 0.0
        first = True
        for dtype, idxs in groups.items():
            parts = [payloads[i].reshape(-1) for i in idxs]
            if first:
                dev = parts[0].device
                parts = parts + [torch.full((1,), flag_value, dtype=dtype, device=dev)]
            flat = torch.cat(parts) if len(parts) > 1 else parts[0].clone()
            h = hvd.allreduce_async_(flat, name=f"{name}.{str(dtype).split('.')[-1]}", op=self.op,
                                     prescale_factor=self.prescale_factor,
                                     postscale_factor=self.postscale_factor,
                                     process_set=self.process_set)
            handles.append(h)
            metas.append((idxs, [payloads[i].numel() for i in idxs], first))
            nbytes = flat.numel() * flat.element_size()
            self._count(nbytes, nbytes, 1)
            first = False
        if not payloads:  # still carry the flag so every rank agrees
            flat = torch.tensor([flag_value])
            handles.append(hvd.allreduce_async_(flat, name=f"{name}.flag", op=hvd.Sum,
                                                process_set=self.process_set))
            metas.append(([], [], True))
            self._count(4, 4, 1)
        return _Pending("allreduce", handles, (len(payloads), metas))

    def finish_allreduce(self, pending: _Pending) -> Tuple[List[torch.Tensor], bool]:
        hvd = self.hvd
        t0 = time.perf_counter()
        outs = [hvd.synchronize(h) for h in pending.handles]
        self.stats.wait_s += time.perf_counter() - t0
        if pending.kind == "adasum":
            return outs[:-1], bool(outs[-1].item() != 0)
        n, metas = pending.meta
        result: List[Optional[torch.Tensor]] = [None] * n
        nonfinite = False
        for flat, (idxs, sizes, has_flag) in zip(outs, metas):
            off = 0
            for i, sz in zip(idxs, sizes):
                result[i] = flat[off:off + sz]
                off += sz
            if has_flag:
                flag = flat[off]
                nonfinite = bool(flag.item() != 0) or not bool(torch.isfinite(flag).item())
        return result, nonfinite

    # ---- allgather -----------------------------------------------------------------
    def start_allgather(self, name: str, payloads: List[torch.Tensor], nonfinite: bool) -> _Pending:
        """Gather every rank's ``uint8`` payloads with one collective."""
        n = len(payloads)
        lens = [int(p.numel()) for p in payloads]
        header = torch.tensor([1 if nonfinite else 0, n] + lens, dtype=torch.int32).view(torch.uint8)
        parts = [header]
        for p, ln in zip(payloads, lens):
            if p.dtype != torch.uint8:
                raise TypeError(f"allgather payloads must be uint8, got {p.dtype}")
            parts.append(p.reshape(-1))
            pad = _pad4(ln) - ln
            if pad:
                parts.append(torch.zeros(pad, dtype=torch.uint8, device=p.device))
        device = payloads[0].device if payloads else torch.device("cpu")
        buf = torch.cat([q.to(device) for q in parts])
        h = self.hvd.allgather_async(buf, name=name, process_set=self.process_set)
        nbytes = buf.numel()
        # received is known only after the collective; counted in finish
        self.stats.bytes_sent += nbytes
        self.stats.collectives += 1
        return _Pending("allgather", [h], n, {"own": nbytes})

    def finish_allgather(self, pending: _Pending) -> Tuple[List[List[torch.Tensor]], bool]:
        """Return ``per_tensor[i][r]`` = rank r's payload for tensor i, and the global non-finite flag."""
        t0 = time.perf_counter()
        buf = self.hvd.synchronize(pending.handles[0])
        self.stats.wait_s += time.perf_counter() - t0
        self.stats.bytes_received += buf.numel() - pending.extra["own"]
        n = pending.meta
        per_tensor: List[List[torch.Tensor]] = [[] for _ in range(n)]
        nonfinite = False
        off = 0
        total = buf.numel()
        ranks = 0
        while off < total:
            hdr = buf[off:off + _HDR + 4 * n].clone().view(torch.int32).tolist()
            flags, count, lens = hdr[0], hdr[1], hdr[2:]
            if count != n:
                raise RuntimeError(f"hvd_ext exchange: rank {ranks} sent {count} payloads, expected {n} "
                                   "(ranks disagree on the bucket layout)")
            nonfinite = nonfinite or bool(flags & 1)
            p = off + _HDR + 4 * n
            for i, ln in enumerate(lens):
                per_tensor[i].append(buf[p:p + ln])
                p += _pad4(ln)
            off = p
            ranks += 1
        if ranks != self.size:
            raise RuntimeError(f"hvd_ext exchange: parsed {ranks} rank buffers, expected {self.size}")
        return per_tensor, nonfinite

    def _count(self, sent: int, received: int, collectives: int) -> None:
        self.stats.bytes_sent += sent
        self.stats.bytes_received += received
        self.stats.collectives += collectives

    # ---- small helpers used by the optimizer and sync strategies ---------------------
    def allreduce_scalar(self, value: float, name: str, op=None) -> float:
        hvd = self.hvd
        t = torch.tensor([float(value)], dtype=torch.float64)
        t0 = time.perf_counter()
        out = hvd.allreduce(t, name=name, op=hvd.Sum if op is None else op, process_set=self.process_set)
        self.stats.wait_s += time.perf_counter() - t0
        self._count(8, 8, 1)
        return float(out.item())
