"""Models the launcher can build by name: an MLP and a small CNN for the demos."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from torch import nn

MODEL_NAMES = ("mlp", "cnn")


@dataclass
class ModelConfig:
    """``conf/model/*.yaml``."""

    name: str = "mlp"
    hidden_sizes: list[int] = field(default_factory=lambda: [128, 128])  # mlp: width of each hidden layer
    channels: list[int] = field(default_factory=lambda: [32, 64])  # cnn: output channels of each conv block
    dropout: float = 0.0

    def __post_init__(self) -> None:
        if self.name not in MODEL_NAMES:
            raise ValueError(f"model.name={self.name!r} is not a model; valid: {', '.join(MODEL_NAMES)}")
        for key in ("hidden_sizes", "channels"):
            if any(size < 1 for size in getattr(self, key)):
                raise ValueError(f"model.{key}={list(getattr(self, key))} must be positive sizes")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"model.dropout={self.dropout} must be in [0, 1)")


def build_model(cfg: ModelConfig, input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """The classifier ``cfg`` names, for inputs of ``input_shape`` (without the batch dimension)."""
    if cfg.name == "mlp":
        return _mlp(math.prod(input_shape), cfg.hidden_sizes, num_classes, cfg.dropout)
    if len(input_shape) != 3:
        raise ValueError(f"model.name=cnn needs image inputs (channels, height, width), got shape {input_shape}")
    return _cnn(input_shape[0], cfg.channels, num_classes, cfg.dropout)


def _mlp(in_features: int, hidden_sizes: list[int], num_classes: int, dropout: float) -> nn.Module:
    layers: list[nn.Module] = [nn.Flatten()]
    for width in hidden_sizes:
        layers += [nn.Linear(in_features, width), nn.ReLU(), nn.Dropout(dropout)]
        in_features = width
    layers.append(nn.Linear(in_features, num_classes))
    return nn.Sequential(*layers)


def _cnn(in_channels: int, channels: list[int], num_classes: int, dropout: float) -> nn.Module:
    """3x3 conv + BatchNorm + ReLU blocks, 2x2 max-pooling between them, global average pooling, linear head."""
    layers: list[nn.Module] = []
    for i, width in enumerate(channels):
        if i > 0:
            layers.append(nn.MaxPool2d(2, ceil_mode=True))
        layers += [nn.Conv2d(in_channels, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU()]
        in_channels = width
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Dropout(dropout), nn.Linear(in_channels, num_classes)]
    return nn.Sequential(*layers)
