"""What training and evaluation share about a forward pass: its precision and its loss."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from decent_train.config import PRECISIONS


class Precision:
    """``precision=fp32|bf16|fp16``: forward and loss under autocast; fp16 also scales the loss (a GradScaler, kept
    equal on all workers by the engine)."""

    def __init__(self, name: str, device: torch.device):
        self.dtype, self.device_type = PRECISIONS[name], device.type
        self.scaler = torch.amp.GradScaler(device.type, enabled=name == "fp16")

    def autocast(self) -> torch.autocast:
        return torch.autocast(self.device_type, dtype=self.dtype, enabled=self.dtype != torch.float32)


def cross_entropy(logits: torch.Tensor, y: torch.Tensor, **kwargs: Any) -> torch.Tensor:
    """Over the last dimension: (N, classes) scores against (N,) labels, or (B, T, vocab) against (B, T) tokens."""
    return F.cross_entropy(logits.flatten(0, -2), y.flatten(), **kwargs)
