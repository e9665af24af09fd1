"""Int8 compressed gossip in one pass per bucket: the encode and a pair's mix as single compiled loops.

Why: eager, the encode (x − x̂, row absmax, divide, round, to int8, decode, x̂ += D) and the mix (decode, x̂_j += D,
x += a x̂_j − b x̂_i) are 14 passes over a bucket: 16 ms per step for a 26 MB model on one CPU core, more than the
bytes they save are worth on a 4 Gbit/s link when the cores are busy (scripts/BENCHMARKS.md, "int8 on the CPU").
Compiled with torch.compile, the encode is one loop per row (its absmax, then its levels and the copy's update) and
a pair's mix one more: 4-5 ms. On a GPU each is one Triton kernel per bucket (eager issues about 12 and 7).

The values are bit-identical to the eager path (compress.py): the same IEEE divisions, and a multiply then an add
where eager does one (inductor compiles without floating-point contraction); tests/test_compression.py checks it. So a
worker whose compile fails (no C++ compiler) falls back to eager and stays consistent with peers that compiled.

When: ``DECENT_TRAIN_COMPILED_INT8`` = ``auto`` (the default: buckets of at least 2^20 elements, where the few
seconds of one compile per process pay within a few hundred steps), ``always`` or ``never``.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
from loguru import logger
from torch import Tensor
from torch.torch_version import TorchVersion

from decent_train.engine.comm import first_line

__all__ = ["COMPILED_INT8_ENV", "Int8Kernels", "compiled_int8_choice", "compiled_int8_kernels"]

COMPILED_INT8_ENV = "DECENT_TRAIN_COMPILED_INT8"
COMPILED_INT8_CHOICES = ("auto", "always", "never")
MIN_COMPILED_NUMEL = 2**20
# Before torch 2.13, inductor's C++ backend ignores emulate_precision_casts where a loop reads back a bfloat16 value it
# just stored (pytorch #185337): the compiled mix would use the unrounded float32 sum of the peer's copy (off by a
# bfloat16 rounding from eager and the replay). There, a CPU bucket with bfloat16 copies mixes eagerly.
CPU_COMPILE_ROUNDS_LOW_PRECISION = TorchVersion(torch.__version__) >= (2, 13)


def encode_rows_(x: Tensor, own: Tensor, top: int) -> tuple[Tensor, Tensor]:
    """Rows of ``block`` elements: the levels and scales of Q(x − own) (absmax / ``top`` per row, rounded to
    nearest), and ``own`` += D(levels, scales); the scale is float32 on the wire and decodes from exactly that value.
    (Returned, not written into the message: the levels and scales are views of one buffer with two dtypes, which
    torch.compile cannot mutate.)"""
    difference = x - own
    wire_scale = (torch.maximum(difference.amax(1), difference.amin(1).neg()) / top).to(torch.float32)
    scale = wire_scale.to(difference.dtype).unsqueeze(1)
    rounded = torch.round(difference / torch.where(scale > 0, scale, 1.0))
    own.add_(rounded * scale)
    return rounded.to(torch.int8), wire_scale


def mix_pair_rows_(
    x: Tensor, out: Tensor, own: Tensor, others: Tensor, levels: Tensor, scales: Tensor, pull: float, keep: float
) -> None:
    """A pair's mix: ``others`` += D(levels, scales); ``out`` = x + pull * others − keep * own."""
    others.add_(levels.to(x.dtype) * scales.to(x.dtype).unsqueeze(1))
    out.copy_(x + pull * others.to(x.dtype) - keep * own.to(x.dtype))  # bfloat16 copies: in x's precision


class Int8Kernels:
    """The two loops over a bucket: whole rows by the compiled functions, the last partial row eagerly (padded with
    zeros, as the eager path pads its scratch)."""

    def __init__(self, block: int, top: int):
        self.block, self.top = block, top

    def encode_(self, x: Tensor, own: Tensor, levels: Tensor, scales: Tensor) -> None:
        """``levels`` (padded rows x block), ``scales`` <- Q(x − own); own += D. x and own are flat, ``numel`` long."""
        rows = x.numel() // self.block
        whole = rows * self.block
        if rows:
            row_levels, row_scales = _run(
                encode_rows_, x[:whole].view(rows, self.block), own[:whole].view(rows, self.block), self.top
            )
            levels[:rows].copy_(row_levels)
            scales[:rows].copy_(row_scales)
        if whole < x.numel():
            x_tail, own_tail = self._padded(x[whole:], x.dtype), self._padded(own[whole:], own.dtype)
            tail_levels, tail_scale = encode_rows_(x_tail, own_tail, self.top)
            levels[rows:].copy_(tail_levels)
            scales[rows:].copy_(tail_scale)
            own[whole:].copy_(own_tail[0, : x.numel() - whole])

    def mix_pair_(self, x: Tensor, out: Tensor, own: Tensor, others: Tensor, levels: Tensor, scales: Tensor,
                  pull: float, keep: float) -> None:
        if out.data_ptr() != x.data_ptr():
            # Mixed in place only: torch 2.14's inductor drops the compiled loop's write into an ``out`` that does not
            # alias ``x`` when ``levels`` and ``scales`` (views of one message) alias each other
            # (tests/test_int8_kernels.py).
            out.copy_(x)
            x = out
        rows = x.numel() // self.block
        whole = rows * self.block
        if rows:
            shaped = [t[:whole].view(rows, self.block) for t in (x, out, own, others)]
            if others.dtype != x.dtype and x.device.type == "cpu" and not CPU_COMPILE_ROUNDS_LOW_PRECISION:
                mix_pair_rows_(*shaped, levels[:rows], scales[:rows], pull, keep)
            else:
                _run(mix_pair_rows_, *shaped, levels[:rows], scales[:rows], pull, keep)
        if whole < x.numel():
            tail = [self._padded(t[whole:], t.dtype) for t in (x, out, own, others)]
            mix_pair_rows_(*tail, levels[rows:], scales[rows:], pull, keep)
            for flat, padded in zip((out, others), (tail[1], tail[3])):
                flat[whole:].copy_(padded[0, : x.numel() - whole])

    def _padded(self, values: Tensor, dtype: torch.dtype) -> Tensor:
        row = values.new_zeros((1, self.block), dtype=dtype)
        row[0, : values.numel()] = values
        return row


_compile_failed = False
_compiled: dict[Callable[..., Any], Callable[..., Any]] = {}  # one compile per process, shapes dynamic


def _run(eager: Callable[..., Any], *args: Any) -> Any:
    """``eager`` compiled; eager itself (bit-identical) from the first failure to compile on, said once."""
    global _compile_failed
    if not _compile_failed:
        try:
            if eager not in _compiled:
                # emulate_precision_casts: a bfloat16 copy is read back rounded, as eager reads it (inductor
                # otherwise keeps the float32 sum it just rounded and stored).
                _compiled[eager] = torch.compile(eager, dynamic=True, options={"emulate_precision_casts": True})
            return _compiled[eager](*args)
        except Exception as error:  # noqa: BLE001 -- inductor's failures (no compiler, no Triton) have many types
            _compile_failed = True
            logger.warning(f"int8 gossip: torch.compile failed ({first_line(error)}); running the eager kernels instead")
    return eager(*args)


def compiled_int8_choice() -> str:
    """``$DECENT_TRAIN_COMPILED_INT8``, checked."""
    choice = os.environ.get(COMPILED_INT8_ENV, "auto").lower() or "auto"
    if choice not in COMPILED_INT8_CHOICES:
        raise ValueError(f"{COMPILED_INT8_ENV}={choice!r}: valid are {', '.join(COMPILED_INT8_CHOICES)}")
    return choice


def compiled_int8_kernels(numel: int, block: int, top: int) -> Int8Kernels | None:
    """The compiled kernels for a bucket of ``numel`` elements, or None where the eager path runs (see the module)."""
    choice = compiled_int8_choice()
    if choice == "never" or (choice == "auto" and numel < MIN_COMPILED_NUMEL) or _compile_failed:
        return None
    return Int8Kernels(block, top)
