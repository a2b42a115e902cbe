"""MNIST-1D (Greydanus 2020) data and the 1-D CNN used by the main job and benchmarks.

The data set is generated locally by the ``mnist1d`` package (no download):
10,000 samples split 8,000 train / 2,000 test, cached as ``.npz`` so ranks and
later runs reuse it.
"""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F


def default_cache() -> Path:
    return Path(os.environ.get("HVD_EXT_DATA", Path(tempfile.gettempdir()) / "hvd_ext_data"))


def load_mnist1d(num_samples: int = 10_000, seed: int = 42, cache_dir=None):
    """Return (x_train, y_train, x_test, y_test) as torch tensors (float32 [N,40], int64 [N])."""
    cache_dir = Path(cache_dir) if cache_dir else default_cache()
    path = cache_dir / f"mnist1d_{num_samples}_{seed}.npz"
    if not path.exists():
        from mnist1d.data import get_dataset_args, make_dataset

        args = get_dataset_args()
        args.num_samples = num_samples
        args.seed = seed
        d = make_dataset(args)
        cache_dir.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp.npz")
        np.savez(tmp, x=d["x"], y=d["y"], x_test=d["x_test"], y_test=d["y_test"])
        os.replace(tmp, path)
    d = np.load(path)
    t = lambda a, dt: torch.from_numpy(np.ascontiguousarray(a)).to(dt)  # noqa: E731
    return t(d["x"], torch.float32), t(d["y"], torch.int64), t(d["x_test"], torch.float32), t(d["y_test"], torch.int64)


class MNIST1DCNN(nn.Module):
    """1-D CNN in the spirit of the MNIST-1D paper's CNN, widened to reach >= 94% in a few epochs."""

    def __init__(self, channels: int = 64, classes: int = 10, length: int = 40):
        super().__init__()
        c = channels
        self.conv1 = nn.Conv1d(1, c, 5, padding=2)
        self.conv2 = nn.Conv1d(c, c, 3, stride=2, padding=1)
        self.conv3 = nn.Conv1d(c, c, 3, stride=2, padding=1)
        self.conv4 = nn.Conv1d(c, c, 3, stride=2, padding=1)
        out_len = length
        for _ in range(3):
            out_len = (out_len + 1) // 2
        self.fc1 = nn.Linear(c * out_len, 256)
        self.fc2 = nn.Linear(256, classes)

    def forward(self, x):
        x = x.unsqueeze(1)
        x = F.relu(self.conv1(x))
        x = F.relu(self.conv2(x))
        x = F.relu(self.conv3(x))
        x = F.relu(self.conv4(x))
        x = F.relu(self.fc1(x.flatten(1)))
        return self.fc2(x)


@torch.no_grad()
def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor, batch: int = 1000) -> float:
    model.eval()
    correct = 0
    for i in range(0, len(x), batch):
        correct += (model(x[i:i + batch]).argmax(1) == y[i:i + batch]).sum().item()
    model.train()
    return correct / len(x)
