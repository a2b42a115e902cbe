"""The Compressor interface and the registry behind ``compression_from_spec``.

A compressor is pure tensor-in / payload-out code: it never communicates.
It declares which collective its payload rides on:

* ``collective = "allreduce"`` -- linear codecs (none, fp16, bf16, PowerSGD factors):
  ``compress`` returns a 1-D tensor whose elementwise reduction (Horovod
  Average or Sum) is meaningful; ``decompress`` turns the *reduced* payload back
  into a dense tensor, or returns ``Continue(payload, ctx)`` to ask for one more
  allreduce round (PowerSGD's P then Q).
* ``collective = "allgather"`` -- non-linear codecs (top-k, quantized codes):
  ``compress`` returns a 1-D ``torch.uint8`` tensor (exact wire bytes);
  ``aggregate`` turns every rank's bytes into the dense *sum* of their
  contributions (the exchange then applies the averaging factor).

After the exchange, ``local_contribution`` says what this rank's payload
amounted to (dense), which error feedback subtracts from what it meant to send.

Compressors are registered by name with ``@register("name")``; their options
are declared as :class:`hvd_ext.options.Option` so specs are validated before
any collective starts. Learned from GRACE's ``grace_dl/torch`` (one compressor a
module, memory and communication kept apart).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Dict, List, Optional, Sequence, Tuple, Type

import torch

from ..options import Option, resolve_options
# The options every codec takes (route, hierarchy, variance, warm-up), parsed once by Compressor.__init__.
from .common import COLLECTIVES, COMMON_ALIASES, COMMON_OPTIONS, HIERARCHY_CHOICES, ROUTE_CHOICES  # noqa: F401


@dataclass
class TensorInfo:
    """What a compressor may know about the tensor it compresses.

    All of it is identical on every rank (names, shapes, the step counter), so
    decisions taken from it are consistent -- except ``param`` which is the
    local parameter value (identical across ranks under synchronous training).

    ``scale`` is the factor the exchange applies to the sum over ranks (1/N for
    Average; None when unknown, read as 1/N). ``sparse_indices`` is set by
    sparse compressors to the coordinates they selected (DGC masking reads it).
    ``base_name`` names the whole tensor when ``name`` names one shard of it
    (two-phase exchange): per-layer decisions (qdist bit budgets) use it.
    """

    name: str
    shape: torch.Size
    step: int = 0
    rank: int = 0
    size: int = 1
    param: Optional[torch.Tensor] = None
    scale: Optional[float] = None
    sparse_indices: Optional[torch.Tensor] = None
    base_name: Optional[str] = None
    # (payload, indices, values as decoded): what a sparse codec just packed, so decoding its own
    # payload again (error feedback, the aggregate) is a lookup, not an unpack
    sent_entries: Optional[Tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None
    # (name, numel, parameter) of each tensor a flat bucket record concatenates (``bucket_flat`` codecs)
    segments: Optional[List[Tuple[str, int, Optional[torch.Tensor]]]] = None

    def __post_init__(self):
        if self.base_name is None:
            self.base_name = self.name

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= int(s)
        return n


@dataclass
class Continue:
    """Returned by ``decompress`` to request another allreduce round."""

    payload: torch.Tensor
    ctx: Any = None


class Compressor:
    """Base class. Subclasses set ``name``, ``collective``, ``options`` and implement the codec.

    ``collective`` is the collective a payload rides on; "exchange" names only the spec key that
    picks a route (``exchange=allgather|twophase``, kept as ``route``) and the
    :class:`hvd_ext.exchange.Exchange` that makes collectives."""

    name: ClassVar[str] = "?"
    collective: ClassVar[str] = "allreduce"
    options: ClassVar[Dict[str, Option]] = {}
    # Spec name of the feedback used when the spec does not say ``feedback=``.
    default_feedback: ClassVar[str] = "none"
    # Feedback names this compressor accepts (None = any registered feedback).
    accepted_feedback: ClassVar[Optional[Tuple[str, ...]]] = None
    # True when every rank's payload has the same size for a given tensor (see ``sizes_agree``).
    fixed_size: ClassVar[bool] = True
    # True when ``compress`` reads values from the device (a size or a budget that depends on the
    # data): on a GPU such a bucket starts after backward, or on the overlap worker, never inside a
    # backward hook, where the wait would stop the CPU from queueing the rest of backward.
    reads_device: ClassVar[bool] = False
    # Index+value codecs: scale out by sparse reduce-scatter (hvd_ext.exchange.routes.sparse_rs).
    sparse: ClassVar[bool] = False
    # Two-phase exchange: the shard owner keeps an error-feedback memory of its re-compression.
    owner_feedback: ClassVar[bool] = True
    # Linear codecs: the dtype the payload is summed in (None: not an elementwise cast), and whether
    # the payload can be cut into shards elementwise -- the node-aware route's dense reduce-scatter
    # inside a node needs it (PowerSGD's factors cannot be cut).
    wire_dtype: ClassVar[Optional[torch.dtype]] = None
    shardable: ClassVar[bool] = False
    # True when the codec sends one payload per bucket rather than per tensor (topk scope=model, sig: a
    # budget spanning tensors) on the routes that carry whole payloads (allgather, sparse_rs).
    bucket_flat: ClassVar[bool] = False
    # Old spellings of this codec's own option keys: {old key: key} (PowerSGD's start_step is warmup).
    aliases: ClassVar[Dict[str, str]] = {}
    # The common options (.common) a codec built without ``Compressor.__init__`` holds (a Horovod-style
    # codec the optimizer wraps): no node-aware trial, no warm-up of its own.
    route: str = "auto"
    hierarchy: str = "auto"
    hierarchy_trial: int = 0
    variance: str = "auto"
    warmup: Optional[int] = None
    # True when decode(encode(g)) == g up to float rounding (none, fp16, bf16): no error feedback, and an
    # adaptive optimizer's second moment is left live (hvd_ext.variance_freeze).
    lossless: ClassVar[bool] = False
    # compress/decompress treat each element alone and keep no state (none, the casts): a bucket may
    # go as one flat tensor (the DDP hook's buffer, GradientPipeline.takes_flat)
    elementwise: ClassVar[bool] = False
    # True when nothing keeps a decoded result past the step (none, fp16, bf16): the exchange may then
    # reuse its fused buffers from step to step instead of allocating them anew.
    transient_results: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        legacy = cls.__dict__.get("exchange")
        if isinstance(legacy, str):  # a codec written against the attribute's old name
            cls.collective = legacy

    def __init__(self, **kwargs):
        """``kwargs``: this codec's ``options`` and the common ones (:mod:`.common`), checked in one pass
        so an unknown key is named with everything accepted."""
        owner = f"compressor '{self.name}'"
        given = resolve_options(owner, {**self.options, **COMMON_OPTIONS}, kwargs,
                                aliases={**COMMON_ALIASES, **self.aliases})
        self.opts = {k: given[k] for k in self.options}
        self.common = {k: given[k] for k in COMMON_OPTIONS}
        for k, v in given.items():
            setattr(self, k, v)
        self.feedback = None  # set by compression_from_spec / DistributedOptimizer
        self.validate()
        if self.collective == "allreduce" and self.route != "auto":  # e.g. randomk:shared=1
            raise ValueError(f"{owner}: bad value {self.route!r} for 'route': with these options it rides on "
                             "allreduce; accepted: auto")

    def default_warmup(self, frozen_moment: bool) -> int:
        """Dense exchanges before the codec when the spec gives no ``warmup=``. ``frozen_moment``: an
        adaptive optimizer's second moment will be frozen when the warm-up ends. Default 0: a moment
        frozen from the first, largest gradients keeps the bursts of error feedback in check."""
        return 0

    def noise_inflates_live_moment(self) -> bool:
        """True when this codec, although it keeps no error-feedback memory, is known to cost accuracy
        under an adaptive optimizer whose second moment stays live (its noise inflates the moment):
        ``variance=auto`` then freezes the moment for it too (:mod:`hvd_ext.variance_freeze`).
        Default: False."""
        return False

    def warmup_length(self, frozen_moment: bool = False) -> int:
        """The dense warm-up this codec runs: ``warmup=`` if given, else ``default_warmup``."""
        return int(self.warmup) if self.warmup is not None else int(self.default_warmup(frozen_moment))

    def own_warmup(self) -> int:
        """Exchanges this codec sends dense by itself at the start, whoever runs it (a candidate of
        ``auto`` too); the pipeline's dense warm-up of a fixed codec (:meth:`warmup_length`) is apart."""
        return 0

    def validate(self) -> None:
        """Cross-option checks; raise ValueError naming the problem."""

    def bind_optimizer(self, optimizer) -> None:
        """Called once by ``hvd_ext.DistributedOptimizer`` with the wrapped torch optimizer,
        before any collective. A compressor that owns part of the update rule (DGC's momentum
        correction) checks or adapts the optimizer here, and raises ``ValueError`` or warns
        with the exact fix when the combination cannot work. Default: pass it on to the
        feedback (``Feedback.bind_optimizer``; momentum-correcting feedbacks take over SGD
        momentum there)."""
        bind = getattr(self.feedback, "bind_optimizer", None)
        if bind is not None:
            bind(optimizer)

    def prepare_bucket(self, items: List[Tuple[torch.Tensor, "TensorInfo"]]) -> None:
        """Before the tensors of one bucket are compressed together: plan what spans them (a budget
        across tensors) with at most one device read for them all. Default: nothing."""

    # ---- codec -------------------------------------------------------------
    def compress(self, tensor: torch.Tensor, info: TensorInfo) -> Tuple[torch.Tensor, Any]:
        raise NotImplementedError

    def decompress(self, payload: torch.Tensor, ctx: Any, info: TensorInfo):
        """allreduce codecs: reduced payload -> dense tensor (shape ``info.shape``) or ``Continue``."""
        raise NotImplementedError

    def decode(self, data: torch.Tensor, ctx: Any, info: TensorInfo) -> torch.Tensor:
        """allgather codecs: one rank's bytes -> its dense contribution (flat, float32)."""
        raise NotImplementedError

    def aggregate(self, datas: List[torch.Tensor], ctx: Any, info: TensorInfo) -> torch.Tensor:
        """allgather codecs: all ranks' bytes -> dense *sum* of contributions (flat).

        The default decodes one rank at a time into a single accumulator, so
        it never holds N dense copies."""
        out = None
        for d in datas:
            dense = self.decode(d, ctx, info)
            out = dense.clone() if out is None else out.add_(dense)
        return out

    def recompress(self, tensor: torch.Tensor, info: TensorInfo) -> Tuple[torch.Tensor, Any]:
        """allgather codecs, two-phase exchange: compress the averaged shard at its owner.
        Default: ``compress`` (stateful codecs override it to skip their per-worker state)."""
        return self.compress(tensor, info)

    def sparse_entries(self, payload: torch.Tensor, ctx: Any, info: TensorInfo) -> Tuple[torch.Tensor, torch.Tensor]:
        """Sparse codecs: (int64 indices, float32 values) of one payload. Default: decode, keep non-zeros."""
        dense = self.decode(payload, ctx, info)
        idx = dense.nonzero().squeeze(1)
        return idx, dense[idx]

    def support(self, datas: List[torch.Tensor], ctx: Any, info: TensorInfo) -> Optional[torch.Tensor]:
        """allgather codecs: boolean mask (flat) of coordinates some rank sent, or None if unknown.
        Used by feedbacks that predict unsent coordinates (``ewma``)."""
        return None

    def local_contribution(self, payload: torch.Tensor, ctx: Any, info: TensorInfo,
                           result: torch.Tensor) -> torch.Tensor:
        """Dense value of what this rank sent (used by error feedback).

        ``result`` is the exchanged (averaged) dense tensor; multi-round codecs
        such as PowerSGD use it. Default: decode our own payload."""
        if self.collective == "allgather":
            return self.decode(payload, ctx, info)
        out = self.decompress(payload, ctx, info)
        if isinstance(out, Continue):
            raise NotImplementedError(f"{self.name}: multi-round codec must override local_contribution")
        return out

    # ---- accounting ----------------------------------------------------------
    def payload_size(self, info: TensorInfo, recoded: bool = False) -> Optional[int]:
        """The exact bytes of the payload ``compress`` (``recoded``: ``recompress``, a two-phase owner's)
        makes for ``info`` when the shape and the step alone decide it -- then every rank knows every
        rank's size and nothing is read from the device on receipt -- else None. Default: ``wire_bytes``
        of a ``fixed_size`` codec."""
        return self.wire_bytes(info.numel) if self.fixed_size else None

    def rounds(self, info: TensorInfo) -> int:
        """How many allreduce rounds exchanging ``info``'s tensor takes on the allreduce route: each
        after the first is asked for by ``decompress`` returning ``Continue`` (PowerSGD: 2). Default 1.
        A codec that returns ``Continue`` says so here: the route then starts its later rounds early."""
        return 1

    def round_bytes(self, info: TensorInfo) -> Optional[List[int]]:
        """The payload bytes of each of :meth:`rounds`' rounds for ``info``'s tensor, where there are
        several and the shape decides them (the planner prices the later ones after backward), else None."""
        return None

    def wire_bytes(self, numel: int) -> Optional[int]:
        """Exact payload bytes for a tensor of ``numel`` elements, if fixed (else None)."""
        return None

    def expected_piece_bytes(self, numels: Sequence[int],
                             pieces: Sequence[Sequence[int]]) -> Optional[List[List[float]]]:
        """The payload bytes each piece of each tensor of a bucket is expected to take (tensor i has
        ``numels[i]`` elements, coded in pieces of ``pieces[i]`` elements, as a two-phase route cuts
        it), where the data decide them -- the cost model prices with it -- or None; default:
        :meth:`wire_bytes` of every piece."""
        out = [[self.wire_bytes(int(k)) for k in ps] for ps in pieces]
        return None if any(b is None for ps in out for b in ps) else [[float(b) for b in ps] for ps in out]

    # ---- state (part of the optimizer checkpoint) ------------------------------
    def commit(self) -> None:
        """Called after a step whose gradients were finite on every rank: make staged state current."""

    def discard(self) -> None:
        """Called after a step skipped for a non-finite gradient on some rank: drop staged state."""

    def state_dict(self) -> Dict[str, Any]:
        return {}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        pass

    def spec(self) -> str:
        return self._spec(common=True)

    def codec_spec(self) -> str:
        """:meth:`spec` without the common options (:mod:`.common`: the route, the node-aware exchange,
        the warm-up...), which leave one pass of the codec as it is: the key a calibration file times
        the codec under (:func:`hvd_ext.exchange.calibration.codec_timing`)."""
        return self._spec(common=False)

    def _spec(self, common: bool) -> str:
        items = [f"{k}={v}" for k, v in getattr(self, "opts", {}).items() if v != self.options[k].default]
        if common:
            items += [f"{k}={v}" for k, v in getattr(self, "common", {}).items() if v != COMMON_OPTIONS[k].default]
        fb = getattr(self, "feedback", None)
        if fb is not None:
            if fb.name != self.default_feedback:
                items.append(f"feedback={fb.name}")
            items += [f"{k}={v}" for k, v in fb.opts.items() if v != fb.options[k].default]
        return self.name + (":" + ",".join(items) if items else "")

    def __repr__(self) -> str:
        return f"<hvd_ext compressor {self.spec()}>"


_REGISTRY: Dict[str, Type[Compressor]] = {}


def register(name: str):
    """Class decorator: make a compressor available to ``compression_from_spec``."""

    def deco(cls: Type[Compressor]) -> Type[Compressor]:
        if name in _REGISTRY:
            raise RuntimeError(f"compressor {name!r} registered twice")
        if cls.collective not in COLLECTIVES:
            raise RuntimeError(f"{cls.__name__}.collective must be one of {COLLECTIVES}")
        cls.name = name
        shared = sorted(set(cls.options) & set(COMMON_OPTIONS))
        if shared:
            raise RuntimeError(f"{cls.__name__} declares {shared}: every codec takes these (compression.common)")
        _REGISTRY[name] = cls
        return cls

    return deco


def registry() -> Dict[str, Type[Compressor]]:
    return dict(_REGISTRY)


# ---- byte helpers shared by allgather codecs ---------------------------------------

def as_bytes(*tensors: torch.Tensor) -> torch.Tensor:
    """Concatenate tensors' raw bytes into one flat uint8 tensor (no padding)."""
    parts = [t.contiguous().reshape(-1).view(torch.uint8) for t in tensors if t.numel() > 0]
    if not parts:
        return torch.empty(0, dtype=torch.uint8)
    return torch.cat(parts)


def from_bytes(data: torch.Tensor, offset: int, dtype: torch.dtype, count: int) -> Tuple[torch.Tensor, int]:
    """Read ``count`` elements of ``dtype`` at byte ``offset`` of a uint8 tensor.

    Copies when the offset is not aligned for ``dtype``. Returns (tensor, new offset)."""
    itemsize = dtype.itemsize
    nbytes = count * itemsize
    chunk = data[offset:offset + nbytes]
    if chunk.numel() != nbytes:
        raise ValueError(f"payload truncated: wanted {nbytes} bytes at offset {offset}, have {data.numel() - offset}")
    if chunk.storage_offset() % itemsize:
        chunk = chunk.clone()
    return chunk.view(dtype), offset + nbytes
