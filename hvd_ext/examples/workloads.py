"""Benchmark workloads beyond MNIST-1D, all offline (data generated here or read from files
every Python installation ships; nothing is downloaded).

=====================  ==================================================================
name                   what
=====================  ==================================================================
``lm``                 byte-level causal transformer LM (2 layers, d=64; Vaswani et al.
                       2017, pre-LN as in GPT-2) on the Python standard library's own
                       source text; metric: held-out loss in nats per byte (lower is
                       better; perplexity = exp(loss))
``resnet``             small ResNet (He et al. 2016) with BatchNorm on ``shapes16``, a
                       procedurally generated 10-class 16x16 image set; metric: accuracy
``mnist1d``            the main job's 1-D CNN on MNIST-1D (Greydanus 2020), IID shards
``mnist1d-noniid``     same, label-skewed shards (``skew`` of each class on its home rank)
``mnist1d-slow``       same, IID, rank 1 takes 2x as long per step
``mnist1d-noniid-slow`` non-IID shards and the 2x slower rank together
=====================  ==================================================================

The LM corpus is the concatenation, in sorted file-name order, of the top-level ``*.py``
modules of the running interpreter's standard library (``os.path.dirname(os.__file__)``),
truncated to ``corpus_bytes``; the last ``heldout`` fraction is held out. The same Python
version gives the same bytes; its SHA-256 is reported (:func:`text_corpus`).

Non-IID shards (:func:`label_skew_shards`): each class c has a home rank
``c * size // classes``; a fraction ``skew`` of its samples goes there and the rest is split
evenly over the other ranks (skew = 1/size is IID, skew = 1 gives disjoint label sets).
The shards are a deterministic function of (labels, size, skew, seed): every rank computes
all of them and agrees on the number of steps per epoch.
"""
from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from .mnist1d import MNIST1DCNN, default_cache, load_mnist1d


# ---------------------------------------------------------------------------------------
# text corpus + tiny transformer LM
# ---------------------------------------------------------------------------------------
def text_corpus(corpus_bytes: int = 600_000, heldout: float = 0.1) -> Tuple[torch.Tensor, torch.Tensor, Dict]:
    """(train bytes, held-out bytes) as uint8->int64 tensors, and a description with the SHA-256."""
    root = Path(os.path.dirname(os.__file__))
    files = sorted(p for p in root.glob("*.py") if p.is_file())
    if not files:
        raise RuntimeError(f"no *.py files under {root}: the LM corpus needs the Python standard library sources")
    buf = bytearray()
    used = 0
    for p in files:
        buf += p.read_bytes()
        used += 1
        if len(buf) >= corpus_bytes:
            break
    data = bytes(buf[:corpus_bytes])
    cut = int(len(data) * (1 - heldout))
    t = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(torch.int64)
    info = {"source": str(root), "files": used, "first": files[0].name, "last": files[used - 1].name,
            "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest(), "train_bytes": cut,
            "heldout_bytes": len(data) - cut}
    return t[:cut], t[cut:], info


class Block(nn.Module):
    """Pre-LN transformer block: causal self-attention + MLP, each with a residual."""

    def __init__(self, d: int, heads: int, ff: int):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, ff)
        self.fc2 = nn.Linear(ff, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class TinyTransformerLM(nn.Module):
    """Byte-level (vocab 256) causal transformer with learned positions and tied embeddings."""

    def __init__(self, d: int = 64, layers: int = 2, heads: int = 4, context: int = 64, vocab: int = 256):
        super().__init__()
        self.context = context
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.zeros(context, d))
        nn.init.normal_(self.pos, std=0.02)
        nn.init.normal_(self.tok.weight, std=0.02)
        self.blocks = nn.ModuleList(Block(d, heads, 4 * d) for _ in range(layers))
        self.ln = nn.LayerNorm(d)

    def forward(self, idx):
        x = self.tok(idx) + self.pos[: idx.shape[1]]
        for blk in self.blocks:
            x = blk(x)
        return self.ln(x) @ self.tok.weight.t()


def lm_windows(tokens: torch.Tensor, context: int) -> torch.Tensor:
    """Non-overlapping windows of context+1 bytes: [n, context+1] (input = [:, :-1], target = [:, 1:])."""
    n = (len(tokens) - 1) // context
    return torch.stack([tokens[i * context: i * context + context + 1] for i in range(n)])


# ---------------------------------------------------------------------------------------
# shapes16 images + small ResNet with BatchNorm
# ---------------------------------------------------------------------------------------
SHAPES = ("disk", "ring", "square", "frame", "plus", "cross", "hbar", "vbar", "triangle", "dots")


def make_shapes(n: int, size: int = 16, seed: int = 0, noise: float = 0.35) -> Tuple[np.ndarray, np.ndarray]:
    """``n`` grayscale images [n, 1, size, size] (float32) of 10 procedurally drawn shape classes
    (``SHAPES``) with random centre, scale, thickness, contrast, a random intensity gradient
    and Gaussian pixel noise; labels are balanced (i % 10, then shuffled)."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float32) + 0.5
    labels = np.arange(n) % len(SHAPES)
    rng.shuffle(labels)
    out = np.empty((n, 1, size, size), np.float32)
    for i, c in enumerate(labels):
        s = rng.uniform(0.22, 0.36) * size            # half-size
        cx, cy = rng.uniform(s, size - s, 2)
        w = rng.uniform(0.9, 1.6)                      # stroke half-width in pixels
        dx, dy = xx - cx, yy - cy
        r = np.hypot(dx, dy)
        cheb = np.maximum(np.abs(dx), np.abs(dy))
        if c == 0:
            m = r <= s
        elif c == 1:
            m = np.abs(r - s) <= w
        elif c == 2:
            m = cheb <= s * 0.85
        elif c == 3:
            m = np.abs(cheb - s * 0.85) <= w
        elif c == 4:
            m = ((np.abs(dx) <= w) | (np.abs(dy) <= w)) & (cheb <= s)
        elif c == 5:
            m = ((np.abs(dx - dy) <= 1.4 * w) | (np.abs(dx + dy) <= 1.4 * w)) & (cheb <= s)
        elif c == 6:
            m = (np.abs(dy) <= w * 1.2) & (np.abs(dx) <= s)
        elif c == 7:
            m = (np.abs(dx) <= w * 1.2) & (np.abs(dy) <= s)
        elif c == 8:
            m = (dy <= s * 0.8) & (np.abs(dx) <= (dy + s) * 0.6)
        else:
            o = s * 0.6
            m = (np.hypot(dx - o, dy - o) <= w * 1.8) | (np.hypot(dx + o, dy + o) <= w * 1.8)
        contrast = rng.uniform(0.6, 1.4) * rng.choice([-1.0, 1.0])
        g = rng.normal(0, 0.3, 2)
        img = contrast * m.astype(np.float32) + g[0] * (xx / size - 0.5) + g[1] * (yy / size - 0.5)
        img += rng.normal(0, noise, img.shape)
        out[i, 0] = img
    return out, labels.astype(np.int64)


def load_shapes(n_train: int = 12_000, n_test: int = 2_000, seed: int = 7, cache_dir=None):
    """(x_train, y_train, x_test, y_test) tensors of ``shapes16``, cached as .npz like MNIST-1D."""
    cache_dir = Path(cache_dir) if cache_dir else default_cache()
    path = cache_dir / f"shapes16_{n_train}_{n_test}_{seed}.npz"
    if not path.exists():
        x, y = make_shapes(n_train + n_test, seed=seed)
        cache_dir.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp.npz")
        np.savez(tmp, x=x, y=y)
        os.replace(tmp, path)
    d = np.load(path)
    x, y = torch.from_numpy(d["x"]), torch.from_numpy(d["y"])
    return x[:n_train], y[:n_train], x[n_train:], y[n_train:]


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.short = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
                      if stride != 1 or cin != cout else nn.Identity())

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + self.short(x))


class SmallResNet(nn.Module):
    """ResNet-style CNN: stem conv+BN, three stages of one basic block (widths w, 2w, 4w;
    strides 1, 2, 2), global average pooling, linear classifier."""

    def __init__(self, width: int = 16, classes: int = 10, in_ch: int = 1):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(in_ch, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU())
        self.layers = nn.Sequential(BasicBlock(width, width, 1), BasicBlock(width, 2 * width, 2),
                                    BasicBlock(2 * width, 4 * width, 2))
        self.fc = nn.Linear(4 * width, classes)

    def forward(self, x):
        return self.fc(self.layers(self.stem(x)).mean((2, 3)))


# ---------------------------------------------------------------------------------------
# shards
# ---------------------------------------------------------------------------------------
def label_skew_shards(labels: torch.Tensor, size: int, skew: float, seed: int = 0) -> List[torch.Tensor]:
    """One index tensor per rank (see module doc). ``skew`` in [1/size, 1]."""
    if size == 1:
        return [torch.arange(len(labels))]
    if not 1.0 / size - 1e-9 <= skew <= 1.0:
        raise ValueError(f"label_skew_shards: bad value {skew!r} for 'skew': accepted: 1/size <= skew <= 1")
    g = torch.Generator().manual_seed(seed)
    classes = int(labels.max()) + 1
    parts: List[List[torch.Tensor]] = [[] for _ in range(size)]
    for c in range(classes):
        idx = (labels == c).nonzero().flatten()
        idx = idx[torch.randperm(len(idx), generator=g)]
        home = c * size // classes
        n_home = int(round(skew * len(idx)))
        parts[home].append(idx[:n_home])
        rest = idx[n_home:]
        others = [r for r in range(size) if r != home]
        for j, r in enumerate(others):
            parts[r].append(rest[j::len(others)])
    return [torch.cat(p)[torch.randperm(int(sum(len(t) for t in p)), generator=g)] for p in parts]


def label_histogram(labels: torch.Tensor, classes: int) -> List[int]:
    return torch.bincount(labels, minlength=classes).tolist()


# ---------------------------------------------------------------------------------------
# registry
# ---------------------------------------------------------------------------------------
@dataclass
class Workload:
    """What the trainer needs: data, model, loss, evaluation and the run's defaults."""

    name: str
    description: str
    load: Callable[[], Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]
    model: Callable[[], nn.Module]
    metric: str                          # "acc" (higher is better) or "loss" (lower is better)
    target: float
    epochs: int
    lr: float
    batch: int
    optimizer: str = "sgd"               # "sgd" (momentum 0.9) or "adamw"
    weight_decay: float = 5e-4
    skew: Optional[float] = None         # non-IID label skew (None: IID)
    slow_rank: int = -1
    slow_factor: float = 1.0
    info: Dict = field(default_factory=dict)

    @property
    def higher_is_better(self) -> bool:
        return self.metric == "acc"

    def reached(self, value: float) -> bool:
        return value >= self.target if self.higher_is_better else value <= self.target

    def loss(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        out = model(x)
        return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))

    @torch.no_grad()
    def evaluate(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor, batch: int = 500) -> float:
        """Test accuracy, or mean held-out loss in nats per byte (eval mode: BN uses running stats)."""
        was = model.training
        model.eval()
        tot, n = 0.0, 0
        for i in range(0, len(x), batch):
            out = model(x[i:i + batch])
            if self.metric == "acc":
                tot += (out.argmax(-1) == y[i:i + batch]).sum().item()
                n += len(out)
            else:
                tot += F.cross_entropy(out.reshape(-1, out.shape[-1]), y[i:i + batch].reshape(-1),
                                       reduction="sum").item()
                n += y[i:i + batch].numel()
        model.train(was)
        return tot / max(n, 1)


def _lm_load(context: int = 64):
    def load():
        train, test, _ = text_corpus()
        w_tr, w_te = lm_windows(train, context), lm_windows(test, context)
        return w_tr[:, :-1], w_tr[:, 1:], w_te[:, :-1], w_te[:, 1:]
    return load


def _mnist1d(**kw) -> Dict:
    return dict(load=load_mnist1d, model=lambda: MNIST1DCNN(64), metric="acc", epochs=8, lr=0.2, batch=32, **kw)


WORKLOADS: Dict[str, Callable[[], Workload]] = {
    "lm": lambda: Workload("lm", "byte-level transformer LM (2 layers, d=64, context 64) on Python stdlib source "
                                 "text (540 kB train / 60 kB held out)", _lm_load(64),
                           lambda: TinyTransformerLM(64, 2, 4, 64), metric="loss", target=2.0, epochs=2, lr=3e-3,
                           batch=16, optimizer="adamw", weight_decay=0.01),
    "resnet": lambda: Workload("resnet", "ResNet-style CNN with BatchNorm (width 16, ~75k parameters) on shapes16 "
                                         "(12k train / 2k test, 10 classes, 16x16)", load_shapes,
                               lambda: SmallResNet(16), metric="acc", target=0.95, epochs=3, lr=0.1, batch=32),
    "mnist1d": lambda: Workload("mnist1d", "MNIST-1D 1-D CNN, IID shards", target=0.93, **_mnist1d()),
    "mnist1d-noniid": lambda: Workload("mnist1d-noniid", "MNIST-1D 1-D CNN, label-skewed shards (skew 0.9)",
                                       target=0.90, **_mnist1d(skew=0.9)),
    "mnist1d-slow": lambda: Workload("mnist1d-slow", "MNIST-1D 1-D CNN, IID shards, rank 1 2x slower",
                                     target=0.93, **_mnist1d(slow_rank=1, slow_factor=2.0)),
    "mnist1d-noniid-slow": lambda: Workload("mnist1d-noniid-slow", "MNIST-1D 1-D CNN, label-skewed shards "
                                                                   "(skew 0.9) and rank 1 2x slower",
                                            target=0.90, **_mnist1d(skew=0.9, slow_rank=1, slow_factor=2.0)),
}


def get_workload(name: str) -> Workload:
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; accepted: {', '.join(WORKLOADS)}")
    return WORKLOADS[name]()
