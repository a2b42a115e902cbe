"""Models for the throughput benchmark (torchvision is not available here)."""
from __future__ import annotations

import torch.nn as nn
import torch.nn.functional as F


class SyntheticNet(nn.Module):
    """Small conv stem + wide MLP head on 3x32x32 inputs, ~10.7M parameters (~43 MB fp32 gradient).

    Sized like a mid-size CNN's parameter count while keeping CPU compute per
    sample modest (~40 MMAC forward), so that on a slow link the step is
    communication-bound, as for ResNet-50 on 10 Gbit/s Ethernet.
    """

    def __init__(self, classes: int = 1000, width: int = 1024):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 3, padding=1)
        self.conv2 = nn.Conv2d(64, 128, 3, stride=2, padding=1)
        self.conv3 = nn.Conv2d(128, 128, 3, stride=2, padding=1)
        self.fc1 = nn.Linear(128 * 8 * 8, width)
        self.fc2 = nn.Linear(width, width)
        self.fc3 = nn.Linear(width, classes)

    def forward(self, x):
        x = F.relu(self.conv1(x))
        x = F.relu(self.conv2(x))
        x = F.relu(self.conv3(x))
        x = F.relu(self.fc1(x.flatten(1)))
        x = F.relu(self.fc2(x))
        return self.fc3(x)


def num_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
