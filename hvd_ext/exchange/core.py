"""``Exchange``: fused, byte-counted collectives over a :class:`Transport`.

It moves payloads, it does not interpret them. Every collective hvd_ext makes
-- gradient buckets, parameter and momentum averages of the sync strategies,
scalars, configuration fingerprints -- goes through one ``Exchange``:

* ``start_allreduce`` / ``finish_allreduce``: one flat tensor per dtype
  (payloads concatenated, plus one trailing element that carries "some rank
  had a non-finite gradient"), with Horovod's pre/postscale factors;
* ``start_allgather`` / ``finish_allgather``: one flat ``uint8`` buffer (a
  *frame*) per rank (sizes may differ). Layout of a frame (little endian)::

      u32 flags (bit 0: non-finite) | u32 n | u32 len_0 .. len_{n-1}
      | payload_0 (padded to 4) | ... | payload_{n-1} (not padded)

  When the codec can say every rank's payload sizes from the shapes
  (``Compressor.payload_size``) the layout is known everywhere: an allgather,
  and nothing is read on receipt but the flags, combined on the device. Else
  the frames travel by an alltoall that sends this rank's to every rank (the
  bytes of an allgather) and whose received sizes the transport reports on
  the host; a frame of one payload is then parsed from its size, and frames of
  several have their headers read, all in one read;
* ``start_alltoall`` / ``finish_alltoall``: one frame per destination
  rank, sent with a single variable-split alltoall (the first phase of the
  two-phase and sparse reduce-scatter exchanges);
* ``start_reduce_scatter`` / ``finish_reduce_scatter`` and
  ``start_allgather_dense`` / ``finish_allgather_dense``: dense float shards
  (the intra-node phases of the node-aware exchange);
* ``allreduce_average``, ``allreduce_scalar``, ``allgather_object``,
  ``broadcast_object`` for the sync strategies and the optimizer.

Non-finite flags come back as 0-d bool tensors on the payloads' device and header
checks are deferred (``ops.device.expect``): the pipeline reads them once per step.

``node_exchanges()`` gives two sub-exchanges over this rank's node and over
the ranks with the same local rank on every node; they count into the same
``stats``, their wire bytes also under ``stats.wire_by_link["intra"]`` and
``["inter"]``.

Bytes counted per rank (``stats``): ``bytes_sent`` is what this rank hands to
the collectives, ``bytes_received`` what it gets back from other ranks
(allreduce: the reduced buffer), and ``wire_bytes`` what it transmits on the
network under the standard algorithms (see :mod:`hvd_ext.exchange.cost`: ring
allreduce 2(N-1)/N x buffer, allgather and alltoall the bytes that leave the
rank).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from ..ops.device import expect, nonfinite as nonfinite_flag, on_host, read, upload
from ..ops.cpu_kernels import empty, sum_float32
from . import calibration, cost
from . import probe
from .transport import (BROADCAST_DTYPES, HorovodTransport, NodeGroupsUnavailable, Transport, forget_node_groups,
                        offsets)

_HDR = 8  # flags + count
ASSUMED_NODE_LINKS = "cost model defaults"  # Exchange.node_links["source"] of links not measured


def _pad4(n: int) -> int:
    return (n + 3) & ~3


@dataclass
class ExchangeStats:
    bytes_sent: int = 0
    bytes_received: int = 0
    wire_bytes: float = 0.0
    collectives: int = 0
    wait_s: float = 0.0
    by_kind: Dict[str, int] = field(default_factory=dict)  # collectives per kind
    wire_by_link: Dict[str, float] = field(default_factory=dict)  # "flat" | "intra" | "inter"

    def reset(self):
        self.bytes_sent = self.bytes_received = self.collectives = 0
        self.wire_bytes = 0.0
        self.wait_s = 0.0
        self.by_kind = {}
        self.wire_by_link = {}

    def add_wire(self, link: str, wire: float) -> None:
        self.wire_bytes += float(wire)
        self.wire_by_link[link] = self.wire_by_link.get(link, 0.0) + float(wire)


@dataclass
class Pending:
    kind: str
    handles: List[Any]
    meta: Any
    extra: Dict[str, Any] = field(default_factory=dict)


def sums_half_itself(dtype: torch.dtype, device_type: str, size: int) -> bool:
    """Whether :meth:`Exchange.start_allreduce` sums a ``dtype`` buffer on ``device_type`` itself, in
    float32 (an alltoall, then an allgather; see ``HALF_RS_MIN``), rather than by the transport's
    allreduce: bfloat16 always (Horovod has none), float16 on a CPU (Horovod's sum there is scalar code)."""
    return dtype == torch.bfloat16 or (dtype == torch.float16 and device_type == "cpu" and size > 1)


def half_sum_kinds(size: int, numel: int) -> tuple:
    """The collectives of that sum over ``size`` ranks of a ``numel``-element buffer: one allgather on
    one rank, or two and fewer than ``Exchange.HALF_RS_MIN`` elements; else an alltoall, then an allgather."""
    if size == 1 or (size == 2 and numel < Exchange.HALF_RS_MIN):
        return ("allgather",)
    return ("alltoall", "allgather")


def _op_name(op) -> str:
    if op is None:
        return "average"
    if isinstance(op, str):
        if op not in ("average", "sum", "adasum"):
            raise ValueError(f"op must be one of 'average', 'sum', 'adasum' (or hvd.Average/Sum/Adasum), got {op!r}")
        return op
    import horovod.torch as hvd

    names = {hvd.Average: "average", hvd.Sum: "sum", hvd.Adasum: "adasum"}
    if op not in names:
        raise ValueError(f"op must be one of hvd.Average, hvd.Sum, hvd.Adasum; got {op!r}")
    return names[op]


def frame_size(lens: Sequence[int]) -> int:
    """Bytes of a frame holding payloads of ``lens`` bytes (every payload but the last padded to 4)."""
    if not lens:
        return _HDR
    return _HDR + 4 * len(lens) + sum(_pad4(ln) for ln in lens[:-1]) + int(lens[-1])


def frame(payloads: Sequence[torch.Tensor], nonfinite, device=None) -> torch.Tensor:
    """One uint8 buffer holding ``payloads`` (each uint8, 1-D) behind the flag/length header. The flag
    may be a 0-d device tensor (written on the device) or a bool; the lengths go up without blocking."""
    n = len(payloads)
    lens = [int(p.numel()) for p in payloads]
    dev = device if device is not None else (payloads[0].device if payloads else
                                             (nonfinite.device if isinstance(nonfinite, torch.Tensor) else "cpu"))
    flag = isinstance(nonfinite, torch.Tensor)
    header = upload([0 if flag else int(bool(nonfinite)), n] + lens, torch.int32, dev)
    if flag:
        header[:1].copy_(nonfinite.reshape(1))
    parts = [header.view(torch.uint8)]
    for i, (p, ln) in enumerate(zip(payloads, lens)):
        if p.dtype != torch.uint8:
            raise TypeError(f"exchange payloads must be uint8, got {p.dtype}")
        parts.append(p.reshape(-1))
        pad = _pad4(ln) - ln
        if pad and i < n - 1:
            parts.append(torch.zeros(pad, dtype=torch.uint8, device=dev))
    return torch.cat(parts)


def _gather_words(buf: torch.Tensor, starts: Sequence[int], words: int) -> torch.Tensor:
    """(len(starts), words) int32: the ``words`` 32-bit words at each byte offset (any alignment),
    gathered on the device in one operation."""
    if not starts:
        return torch.empty(0, words, dtype=torch.int32, device=buf.device)
    pos = upload(list(starts), torch.int64, buf.device)[:, None] + torch.arange(4 * words, device=buf.device)
    return buf[pos].contiguous().view(torch.int32).view(len(starts), words)


def unframe(buf: torch.Tensor, starts: Sequence[int], sizes: Sequence[int], n: int, who: str,
            lens: Optional[Sequence[Sequence[int]]] = None) -> Tuple[List[List[torch.Tensor]], torch.Tensor]:
    """Parse the frames of ``n`` payloads that start at byte ``starts[r]`` of ``buf`` (``sizes[r]``
    bytes each): ([payloads of frame r], some frame's non-finite flag as a 0-d bool tensor).

    ``lens[r]``: frame r's payload lengths when the receiver knows them (codecs whose sizes follow
    from the shapes); the headers are then only checked, on the device (a mismatch raises
    RuntimeError when the step reads its checks). Else the headers are read: one read for all frames."""
    if lens is None and n == 1:  # one payload: the frame's size says its length
        lens = [[size - _HDR - 4] for size in sizes]
    if on_host(buf):  # reading costs nothing here: the headers as Python ints, checked at once
        heads = [_words(buf, s, 2 + n) for s in starts]
        nonfinite = torch.tensor(any(h[0] & 1 for h in heads))
        table = [h[1:] for h in heads]
        if lens is not None and table != [[n] + [int(x) for x in row] for row in lens]:
            raise RuntimeError(f"hvd_ext exchange: {who}: a rank's header does not match the layout this rank "
                               "expects (ranks disagree on the bucket layout)")
        return _split_frames(buf, starts, sizes, n, who, table), nonfinite
    heads = _gather_words(buf, starts, 2 + n)
    nonfinite = ((heads[:, 0] & 1) != 0).any() if len(starts) else torch.zeros((), dtype=torch.bool,
                                                                                device=buf.device)
    if lens is not None:
        table = [[n] + [int(x) for x in row] for row in lens]
        want = upload(table, torch.int32, buf.device) if table else heads[:, 1:]
        expect((heads[:, 1:] == want).all(), f"hvd_ext exchange: {who}: a rank's header does not match the "
                                             "layout this rank expects (ranks disagree on the bucket layout)",
               RuntimeError)
    else:
        table = _rows(read(heads[:, 1:]), n + 1) if len(starts) else []
    return _split_frames(buf, starts, sizes, n, who, table), nonfinite


def _words(buf: torch.Tensor, start: int, words: int) -> List[int]:
    """The 32-bit words at byte ``start`` of a host buffer, as Python ints (any alignment)."""
    return buf[start:start + 4 * words].clone().view(torch.int32).tolist()


def _split_frames(buf, starts, sizes, n, who, table) -> List[List[torch.Tensor]]:
    """The payloads of every frame, from its header's lengths (``table[r]``: count, then lengths)."""
    out = []
    for r, (start, size, row) in enumerate(zip(starts, sizes, table)):
        if row[0] != n:
            raise RuntimeError(f"hvd_ext exchange: {who}: rank {r} sent {row[0]} payloads, expected {n} "
                               "(ranks disagree on the bucket layout)")
        if size != frame_size(row[1:]):
            raise RuntimeError(f"hvd_ext exchange: {who}: rank {r}'s frame of {size} bytes does not hold "
                               f"payloads of {list(row[1:])} bytes (ranks disagree on the exchange layout)")
        p = start + _HDR + 4 * n
        parts = []
        for ln in row[1:]:
            parts.append(buf[p:p + ln])
            p += _pad4(ln)
        out.append(parts)
    return out


def _rows(flat: List[int], width: int) -> List[List[int]]:
    return [flat[i:i + width] for i in range(0, len(flat), width)]


class Exchange:
    """Fused collectives for buckets of payloads, over Horovod (default) or any :class:`Transport`.

    ``op``, ``prescale_factor`` and ``postscale_factor`` follow
    ``hvd.allreduce``; on the allgather/alltoall paths the exchange returns
    payloads and the caller applies :meth:`scale` to the decoded sum.
    """

    def __init__(self, op=None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                 process_set=None, transport: Optional[Transport] = None, link: str = "flat",
                 stats: Optional[ExchangeStats] = None):
        self.op_name = _op_name(op)
        self.op = op
        self.prescale_factor = float(prescale_factor)
        self.postscale_factor = float(postscale_factor)
        self.transport = transport if transport is not None else HorovodTransport(process_set)
        self.process_set = getattr(self.transport, "process_set", None)
        self.link = link
        self.stats = stats if stats is not None else ExchangeStats()
        self._node = None  # (local, cross) sub-exchanges, or the reason they are unavailable
        self._node_model = None  # cost.NodeModel of the node links (node_model())
        self.node_links: Dict[str, object] = {}  # what node_model() found, for opt.stats
        self._pool: Dict[str, torch.Tensor] = {}  # reused fused buffers by collective tag (reuse=True)
        self._busy: set = set()

    # ---- world ---------------------------------------------------------------------
    @property
    def size(self) -> int:
        return self.transport.size()

    @property
    def rank(self) -> int:
        return self.transport.rank()

    def included(self) -> bool:
        return self.transport.included()

    def scale(self) -> float:
        """Factor that turns a sum over ranks into what ``op`` asks for."""
        f = self.prescale_factor * self.postscale_factor
        if self.op_name == "average":
            f /= self.size
        return f

    def topology(self):
        """Where this rank sits among the nodes (:class:`~hvd_ext.exchange.transport.Topology`) or None."""
        return self.transport.topology()

    def node_exchanges(self) -> Tuple["Exchange", "Exchange"]:
        """(exchange over this rank's node, exchange over the ranks with this local rank on every node),
        both summing (op "sum"), counting into this exchange's ``stats``. Made once, by every rank in
        the same order; raises :class:`~hvd_ext.exchange.transport.NodeGroupsUnavailable`."""

        if isinstance(self._node, str):
            raise NodeGroupsUnavailable(self._node)
        if self._node is None:
            try:
                local, cross = self.transport.node_groups()
            except NodeGroupsUnavailable as e:
                self._node = str(e)
                raise
            self._node = (Exchange(op="sum", transport=local, link="intra", stats=self.stats),
                          Exchange(op="sum", transport=cross, link="inter", stats=self.stats))
        return self._node

    def node_model(self, device=None) -> "cost.NodeModel":
        """The intra- and inter-node links as a :class:`~hvd_ext.exchange.cost.NodeModel`: from the
        calibration file ``HVD_EXT_CALIBRATION`` names (:mod:`~hvd_ext.exchange.calibration`; set it
        on every rank), else measured once (:func:`~hvd_ext.exchange.probe.measure_node_model`;
        collective, after :meth:`node_exchanges` succeeded), else the cost model's defaults
        (``HVD_EXT_NODE_LINKS=default`` or a transport whose timings mean nothing). The same on every rank."""
        if self._node_model is None:
            calibrated = calibration.node_model(calibration.from_env())
            if calibrated is not None:
                self.use_node_model(calibrated, f"calibration file (${calibration.ENV})")
            elif probe.node_links_setting() == "measure" and self.transport.measurable:
                # once per process set and world: a second optimizer (a GAN's) takes the same links
                key = id(getattr(self.transport, "process_set", None))
                if key not in probe.MEASURED:
                    probe.MEASURED[key] = probe.measure_node_model(self, device)
                r = probe.MEASURED[key]
                self._node_model = r["model"]
                self.node_links = dict(probe.describe(self._node_model), source="measured",
                                       probe_s=round(r["seconds"], 3))
            else:
                self.use_node_model(cost.NodeModel(), ASSUMED_NODE_LINKS)
        return self._node_model

    def forget_nodes(self) -> None:
        """The world changed (elastic): node groups and node links are made again when next asked."""

        group = getattr(self.transport, "process_set", getattr(self.transport, "group", None))
        forget_node_groups(group)
        probe.MEASURED.pop(id(getattr(self.transport, "process_set", None)), None)
        self._node, self._node_model, self.node_links = None, None, {}

    @property
    def node_links_assumed(self) -> bool:
        """The node links are the cost model's defaults, not measured or calibrated."""
        return self.node_links.get("source") == ASSUMED_NODE_LINKS

    def use_node_model(self, model: "cost.NodeModel", source: str = "given") -> None:
        """Take ``model`` as the node links instead of measuring them (a replay of a measured run)."""

        self._node_model = model
        self.node_links = dict(probe.describe(model), source=source)

    def _count(self, kind: str, sent: int, received: int, wire: float) -> None:
        s = self.stats
        s.bytes_sent += int(sent)
        s.bytes_received += int(received)
        s.add_wire(self.link, wire)
        s.collectives += 1
        s.by_kind[kind] = s.by_kind.get(kind, 0) + 1

    def _wait(self, handle):
        t0 = time.perf_counter()
        out = self.transport.wait(handle)
        self.stats.wait_s += time.perf_counter() - t0
        return out

    # ---- allreduce ---------------------------------------------------------------
    def _fused(self, tag: str, parts: List[torch.Tensor], reuse: bool) -> torch.Tensor:
        """``parts`` concatenated into a fresh tensor, or with ``reuse`` into the buffer this tag used
        last time. A fresh CPU buffer of tens of MB is page-faulted in on every step (glibc maps it
        anew), several times slower than a copy into a reused buffer."""
        if not reuse:
            return torch.cat(parts) if len(parts) > 1 else parts[0].clone()
        n = sum(p.numel() for p in parts)
        buf = self._pool.get(tag)
        if (buf is None or tag in self._busy or buf.numel() != n or buf.dtype != parts[0].dtype
                or buf.device != parts[0].device):
            buf = empty(n, dtype=parts[0].dtype, device=parts[0].device)
            if tag not in self._busy:
                self._pool[tag] = buf
        if len(parts) > 1:
            torch.cat(parts, out=buf)
        else:
            buf.copy_(parts[0])
        self._busy.add(tag)
        return buf

    def start_allreduce(self, name: str, payloads: List[torch.Tensor], nonfinite,
                        reuse: bool = False) -> Pending:
        """Reduce ``payloads`` (1-D tensors) with one collective per dtype. ``nonfinite``: a bool or a 0-d
        bool tensor (this rank saw a NaN/Inf), carried as one trailing element of the first buffer.

        ``reuse=True``: the fused buffers are kept and reused by the next call with the same ``name``,
        so the results :meth:`finish_allreduce` returns (views of them) are valid only until then --
        for a caller that consumes them within the step."""
        tr, N = self.transport, self.size
        if self.op_name == "adasum":
            # Adasum is not elementwise-linear across a concatenation: one tensor each
            # (Horovod fuses them itself), the non-finite flag as its own scalar sum.
            handles = [tr.allreduce_async(p, f"{name}.{i}", op="adasum") for i, p in enumerate(payloads)]
            flag = _flag_element(nonfinite, torch.float32, payloads[0].device if payloads else "cpu")
            handles.append(tr.allreduce_async(flag, f"{name}.flag", op="sum"))
            for p in payloads + [flag]:
                nb = p.numel() * p.element_size()
                self._count("allreduce", nb, nb, cost.allreduce_wire(nb, N))
            return Pending("adasum", handles, len(payloads))
        groups: Dict[torch.dtype, List[int]] = {}
        for i, p in enumerate(payloads):
            groups.setdefault(p.dtype, []).append(i)
        handles, metas, tags = [], [], []
        first = True
        for dtype, idxs in groups.items():
            parts = [payloads[i].reshape(-1) for i in idxs]
            if first:
                parts = parts + [_flag_element(nonfinite, dtype, parts[0].device)]
            tag = f"{name}.{str(dtype).split('.')[-1]}"
            flat = self._fused(tag, parts, reuse)
            if sums_half_itself(dtype, flat.device.type, N):
                handles.append(self._start_half_sum(flat, tag))
            else:
                handles.append(tr.allreduce_async(flat, tag, op=self.op_name, prescale=self.prescale_factor,
                                                  postscale=self.postscale_factor))
            metas.append((idxs, [payloads[i].numel() for i in idxs], first))
            if reuse:
                tags.append(tag)
            nb = flat.numel() * flat.element_size()
            self._count("allreduce", nb, nb, cost.allreduce_wire(nb, N))
            first = False
        if not payloads:  # still carry the flag so every rank agrees
            flat = _flag_element(nonfinite, torch.float32, "cpu")
            handles.append(tr.allreduce_async(flat, f"{name}.flag", op="sum"))
            metas.append(([], [], True))
            self._count("allreduce", 4, 4, cost.allreduce_wire(4, N))
        return Pending("allreduce", handles, (len(payloads), metas), {"tags": tags})

    # ---- float16 on CPU and bfloat16: summed in float32 here, not by the transport ----------
    # Horovod's CPU float16 sum (Gloo, MPI) converts element by element in scalar code, far
    # slower than its float32 sum; and
    # Horovod has no bfloat16 collective at all (CPU or CUDA), so bfloat16 travels as int16 of
    # the same bits. Instead: N <= 2 (small buffers), one allgather and a local float32 sum;
    # N > 2, reduce-scatter by alltoall (each rank sums its 1/N in float32) then an allgather of
    # the half-precision result -- the ring's 2(N-1)/N x bytes either way. The sum is rounded
    # back to the payload's dtype, as a half-precision ring sum (and DDP's bf16 hook) would.
    # Every rank ends with bitwise the same values (the same sums, in the same order).
    # From this many elements a 2-rank half-precision sum also goes reduce-scatter + allgather: each
    # rank then sums half the buffer (the same bytes on the wire, one more collective's latency).
    HALF_RS_MIN = 1 << 20

    @staticmethod
    def _wire(t: torch.Tensor) -> torch.Tensor:
        return t.view(torch.int16) if t.dtype == torch.bfloat16 else t

    def _start_half_sum(self, flat: torch.Tensor, name: str) -> Pending:
        N, n = self.size, flat.numel()
        if half_sum_kinds(N, n) == ("allgather",):
            return Pending("half-ag", [self.transport.allgather_equal_async(self._wire(flat), f"{name}.ag")],
                           (n, flat.dtype))
        splits = [n // N + (1 if j < n % N else 0) for j in range(N)]
        return Pending("half-rs", [self.transport.alltoall_async(self._wire(flat), splits, f"{name}.rs")],
                       (n, splits, name, flat.dtype))

    def _half_reduce(self, rows: torch.Tensor) -> torch.Tensor:
        """Half-precision rows (one per rank) -> op(rows) in float32, rounded back to the rows' dtype
        (as Horovod would for float16); in cache-sized chunks on CPU (``sum_float32``)."""

        f = self.prescale_factor * self.postscale_factor / (self.size if self.op_name == "average" else 1)
        return sum_float32(list(rows), f, torch.empty(rows.shape[1], dtype=rows.dtype, device=rows.device))

    def _finish_half_sum(self, p: Pending) -> torch.Tensor:
        N = self.size
        if p.kind == "half-ag":
            n, dtype = p.meta
            got = self._wait(p.handles[0])
            return self._half_reduce(got.view(dtype).view(N, n))
        n, splits, name, dtype = p.meta
        received, _ = self._wait(p.handles[0])
        mine = self._half_reduce(received.view(dtype).view(N, splits[self.rank]))
        return self._wait(self.transport.allgather_async(self._wire(mine), f"{name}.ag")).view(dtype)

    def finish_allreduce(self, pending: Pending) -> Tuple[List[torch.Tensor], torch.Tensor]:
        """(the reduced payloads, a 0-d bool tensor: some rank had a non-finite value) -- no host read."""
        outs = [self._finish_half_sum(h) if isinstance(h, Pending) else self._wait(h) for h in pending.handles]
        self._busy.difference_update(pending.extra.get("tags", ()))
        if pending.kind == "adasum":
            return outs[:-1], (outs[-1] != 0).any()
        n, metas = pending.meta
        result: List[Optional[torch.Tensor]] = [None] * n
        flags = []
        for flat, (idxs, sizes, has_flag) in zip(outs, metas):
            off = 0
            for i, sz in zip(idxs, sizes):
                result[i] = flat[off:off + sz]
                off += sz
            # A NaN/Inf on any rank makes the reduced buffer non-finite (the trailing flag element
            # is part of it); the flag element says so too when the rank tested its own inputs.
            flags.append(nonfinite_flag([flat]))
            if has_flag:
                flags.append((flat[off] != 0).reshape(()))
        return result, _any(flags)

    # ---- one flat buffer reduced where it lies (a DDP bucket) ------------------------------
    def start_reduce_in_place(self, name: str, buf: torch.Tensor) -> Pending:
        """Start reducing the 1-D float32/float64 ``buf`` over the ranks by ``op`` (average or sum), its
        result to land in ``buf`` itself: no copy into a fused buffer and no flag element, since a
        NaN/Inf on any rank makes the reduced buffer non-finite on every rank."""
        if self.op_name == "adasum" or buf.dtype not in (torch.float32, torch.float64):
            raise ValueError(f"start_reduce_in_place {name!r}: op {self.op_name!r}, dtype {buf.dtype}; "
                             "accepted: op average or sum, float32 or float64")
        nb = buf.numel() * buf.element_size()
        self._count("allreduce", nb, nb, cost.allreduce_wire(nb, self.size))
        h = self.transport.allreduce_async(buf, name, op=self.op_name, prescale=self.prescale_factor,
                                           postscale=self.postscale_factor)
        return Pending("in-place", [h], buf)

    def finish_reduce_in_place(self, pending: Pending) -> torch.Tensor:
        """Wait for :meth:`start_reduce_in_place`; -> 0-d bool tensor, some rank had a NaN/Inf (no host
        read on a device)."""
        out, buf = self._wait(pending.handles[0]), pending.meta
        if out.data_ptr() != buf.data_ptr():  # a transport that reduces into a new tensor
            buf.copy_(out.reshape(buf.shape))
        return nonfinite_flag([buf])

    # ---- allgather -----------------------------------------------------------------
    def start_allgather(self, name: str, payloads: List[torch.Tensor], nonfinite,
                        lens: Optional[List[List[int]]] = None) -> Pending:
        """Gather every rank's ``uint8`` payloads with one collective. ``lens[r]``: rank r's payload sizes,
        when every rank knows them (codecs whose sizes follow from the shapes): nothing is read on
        receipt. Else the frames travel by an alltoall that sends this rank's to every rank (the bytes of
        an allgather), whose received sizes the transport knows on the host, and the headers are read
        once."""
        buf = frame(payloads, nonfinite)
        self.stats.bytes_sent += buf.numel()
        N = self.size
        if lens is not None:
            if len(lens) != N:
                raise ValueError(f"start_allgather: payload sizes of {len(lens)} ranks for {N}")
            h = self.transport.allgather_async(buf, name)
        else:
            h = self.transport.alltoall_async(buf.repeat(N) if N > 1 else buf, [buf.numel()] * N, name)
        return Pending("allgather", [h], len(payloads), {"own": buf.numel(), "lens": lens})

    def finish_allgather(self, pending: Pending) -> Tuple[List[List[torch.Tensor]], torch.Tensor]:
        """Return ``per_tensor[i][r]`` = rank r's payload for tensor i, and the global non-finite flag (a 0-d
        bool tensor)."""
        got = self._wait(pending.handles[0])
        own, lens, N = pending.extra["own"], pending.extra["lens"], self.size
        if lens is not None:
            buf = got
            sizes = [frame_size(row) for row in lens]
            if buf.numel() != sum(sizes):
                raise RuntimeError(f"hvd_ext exchange: gathered {buf.numel()} bytes from {N} ranks, expected "
                                   f"{sum(sizes)} (ranks disagree on the exchange layout)")
        else:
            buf, sizes = got
            if sizes is None:
                raise RuntimeError("hvd_ext exchange: the transport did not say how many bytes each rank sent")
        starts = [a for a, _ in offsets(sizes)]
        frames, nonfinite = unframe(buf, starts, sizes, pending.meta, pending.kind, lens)
        recv = buf.numel() - own
        self.stats.bytes_received += recv
        self.stats.add_wire(self.link, cost.allgather_wire(own, buf.numel(), N))
        self.stats.collectives += 1
        self.stats.by_kind["allgather"] = self.stats.by_kind.get("allgather", 0) + 1
        per_tensor = [[frames[r][i] for r in range(N)] for i in range(pending.meta)]
        return per_tensor, nonfinite

    # ---- alltoall ------------------------------------------------------------------
    def start_alltoall(self, name: str, per_dest: List[List[torch.Tensor]], nonfinite,
                       lens: Optional[List[List[int]]] = None) -> Pending:
        """Send ``per_dest[j]`` (a list of uint8 payloads, the same count for every j) to rank j.
        ``lens[r]``: the payload sizes source r sends to this rank, when the receiver knows them."""
        N = self.size
        if len(per_dest) != N:
            raise ValueError(f"start_alltoall: {len(per_dest)} destinations for {N} ranks")
        n = len(per_dest[0]) if per_dest else 0
        bufs = [frame(p, nonfinite) for p in per_dest]
        flat = torch.cat(bufs)
        splits = [b.numel() for b in bufs]
        h = self.transport.alltoall_async(flat, splits, name)
        me = self.rank
        self.stats.bytes_sent += flat.numel() - splits[me]
        return Pending("alltoall", [h], n, {"splits": splits, "lens": lens})

    def finish_alltoall(self, pending: Pending) -> Tuple[List[List[torch.Tensor]], torch.Tensor]:
        """Return ``per_source[r]`` = the payloads rank r sent to this rank, and the global-so-far flag
        (a 0-d bool tensor: some source flagged a non-finite gradient)."""
        received, rsplits = self._wait(pending.handles[0])
        me, n = self.rank, pending.meta
        if rsplits is None:
            raise RuntimeError("hvd_ext exchange: the transport did not say how many bytes each rank sent")
        starts = [a for a, _ in offsets(rsplits)]
        out, nonfinite = unframe(received, starts, rsplits, n, pending.kind, pending.extra["lens"])
        recv = received.numel() - rsplits[me]
        sent = sum(pending.extra["splits"]) - pending.extra["splits"][me]
        self.stats.bytes_received += recv
        self.stats.add_wire(self.link, cost.alltoall_wire(sent, recv))
        self.stats.collectives += 1
        self.stats.by_kind["alltoall"] = self.stats.by_kind.get("alltoall", 0) + 1
        return out, nonfinite

    # ---- dense shards (node-aware exchange, inside a node) ------------------------------
    def start_reduce_scatter(self, name: str, flat: torch.Tensor, splits: Sequence[int], nonfinite) -> Pending:
        """Sum of every rank's ``flat`` (1-D float), piece j (``splits``) to rank j, as one alltoall
        (the bytes of a ring reduce-scatter: (N-1)/N x buffer out). Each piece carries one trailing
        flag element (some rank had a non-finite gradient)."""
        N = self.size
        splits = [int(x) for x in splits]
        if len(splits) != N or sum(splits) != flat.numel():
            raise ValueError(f"start_reduce_scatter: splits {splits} do not cover {flat.numel()} elements "
                             f"over {N} ranks")
        flag = _flag_element(nonfinite, flat.dtype, flat.device)
        parts, a = [], 0
        for sz in splits:
            parts += [flat[a:a + sz], flag]
            a += sz
        buf = torch.cat(parts)
        h = self.transport.alltoall_async(buf, [sz + 1 for sz in splits], name)
        esz = flat.element_size()
        me = self.rank
        sent = (buf.numel() - splits[me] - 1) * esz
        self.stats.bytes_sent += sent
        return Pending("reduce_scatter", [h], splits, {"sent": sent, "esz": esz})

    def finish_reduce_scatter(self, pending: Pending) -> Tuple[torch.Tensor, torch.Tensor]:
        """(this rank's piece of the sum, the flag: some rank of the group had a non-finite gradient)."""
        received, _ = self._wait(pending.handles[0])
        splits, me, N = pending.meta, self.rank, self.size
        k = splits[me] + 1
        pieces = received.view(N, k)
        total = pieces[0].clone()
        for r in range(1, N):  # in rank order: the same sum on every rank that holds the piece
            total.add_(pieces[r])
        flag = total[-1]
        nonfinite = (flag != 0) | ~torch.isfinite(flag)
        recv = (received.numel() - k) * pending.extra["esz"]
        self.stats.bytes_received += recv
        self.stats.add_wire(self.link, cost.alltoall_wire(pending.extra["sent"], recv))
        self.stats.collectives += 1
        self.stats.by_kind["reduce_scatter"] = self.stats.by_kind.get("reduce_scatter", 0) + 1
        return total[:-1], nonfinite

    def start_allgather_dense(self, name: str, shard: torch.Tensor) -> Pending:
        """Every rank's ``shard`` (1-D, sizes may differ), concatenated in rank order."""
        h = self.transport.allgather_async(shard.reshape(-1), name)
        own = shard.numel() * shard.element_size()
        self.stats.bytes_sent += own
        return Pending("allgather_dense", [h], None, {"own": own, "esz": shard.element_size()})

    def finish_allgather_dense(self, pending: Pending) -> torch.Tensor:
        out = self._wait(pending.handles[0])
        total = out.numel() * pending.extra["esz"]
        own = pending.extra["own"]
        self.stats.bytes_received += total - own
        self.stats.add_wire(self.link, cost.allgather_wire(own, total, self.size))
        self.stats.collectives += 1
        self.stats.by_kind["allgather"] = self.stats.by_kind.get("allgather", 0) + 1
        return out

    # ---- parameter averages, scalars, objects (sync strategies, optimizer) -----------
    def allreduce_average(self, tensors: List[torch.Tensor], name: str) -> Tuple[int, float]:
        """Average ``tensors`` in place over the ranks with ONE fused allreduce per dtype.
        Returns (payload bytes, seconds)."""
        return self.finish_average(self.start_average(tensors, name))

    def start_average(self, tensors: List[torch.Tensor], name: str) -> Pending:
        """Start :meth:`allreduce_average`; ``tensors`` hold the average after :meth:`finish_average`
        (on every rank, which must all start it). Work done meanwhile hides the collective's latency."""
        t0 = time.perf_counter()
        groups: Dict[torch.dtype, List[torch.Tensor]] = {}
        for t in tensors:
            groups.setdefault(t.dtype, []).append(t)
        nbytes, handles = 0, []
        for dtype, ts in sorted(groups.items(), key=lambda kv: str(kv[0])):
            flat = torch.cat([t.detach().reshape(-1) for t in ts])
            nb = flat.numel() * flat.element_size()
            nbytes += nb
            handles.append(self.transport.allreduce_async(flat, f"{name}.{str(dtype).split('.')[-1]}",
                                                          op="average"))
            self._count("allreduce", nb, nb, cost.allreduce_wire(nb, self.size))
        return Pending("average", handles, [ts for _, ts in sorted(groups.items(), key=lambda kv: str(kv[0]))],
                       {"bytes": nbytes, "seconds": time.perf_counter() - t0})

    def finish_average(self, pending: Pending) -> Tuple[int, float]:
        """Wait for :meth:`start_average` and write the averages. Returns (payload bytes, seconds spent
        starting and waiting)."""
        t0 = time.perf_counter()
        with torch.no_grad():
            for h, ts in zip(pending.handles, pending.meta):
                flat = self._wait(h)
                off = 0
                for t in ts:
                    k = t.numel()
                    t.copy_(flat[off:off + k].view_as(t))
                    off += k
        return pending.extra["bytes"], pending.extra["seconds"] + time.perf_counter() - t0

    def allreduce_scalar(self, value: float, name: str, op: str = "sum") -> float:
        """Sum (or ``op="average"``) of one float64 over the ranks."""
        t = torch.tensor([float(value)], dtype=torch.float64)
        out = self._wait(self.transport.allreduce_async(t, name, op=_op_name(op) if op != "adasum" else "sum"))
        self._count("allreduce", 8, 8, cost.allreduce_wire(8, self.size))
        return float(out.item())

    def allgather_object(self, obj: Any, name: str) -> List[Any]:
        """One picklable object per rank, in rank order."""
        t0 = time.perf_counter()
        out = self.transport.allgather_object(obj, name)
        self.stats.wait_s += time.perf_counter() - t0
        self.stats.collectives += 1
        return out

    def broadcast_(self, tensors: Sequence[torch.Tensor], root: int, name: str) -> int:
        """In place, every tensor of ``tensors`` takes rank ``root``'s values (all started, then
        waited for). Dtypes Horovod cannot broadcast (bfloat16, bool, complex, float8) travel as
        their bytes, so any tensor arrives bit-exact. Returns the payload bytes."""
        handles, nbytes = [], 0
        for i, t in enumerate(tensors):
            if not t.is_contiguous():
                raise ValueError(f"broadcast: tensor {i} of {name!r} is not contiguous (in-place broadcast "
                                 "needs contiguous storage; accepted: contiguous tensors, e.g. t.contiguous())")
            wire = t if t.dtype in BROADCAST_DTYPES else t.reshape(-1).view(torch.uint8)
            handles.append(self.transport.broadcast_async(wire, root, f"{name}.{i}"))
            nb = t.numel() * t.element_size()
            nbytes += nb
            self._count("broadcast", nb, nb, float(nb))
        for h in handles:
            self._wait(h)
        return nbytes

    def broadcast_object(self, obj: Any, root: int, name: str) -> Any:
        t0 = time.perf_counter()
        out = self.transport.broadcast_object(obj, root, name)
        self.stats.wait_s += time.perf_counter() - t0
        self.stats.collectives += 1
        return out


def _flag_element(nonfinite, dtype: torch.dtype, device) -> torch.Tensor:
    """The non-finite flag as one element of ``dtype`` (1 or 0) on ``device``, for a buffer that carries it."""
    if isinstance(nonfinite, torch.Tensor):
        return nonfinite.reshape(1).to(dtype)
    return torch.full((1,), 1.0 if nonfinite else 0.0, dtype=dtype, device=device)


def _any(flags: List[torch.Tensor]) -> torch.Tensor:
    if not flags:
        return torch.zeros((), dtype=torch.bool)
    return torch.stack(flags).any() if len(flags) > 1 else flags[0]
