"""signSGD with majority vote (Bernstein et al. 2018, "signSGD: Compressed Optimisation for
Non-Convex Problems"; Bernstein et al. 2019, "signSGD with Majority Vote is Communication
Efficient and Fault Tolerant").

Each rank sends one sign bit per coordinate (bit 1 for ``g_i >= 0``, 0 for
``g_i < 0``), exchanged by allgather; every rank then votes: the applied
update is ``sign(sum_r sign_r)`` (0 on ties), times a magnitude.

The magnitude (``scale``): the papers apply the bare vote (+-1 per
coordinate) with a learning rate tuned for it (~1e-4). Inside a user's own
loop (SGD lr 0.05 with momentum, or Adam) a +-1 step per coordinate blows the
model up, so by default (``scale=l1``) each rank also sends, for every
``bucket`` consecutive coordinates, the mean |g| of its chunk, and the vote of a
chunk is scaled by the ranks' mean of those scales: the applied update has the
gradient's magnitude, as in EF-signSGD's scaled sign (Karimireddy et al. 2019)
and 1-bit Adam's compensated sign (Tang et al. 2021). ``scale=none`` is the
papers' bare vote (tune the learning rate down). ``bucket=0``: one scale per
tensor. ``aggregate`` returns ``N * scaled vote`` so that the exchange's
averaging (1/N) yields exactly the scaled vote. No error feedback by default
(the paper has none).

Momentum: under a ``torch.optim.SGD`` optimizer with momentum m, the momentum
is taken over and the sign is taken of the velocity ``u <- m u + g`` (Signum,
Bernstein et al. 2018; the optimizer's momentum is set to 0, with a warning):
applied after the vote, momentum integrates the sign noise of small
coordinates and the model collapses. With ``torch.optim.SGD`` at momentum 0, or Adam,
signsgd sends the sign of the gradient.

Wire bytes (allgather, fixed size): ``4 * chunks + ceil(n / 8)`` with
``scale=l1`` (chunks = ``ceil(n / bucket)``, 1 for ``bucket=0``);
``ceil(n / 8)`` with ``scale=none``.

Kernels (``hvd_ext.ops.cuda_kernels``): the bits are made by ``kernels.sign_pack`` (same
convention: bit 1 iff ``x >= 0``, NaN -> 0) and read by ``kernels.unpack_bits``;
on CUDA the vote is ``kernels.majority_vote`` (tie -> +1 there, so for an even
number of ranks the vote of the complemented bits is subtracted to get this
module's tie -> 0 exactly). CPU / forced reference: the torch code below.
"""
from __future__ import annotations

import warnings

import torch

from ..ops import cuda_kernels as _K
from ..ops.device import on_host
from ..options import Option, non_negative
from ..ops import cpu_kernels as _cpu
from ._quant import chunk_means, chunks, expand_chunks
from ..feedback.base import give_back_momentum
from .base import Compressor, as_bytes, from_bytes, register
from ..ops.bits import packed_bytes

#: ``scale`` and ``bucket`` options of the majority-vote codecs (signsgd, signum).
VOTE_OPTIONS = {
    "scale": Option(str, "l1", choices=("l1", "none"),
                    help="l1: the vote of a chunk is scaled by the ranks' mean |g| over it; none: bare +-1"),
    "bucket": Option(int, 128, "integer >= 0 (0 = one scale per tensor)", non_negative,
                     help="coordinates per scale (scale=l1)"),
}


def sign_bits(flat: torch.Tensor) -> torch.Tensor:
    """ceil(n/8) bytes, bit 1 where ``flat >= 0`` (kernel on CUDA float32, else bitpack)."""
    return _K.sign_pack(flat)


def bits_to_sign(data: torch.Tensor, n: int) -> torch.Tensor:
    return _K.unpack_bits(data, 1, n).float() * 2 - 1


def vote_sum(datas, n: int) -> torch.Tensor:
    """``sign(sum_r (2 bit_r - 1)) * N`` (0 on ties), float32, from N ``sign_bits`` payloads."""
    N = len(datas)
    if N and all(d.dtype == torch.uint8 for d in datas) and _K.backend(*datas) == "cuda":
        mv = _K.majority_vote(datas, n)                 # +1 where 2*ones >= N, else -1
        if N % 2 == 0:                                   # ties possible: make them 0
            mv = mv.sub_(_K.majority_vote([torch.bitwise_not(d) for d in datas], n)).mul_(0.5)
        return mv.mul_(N)
    votes = None
    for d in datas:
        s = bits_to_sign(d, n)
        votes = s if votes is None else votes.add_(s)
    return torch.sign(votes).mul_(N)


# ---- fused CPU paths (see ``ops.cpu_kernels``) -------------------------------------------------------------

def _chunked(x, c: int):
    """(k, c) view of flat x, zero-padded at the end when c does not divide its length."""
    n = x.numel()
    k = (n + c - 1) // c
    if k * c != n:
        x = torch.nn.functional.pad(x, (0, k * c - n))
    return x.view(k, c)


def _sign_encode(x, codes_out, *, c: int, scales: bool):
    """One-byte sign codes (1 iff x >= 0; NaN -> 0) to ``codes_out``; with ``scales``, the mean |x|
    of every chunk of c coordinates (the last one over its own length) in the same pass."""
    x = x.to(torch.float32)
    codes_out.copy_(torch.where(x >= 0, 1.0, 0.0).to(torch.uint8))  # (bool -> uint8 is not vectorised)
    if not scales:
        return None
    n = x.numel()
    sums = _chunked(x.abs(), c).sum(1)
    k = sums.numel()
    counts = torch.full((k,), float(c), device=x.device)
    if k * c != n:
        counts = torch.cat([counts[:-1], torch.full((1,), float(n - (k - 1) * c), device=x.device)])
    return sums / counts


def _expand(v, scales, c: int):
    """v (flat, whole chunks of c coordinates) times one scale per chunk."""
    return (v.view(-1, c) * scales.view(-1, 1)).reshape(-1)


def _vote(out, codes_list, scale_list, *, c: int, vote: bool):
    """out = N * sign(sum_r sign_r) (0 on ties) [times the ranks' mean scale per chunk], or, with
    ``vote=False``, sum_r sign_r [times rank r's scale per chunk]."""
    N = len(codes_list)
    if vote:
        cnt = codes_list[0].to(torch.int32)
        for b in codes_list[1:]:
            cnt = cnt + b.to(torch.int32)
        v = torch.sign((2 * cnt - N).to(torch.float32)) * N
        if scale_list:
            mean = scale_list[0]
            for sc in scale_list[1:]:
                mean = mean + sc
            v = _expand(v, mean / N, c)
        out.copy_(v)
        return
    acc = None
    for r, b in enumerate(codes_list):
        x = b.to(torch.float32) * 2 - 1
        if scale_list:
            x = _expand(x, scale_list[r], c)
        acc = x if acc is None else acc + x
    out.copy_(acc)


SIGN_ENCODE = _cpu.Kernel(_sign_encode, "sign encode")
VOTE = _cpu.Kernel(_vote, "sign decode")


def sign_compress_cpu(x, bucket: int, scales: bool, purpose: str):
    """(per-chunk mean |x| or None, packed sign bits) of a flat CPU tensor, fused."""
    n = x.numel()
    buf = _cpu.codes_buffer(purpose, n, x.device)
    s = SIGN_ENCODE(n, x.device, x, buf[:n], c=bucket if bucket > 0 else max(n, 1), scales=scales)
    return s, _cpu.pack_buffer(buf, n, 1)


def sign_aggregate_cpu(bit_list, scale_list, n: int, bucket: int, vote: bool, purpose: str):
    """Dense result of N ranks' sign payloads (see ``_vote``), fused; bit_list: packed sign bits."""
    dev = bit_list[0].device
    c = bucket if bucket > 0 else max(n, 1)
    total = scale_list[0].numel() * c if scale_list else n  # whole chunks; the padding is dropped below
    codes = [_cpu.padded(_cpu.unpack_to_buffer(b, 1, n, f"{purpose}/{r}"), total, f"{purpose}/pad{r}")
             for r, b in enumerate(bit_list)]
    out = _cpu.empty(total, device=dev)
    VOTE(n, dev, out, codes, list(scale_list), c=c, vote=vote)
    return out[:n]


class MajorityVote(Compressor):
    """Sign bits (and, with ``scale=l1``, one float32 scale per chunk) out, majority vote in."""

    collective = "allgather"
    options = VOTE_OPTIONS
    owner_feedback = False  # the owner's vote is already a (scaled) sign: nothing to remember

    def __init__(self, **kw):
        super().__init__(**kw)
        self.beta = float(self.opts.get("beta", 0.0))  # signum declares beta; signsgd: 0 unless taken over
        self.momentum = {}
        self._staged = {}
        self._explicit_beta = "beta" in kw
        self._optimizer = None
        self._checked_step = None
        self._held = None   # the optimizer's momentum per parameter group, while this compressor holds it

    def bind_optimizer(self, optimizer):
        """The sign is taken of the momentum (Signum): take over a ``torch.optim.SGD`` optimizer's
        momentum (beta = its momentum unless the spec sets ``beta=``; the optimizer's is set to 0,
        with a warning), so momentum is not applied to the noisy signs afterwards (under the
        optimizer's momentum the scaled vote first climbs, then collapses). An optimizer with its own
        first moment (Adam's ``betas``) keeps it: the sign is then taken of the gradient (beta=0
        unless the spec sets it), since a second momentum on top of Adam's converges far worse.
        As one of ``auto``'s candidates it leaves the optimizer alone (the other candidates need its
        momentum) and is marked ``needs_compressed_momentum`` under an SGD momentum: auto does not
        choose it then."""
        if getattr(self.feedback, "shared_by_candidates", False):
            self.needs_compressed_momentum = (isinstance(optimizer, torch.optim.SGD) and any(
                float(g.get("momentum", 0) or 0) for g in optimizer.param_groups))
            return
        if isinstance(optimizer, torch.optim.SGD):
            self._optimizer = optimizer
            self._take_over(announce=True)
        elif self.beta and not self._explicit_beta and any("betas" in g for g in optimizer.param_groups):
            warnings.warn(f"hvd_ext {self.name}: {type(optimizer).__name__} keeps its own momentum (betas), so "
                          f"{self.name} sends the sign of the gradient (beta=0 instead of {self.beta}). Put "
                          f"beta= in the compression spec to force a momentum here too.", stacklevel=3)
            self.beta = 0.0

    def _take_over(self, announce=False):
        found = sorted({float(g.get("momentum", 0) or 0) for g in self._optimizer.param_groups} - {0.0})
        if not found:
            return
        self._held = [float(g.get("momentum", 0) or 0) for g in self._optimizer.param_groups]
        for g in self._optimizer.param_groups:
            g["momentum"] = 0.0
        if announce:
            warnings.warn(f"hvd_ext {self.name}: took over the optimizer's momentum {found[-1]}: the optimizer now "
                          f"runs with momentum=0 and {self.name} takes the sign of the momentum (beta="
                          f"{self.beta if self._explicit_beta else found[-1]}) is applied before the sign. "
                          f"To silence this, create the optimizer with momentum=0.", stacklevel=3)
        if not self._explicit_beta:
            self.beta = found[-1]

    def hand_back_momentum(self) -> None:
        """Steps that bypass this compressor (the gradient exchange off between parameter averages, a
        dense warm-up) still need the momentum: give each parameter group back what was taken from it,
        once, and drop its stale momentum buffer. The next step through here takes it over again."""
        opt, held, self._held = self._optimizer, self._held, None
        if opt is None or held is None or len(held) != len(opt.param_groups):
            return
        self._checked_step = None
        give_back_momentum(opt, held)

    def _vector(self, tensor, info):
        if self._optimizer is not None and info.step != self._checked_step:
            self._checked_step = info.step  # once per step: a scheduler may have set momentum again
            self._take_over()
        g = tensor.reshape(-1).float()
        if not self.beta:
            return g  # signSGD: the sign of the gradient itself, no state
        m = self.momentum.get(info.name)
        if m is None or m.shape != g.shape or m.device != g.device:
            m = torch.zeros_like(g)
        new = m * self.beta + g * (1 - self.beta)
        self._staged[info.name] = new
        # sign(new) is Signum's; with scale=l1 the magnitude is mean|new| / (1 - beta), the size
        # of a momentum-SGD step (sum of beta^k g), so the user's SGD learning rate fits.
        return new / (1 - self.beta) if self.scale == "l1" else new

    def commit(self):
        self.momentum.update(self._staged)
        self._staged = {}

    def discard(self):
        self._staged = {}

    def state_dict(self):
        return {"momentum": {k: v.clone() for k, v in self.momentum.items()}, "beta": self.beta,
                "held": None if self._held is None else list(self._held)}

    def load_state_dict(self, state):
        """The momenta, and what was taken from the optimizer (an optimizer restored before it is
        wrapped already has momentum 0: nothing is left to take)."""
        self.momentum = {k: v.clone() for k, v in state.get("momentum", {}).items()}
        self._staged = {}
        if state.get("held") is not None:
            self._held = [float(m) for m in state["held"]]
            if not self._explicit_beta:
                self.beta = float(state.get("beta", self.beta))

    def _nscales(self, n: int) -> int:
        return chunks(n, self.bucket) if self.scale == "l1" else 0

    def recompress(self, tensor, info):
        """Two-phase exchange: the owner re-sends its shard's vote as signs (with ``scale=l1`` and the
        chunk means of |vote|, a tie counting 0); a tied vote (0) becomes a fair coin drawn from the
        counter hash, so the shard stays unbiased where one bit cannot say 0."""
        v = tensor.reshape(-1).float()
        coin = _cpu.uniform(v.numel(), _cpu.stream_key_tensor(0, info.name, info.rank, info.step), v.device) < 0.5
        bits = sign_bits(torch.where(v == 0, torch.where(coin, 1.0, -1.0), v))
        if self.scale == "l1" and v.numel():
            return as_bytes(chunk_means(v.abs(), self.bucket), bits), None
        return bits, None

    def compress(self, tensor, info):
        v = self._vector(tensor, info)
        if on_host(v) and v.numel():
            s, bits = sign_compress_cpu(v, self.bucket, self.scale == "l1", self.name)
            return (as_bytes(s, bits) if s is not None else bits), None
        if self.scale == "l1" and v.numel():
            return as_bytes(chunk_means(v.abs(), self.bucket), sign_bits(v)), None
        return sign_bits(v), None

    def _split(self, data, n):
        c = self._nscales(n)
        if not c:
            return None, data
        s, off = from_bytes(data, 0, torch.float32, c)
        return s, data[off:]

    def decode(self, data, ctx, info):
        n = info.numel
        if n and on_host(data):
            s, bits = self._split(data, n)
            return sign_aggregate_cpu([bits], [s] if s is not None else [], n, self.bucket, False, self.name)
        s, bits = self._split(data, n)
        sign = bits_to_sign(bits, n)
        return sign if s is None else sign * expand_chunks(s, n, self.bucket)

    def aggregate(self, datas, ctx, info):
        n = info.numel
        if n == 0:
            return torch.zeros(0, device=datas[0].device if datas else None)
        parts = [self._split(d, n) for d in datas]
        if on_host(datas[0]):
            return sign_aggregate_cpu([b for _, b in parts], [s for s, _ in parts if s is not None], n,
                                      self.bucket, True, self.name)
        vote = vote_sum([b for _, b in parts], n)                # N * sign(sum of signs)
        if self.scale != "l1":
            return vote
        mean_scale = torch.stack([s for s, _ in parts]).mean(0)   # ranks' mean scale per chunk
        return vote.mul_(expand_chunks(mean_scale, n, self.bucket))

    def wire_bytes(self, numel):
        return (4 * self._nscales(numel) + packed_bytes(numel, 1)) if numel else 0


@register("signsgd")
class SignSGDCompressor(MajorityVote):
    pass
