"""Token datasets for language modelling: ``train.bin`` and ``val.bin``, flat uint16 token ids (nanoGPT's format),
memory-mapped; a sample is a window of ``context_length`` tokens and its targets are the same window shifted by one."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from decent_train.components.data.base import Batch, Datasets, batch_generator

TOKENS_LAYOUT = "ROOT/train.bin and ROOT/val.bin, token ids as flat little-endian uint16 (nanoGPT's format)"
_VOCAB_CHECK_TOKENS = 1 << 22  # token ids check_token_files checks against the vocabulary: a prefix, not a 10 GB file


def check_token_files(root: Path, context_length: int, vocab_size: int) -> None:
    """Cheap: both files exist and hold whole uint16 tokens, at least one window's worth, and the ids of their first
    ``_VOCAB_CHECK_TOKENS`` are below ``vocab_size`` (the launcher's preflight runs it before any worker starts)."""
    for split in ("train.bin", "val.bin"):
        path = root / split
        if not path.is_file():
            raise ValueError(f"dataset.root={root} has no {split}; expected {TOKENS_LAYOUT}")
        size = path.stat().st_size
        if size % 2:
            raise ValueError(f"{path} has {size} bytes, not a whole number of uint16 tokens; expected {TOKENS_LAYOUT}")
        if size // 2 < context_length + 1:
            raise ValueError(
                f"{path} has {size // 2} tokens, fewer than dataset.context_length + 1 = {context_length + 1}; "
                f"expected {TOKENS_LAYOUT}"
            )
        top = int(np.memmap(path, dtype="<u2", mode="r")[:_VOCAB_CHECK_TOKENS].max())  # the embedding's rows
        if top >= vocab_size:
            raise ValueError(f"{path} holds token id {top}, not below dataset.vocab_size={vocab_size}; set "
                             f"dataset.vocab_size={top + 1} or more (the tokenizer's vocabulary)")


def check_token_shards(train_path: Path, tokens: int, world: int, context_length: int) -> None:
    """Every worker's contiguous shard of the ``tokens`` of ``train_path`` (``TokenData.train_batches``') holds one
    window and its shifted targets, at ``world`` workers: the smallest shard, ``tokens // world``, is the bound. The
    worker runs it at its first batch, the launcher over every world size from the file's size alone."""
    shard, window = tokens // world, context_length + 1
    if shard < window:
        raise ValueError(
            f"{train_path}: {tokens} tokens over {world} workers leave {shard} per worker, fewer than "
            f"dataset.context_length + 1 = {window}; valid: dataset.context_length <= {shard - 1} (or at most "
            f"{max(1, tokens // window)} workers)"
        )


class TokenData(Datasets):
    """Training: random windows from this worker's contiguous shard of ``train.bin`` (deterministic by seed).
    Evaluation: ``val.bin`` cut into consecutive windows, dealt round-robin to the workers.
    ``check_token_files`` (``build_datasets`` runs it first) has checked the files."""

    def __init__(self, root: Path, context_length: int, vocab_size: int):
        self.train_path, self.val_path = root / "train.bin", root / "val.bin"
        self.train_tokens = np.memmap(self.train_path, dtype="<u2", mode="r")
        self.val_tokens = np.memmap(self.val_path, dtype="<u2", mode="r")
        self.context_length = context_length
        self.input_shape = (context_length,)
        self.num_classes = vocab_size
        self.train_size = (len(self.train_tokens) - 1) // context_length  # an epoch: as many tokens as the file holds

    def _windows(self, tokens: np.ndarray, starts: list[int]) -> Batch:
        rows = torch.from_numpy(np.stack([tokens[s : s + self.context_length + 1] for s in starts]).astype(np.int64))
        return rows[:, :-1], rows[:, 1:]

    def train_batches(self, batch_size: int, rank: int, world: int, seed: int, start: int = 0) -> Iterator[Batch]:
        n = len(self.train_tokens)
        check_token_shards(self.train_path, n, world, self.context_length)
        low, high = rank * n // world, (rank + 1) * n // world  # this worker's shard of the token stream
        last_start = high - self.context_length - 1  # the window and its shifted targets stay inside the shard
        for index in itertools.count(start):  # each batch's own generator, so a resume can skip
            starts = torch.randint(low, last_start + 1, (batch_size,), generator=batch_generator(seed, rank, 0, index))
            yield self._windows(self.train_tokens, starts.tolist())

    def _eval_windows(self, rank: int, world: int) -> range:
        """This worker's evaluation windows, by number: ``val.bin``'s consecutive windows dealt round-robin."""
        return range(rank, (len(self.val_tokens) - 1) // self.context_length, world)

    def eval_batches(self, batch_size: int, rank: int, world: int) -> Iterator[Batch]:
        windows = self._eval_windows(rank, world)
        for i in range(0, len(windows), batch_size):
            yield self._windows(self.val_tokens, [w * self.context_length for w in windows[i : i + batch_size]])

    def eval_batch_count(self, batch_size: int, rank: int, world: int) -> int:
        return -(-len(self._eval_windows(rank, world)) // batch_size)


def write_tokens(path: Path, tokens: np.ndarray | Tensor | list[int]) -> None:
    """Write token ids in the format ``TokenData`` reads (for preparing data and for tests)."""
    array = np.asarray(tokens)
    if array.size and (array.min() < 0 or array.max() >= 1 << 16):
        raise ValueError(f"{path}: token ids must fit in uint16 (0..65535), got {array.min()}..{array.max()}")
    array.astype("<u2").tofile(path)
