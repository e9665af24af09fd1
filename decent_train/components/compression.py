"""``conf/compression/*.yaml``: what gossip sends (engine/compress.py), and which of its keys each option reads."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from decent_train.components.checks import engine_check, refuse_unread
from decent_train.engine.compress import COMPRESSORS, make_compressor
from decent_train.engine.ddp import check_engine_arguments

COPY_DTYPES = {"param": None, "bf16": torch.bfloat16}
# compression.<key> -> the compressions that read it: set away from its default under another, it is refused.
READERS = {"consensus_step": COMPRESSORS, "int8_block": ("int8",), "copy_dtype": COMPRESSORS}


@dataclass
class CompressionConfig:
    """``conf/compression/*.yaml``: what gossip sends (engine/compress.py). ``none`` sends the parameters; ``bf16``
    and ``int8`` send compressed differences to public copies (CHOCO-SGD), which keeps the workers' mean exact."""

    name: str = "none"  # none | bf16 | int8
    consensus_step: float = 1.0  # bf16, int8: the step toward the neighbours' public copies (CHOCO's gamma), in (0, 1]
    int8_block: int = 256  # int8: elements per float32 scale
    copy_dtype: str = "param"  # bf16, int8: a pair's public copies: param (the parameters' dtype) | bf16 (half memory)

    def __post_init__(self) -> None:
        if self.name not in ("none", *COMPRESSORS):
            raise ValueError(f"compression={self.name!r} is not a compression; valid: none, {', '.join(COMPRESSORS)}")
        step = self.consensus_step
        engine_check("compression.consensus_step", step, lambda: check_engine_arguments(consensus_step=step))
        engine_check("compression.int8_block", self.int8_block, lambda: make_compressor("int8", self.int8_block))
        if self.copy_dtype not in COPY_DTYPES:
            raise ValueError(f"compression.copy_dtype={self.copy_dtype!r}; valid: {', '.join(COPY_DTYPES)}")
        refuse_unread("compression", self, READERS)

    def engine_kwargs(self) -> dict[str, Any]:
        """The engine's ``compression`` and ``consensus_step`` arguments."""
        if self.name == "none":
            return {}
        return {
            "compression": make_compressor(self.name, self.int8_block),
            "consensus_step": self.consensus_step,
            "public_copy_dtype": COPY_DTYPES[self.copy_dtype],
        }
