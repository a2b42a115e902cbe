"""Node-aware (hierarchical, 2-D) exchange: dense inside a node, compressed across nodes.

On clusters of multi-GPU servers the links inside a server (NVLink, shared
memory) are an order of magnitude faster than the network between servers.
Horovod's hierarchical allreduce, BlueConnect (Cho et al., "BlueConnect:
decomposing all-reduce for deep learning on heterogeneous network
hierarchy", SysML 2019) and 2-D torus allreduce (Mikami et al. 2018) reduce
inside the node first and cross the network with only 1/L of the buffer per
rank; CGX (Markov et al., Middleware 2022) and Tang et al. ("1-bit Adam",
ICML 2021) compress only what crosses the slow link. This route does both,
for one bucket of n elements, L ranks per node, M nodes:

1. **intra-node reduce-scatter, dense**: the bucket (the tensors'
   compensated gradients concatenated) is cut into L shards; local rank l
   receives the node's sum of shard l (one alltoall among the node's ranks:
   (L-1)/L x 4n bytes per rank, on the fast link);
2. **inter-node, compressed**: local rank l adds its node memory (error
   feedback of the node-level compression, kept when the codec runs with
   error feedback), and exchanges shard l with local rank l of every other
   node through an existing route over the cross-node group: two-phase
   compressed allreduce, sparse reduce-scatter, allgather, or (linear codecs)
   allreduce. Every local rank carries 1/L of the bucket, so every node's L
   links / NIC queues work in parallel and the node's inter-node bytes are
   those of one compressed bucket, not L of them;
3. **intra-node allgather, dense**: the averaged shards are gathered inside
   the node ((L-1)/L x 4n bytes per rank).

Error feedback: what a rank contributes inside its node arrives exactly (the
intra phases are dense), so the worker's residual is zero; what the
node-level compression leaves out is remembered by the shard's holder
(``OwnerMemory`` key ``<tensor>@<offset>:node``), added to the next step's
shard, and the inner route's owner memory works as in the flat exchange.
Nothing is lost: the sum of every input equals the applied results plus the
node and owner memories.

The node and cross-node groups come from
:meth:`Exchange.node_exchanges` (on Horovod: masked alltoalls of the global
process set by default, or process sets; see :mod:`.transport`).

The non-finite flag rides with every phase (a trailing element of the dense
pieces, the inner route's headers), so every rank skips the same steps.
"""
from __future__ import annotations

import time
from typing import List

import torch

from ...compression.base import TensorInfo
from ...ops.device import nonfinite as nonfinite_flag
from ..transport import offsets, split_sizes
from .base import NODE_PREFIX, Route, TensorRecord, flat_record, make_route, register, segments, split_flat

@register
class NodeAwareRoute(Route):
    """Dense reduce-scatter in the node -> ``inner`` route across nodes on 1/L of the bucket ->
    dense allgather in the node. Registered as ``"node"``; an instance's ``name`` is ``"node:<inner>"``."""

    name = "node"

    def __init__(self, comp, exchange, tag, memory=None, inner: str = "allgather"):
        super().__init__(comp, exchange, tag, memory)
        self.local_ex, self.cross_ex = exchange.node_exchanges()
        self.inner_kind = inner
        self.name = NODE_PREFIX + inner
        self.inner = make_route(inner, comp, self.cross_ex, f"{tag}.x", memory)
        self._use_mem = (memory is not None and getattr(comp.feedback, "name", "none") != "none")
        self._rs = None
        self._inner_started = False
        self._flat = False

    # ---- phase 1: dense reduce-scatter inside the node ---------------------------------------
    def start(self, records, nonfinite):
        lex = self.local_ex
        L = lex.size
        self.records = records
        sizes = [r.u.numel() for r in records]
        self.dtype = torch.float64 if any(r.u.dtype == torch.float64 for r in records) else torch.float32
        dev = records[0].u.device if records else torch.device("cpu")
        self.device = dev
        flat = (torch.cat([r.u.reshape(-1).to(self.dtype) for r in records]) if records
                else torch.empty(0, dtype=self.dtype, device=dev))
        self.shard_sizes = split_sizes(flat.numel(), L)
        self.segs = segments(sizes, L)
        self._rs = lex.start_reduce_scatter(f"hvd_ext.nrs.{self.tag}", flat, self.shard_sizes, nonfinite)
        self._inner_started = False

    # ---- phase 2: this rank's shard across the nodes, compressed ----------------------------------
    def progress(self):
        if self._inner_started:
            return
        shard, nf = self.local_ex.finish_reduce_scatter(self._rs)
        t0 = time.perf_counter()
        me = self.local_ex.rank
        cex = self.cross_ex
        inner: List[TensorRecord] = []
        off = 0
        for (i, a, b) in self.segs[me]:
            rec = self.records[i]
            seg = shard[off:off + (b - a)]
            off += b - a
            ri = rec.info
            name = f"{rec.name}@{a}:node"
            param = ri.param.reshape(-1)[a:b] if ri.param is not None else None
            info = TensorInfo(name=name, shape=torch.Size([b - a]), step=ri.step, rank=cex.rank, size=cex.size,
                              param=param, scale=cex.scale(), base_name=ri.base_name)
            u = seg.float() if self.comp.collective != "allreduce" else seg.to(rec.u.dtype)
            if self._use_mem:
                u = u + self.memory.get(name, u)
            inner.append(TensorRecord(name, rec.param, info, u))
        self._nf1 = nf
        self.inner_records = inner
        # the shard as one flat payload (as the pipeline does for a bucket); memories stay per segment
        flat = flat_record(self.comp, self.inner.name, inner, f"\x00node.{self.tag}")
        self._flat = flat is not None
        send = [flat] if self._flat else inner
        code0 = self.inner.code_s
        self.inner.start(send, nf)
        self.code_s += time.perf_counter() - t0 - (self.inner.code_s - code0)
        self._inner_started = True

    # ---- phase 3: dense allgather of the averaged shards inside the node --------------------------
    def finish(self):
        self.progress()
        code0 = self.inner.code_s
        self.inner.progress()
        results, _, nf = self.inner.finish()
        self.code_s += self.inner.code_s - code0
        t0 = time.perf_counter()
        sents = None
        if self._flat:
            results = split_flat(results[0], self.inner_records)
            if self._use_mem:  # a bucket_flat codec's contribution does not depend on the result
                sents = split_flat(self.inner.sent(0, None), self.inner_records)
        scale = self.exchange.scale()
        parts = [r.reshape(-1).to(self.dtype) for r in results]
        mine = (torch.cat(parts) if parts else torch.empty(0, dtype=self.dtype, device=self.device)) * scale
        # linear codecs: a NaN/Inf reaches the reduced values, not a flag
        nf = nf | self._nf1 | nonfinite_flag([mine], mine.device)
        if self._use_mem:  # staged: the pipeline drops it when the step is skipped
            for k, rec in enumerate(self.inner_records):
                sent = self.inner.sent(k, results[k]) if sents is None else sents[k]
                self.memory.stage(rec.name, (rec.u - sent.reshape(rec.u.shape).to(rec.u.dtype)).detach())
        flag = nf.reshape(1).to(self.dtype)
        self.code_s += time.perf_counter() - t0
        pend = self.local_ex.start_allgather_dense(f"hvd_ext.nag.{self.tag}", torch.cat([mine, flag]))
        got = self.local_ex.finish_allgather_dense(pend)
        t0 = time.perf_counter()
        pieces, flags, a = [], [], 0
        for sz in self.shard_sizes:
            pieces.append(got[a:a + sz])
            flags.append(got[a + sz])
            a += sz + 1
        nf = nf | (torch.stack(flags) != 0).any() if flags else nf
        flat = torch.cat(pieces) if pieces else got[:0]
        outs = []
        for (a, b), rec in zip(offsets([r.u.numel() for r in self.records]), self.records):
            outs.append(flat[a:b].float() if self.dtype != torch.float64 else flat[a:b])
        self.code_s += time.perf_counter() - t0
        self.inner.records = []
        self._rs = None
        self._inner_started = False
        return outs, [None] * len(outs), nf

    def sent(self, i: int, result: torch.Tensor) -> torch.Tensor:
        """Everything: the intra-node phases are dense (the node memory keeps what the node-level
        compression left out)."""
        return self.records[i].u
