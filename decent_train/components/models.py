"""Models the launcher can build by name: an MLP and a small CNN for the demos, torchvision's ResNet-18/50 for
image classification, and a GPT-2-style decoder for language modelling."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from decent_train.components.checks import refuse_unread

MODEL_NAMES = ("mlp", "cnn", "resnet18", "resnet50", "gpt2")
_SHAPE_KEYS = {  # the settings that shape each model (dropout does not)
    "mlp": ("hidden_sizes",), "cnn": ("channels",), "resnet18": ("small_stem",), "resnet50": ("small_stem",),
    "gpt2": ("layers", "heads", "width", "bias"),
}
# model.<key> -> the models that read it
READERS = {key: tuple(m for m, keys in _SHAPE_KEYS.items() if key in keys) for keys in _SHAPE_KEYS.values()
           for key in keys} | {"dropout": ("mlp", "cnn", "gpt2")}


@dataclass
class ModelConfig:
    """``conf/model/*.yaml``."""

    name: str = "cnn"
    hidden_sizes: list[int] = field(default_factory=lambda: [128, 128])  # mlp: width of each hidden layer
    channels: list[int] = field(default_factory=lambda: [32, 64])  # cnn: output channels of each conv block
    dropout: float = 0.0  # mlp, cnn, gpt2: the dropout probability
    small_stem: bool = False  # resnet18, resnet50: 3x3/stride-1 stem conv, no max-pool: for 32x32 inputs (CIFAR)
    layers: int = 12  # gpt2: transformer blocks
    heads: int = 12  # gpt2: attention heads per block
    width: int = 768  # gpt2: embedding size
    bias: bool = False  # gpt2: biases in the Linear and LayerNorm layers

    def __post_init__(self) -> None:
        if self.name not in MODEL_NAMES:
            raise ValueError(f"model.name={self.name!r} is not a model; valid: {', '.join(MODEL_NAMES)}")
        for key in ("hidden_sizes", "channels"):
            if any(size < 1 for size in getattr(self, key)):
                raise ValueError(f"model.{key}={list(getattr(self, key))} must be positive sizes")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"model.dropout={self.dropout} must be in [0, 1)")
        if min(self.layers, self.heads, self.width) < 1 or self.width % self.heads:
            raise ValueError(
                f"model.layers={self.layers}, model.heads={self.heads}, model.width={self.width} must be positive, "
                "with width divisible by heads"
            )
        refuse_unread("model", self, READERS)

    def architecture(self) -> dict[str, Any]:
        """What a checkpoint of this model must match: the name and the settings that shape it (JSON-ready)."""
        values = {key: getattr(self, key) for key in _SHAPE_KEYS[self.name]}
        return {"name": self.name} | {k: list(v) if isinstance(v, Sequence) else v for k, v in values.items()}


def build_model(cfg: ModelConfig, input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """The model ``cfg`` names, for inputs of ``input_shape`` (without the batch dimension).

    For gpt2, ``input_shape`` is ``(context,)`` and ``num_classes`` the vocabulary size.
    """
    if cfg.name == "mlp":
        return _mlp(math.prod(input_shape), cfg.hidden_sizes, num_classes, cfg.dropout)
    if cfg.name == "gpt2":
        if len(input_shape) != 1:
            raise ValueError(
                f"model.name=gpt2 needs token inputs (context,), e.g. dataset=tokens, got shape {tuple(input_shape)}"
            )
        return GPT(num_classes, input_shape[0], cfg.layers, cfg.heads, cfg.width, cfg.bias, cfg.dropout)
    if len(input_shape) != 3:
        raise ValueError(
            f"model.name={cfg.name} needs image inputs (channels, height, width), got shape {tuple(input_shape)}"
        )
    if cfg.name == "cnn":
        return _cnn(input_shape[0], cfg.channels, num_classes, cfg.dropout)
    return _resnet(cfg.name, input_shape[0], num_classes, cfg.small_stem)


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


def shard_units(net: nn.Module) -> list[nn.Module]:
    """The modules FSDP2 shards one by one (``fully_shard`` each, then the root): each gathers its parameters just
    before it runs and frees them after, so a rank holds whole parameters of one unit at a time. A transformer's
    blocks, a ResNet's residual blocks, else the top-level modules that hold parameters."""
    if isinstance(net, GPT):
        return list(net.blocks)
    stages = [getattr(net, f"layer{i}", None) for i in range(1, 5)]
    if all(isinstance(stage, nn.Sequential) for stage in stages):  # torchvision's ResNet
        return [block for stage in stages for block in stage]
    return [m for m in net.children() if any(True for _ in m.parameters())]


def _resnet(name: str, in_channels: int, num_classes: int, small_stem: bool) -> nn.Module:
    """torchvision's ResNet, untrained; the stem adapted to the input's channels and, with ``small_stem``, to 32x32."""
    import torchvision  # slow to import: only when a ResNet is wanted

    model = getattr(torchvision.models, name)(weights=None, num_classes=num_classes)
    if small_stem or in_channels != 3:
        kernel, stride, padding = (3, 1, 1) if small_stem else (7, 2, 3)
        model.conv1 = nn.Conv2d(in_channels, 64, kernel, stride=stride, padding=padding, bias=False)
        nn.init.kaiming_normal_(model.conv1.weight, mode="fan_out", nonlinearity="relu")  # as torchvision inits it
    if small_stem:
        model.maxpool = nn.Identity()
    return model


class GPT(nn.Module):
    """A GPT-2-style decoder (pre-LayerNorm blocks, causal attention, 4x GELU MLP), the LM head tied to ``wte``.

    ``forward(idx)`` maps tokens ``(batch, T)``, T <= ``context``, to next-token logits ``(batch, T, vocab)``.
    """

    def __init__(
        self, vocab: int, context: int, layers: int, heads: int, width: int, bias: bool = False, dropout: float = 0.0
    ):
        super().__init__()
        self.context = context
        self.wte = nn.Embedding(vocab, width)
        self.wpe = nn.Embedding(context, width)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(_Block(width, heads, bias, dropout) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width, bias=bias)
        self.lm_head = nn.Linear(width, vocab, bias=False)
        self.lm_head.weight = self.wte.weight  # one Parameter: ``wte`` keeps the name in named_parameters()
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, 0.0, 0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
        for block in self.blocks:  # GPT-2: the residual stream's variance stays put as blocks add to it
            for proj in (block.attn.proj, block.proj):
                nn.init.normal_(proj.weight, 0.0, 0.02 / math.sqrt(2 * layers))

    def forward(self, idx: Tensor) -> Tensor:
        t = idx.shape[1]
        if t > self.context:
            raise ValueError(f"GPT: sequence of {t} tokens is longer than the context of {self.context}")
        x = self.drop(self.wte(idx) + self.wpe(torch.arange(t, device=idx.device)))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


class _Block(nn.Module):
    def __init__(self, width: int, heads: int, bias: bool, dropout: float):
        super().__init__()
        self.ln_1 = nn.LayerNorm(width, bias=bias)
        self.attn = _CausalSelfAttention(width, heads, bias, dropout)
        self.ln_2 = nn.LayerNorm(width, bias=bias)
        self.fc = nn.Linear(width, 4 * width, bias=bias)
        self.proj = nn.Linear(4 * width, width, bias=bias)
        self.resid_drop = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.resid_drop(self.proj(F.gelu(self.fc(self.ln_2(x)))))


class _CausalSelfAttention(nn.Module):
    def __init__(self, width: int, heads: int, bias: bool, dropout: float):
        super().__init__()
        self.heads = heads
        self.dropout = dropout
        self.qkv = nn.Linear(width, 3 * width, bias=bias)
        self.proj = nn.Linear(width, width, bias=bias)
        self.resid_drop = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        b, t, c = x.shape
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in self.qkv(x).split(c, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        return self.resid_drop(self.proj(y.transpose(1, 2).reshape(b, t, c)))
