"""Host memory: keep what one training step frees for the next step instead of handing it back to the OS.

Why: on the CPU, backward allocates every gradient afresh and the step frees it (the engine's optimizers set them
to None, as ``zero_grad()`` does). glibc's malloc returns freed memory at the top of its heap to the OS (``trim``)
and serves blocks above its mmap threshold with fresh mappings, so every step faults the gradients' pages in again:
for a 26 MB model, 5,000-11,000 page faults and 10-20 ms of kernel time per step, about 10% of a 2-worker step on
loopback (scripts/BENCHMARKS.md, "An outside harness"). Whether a given script pays it depends on its allocation
pattern by chance: torch DDP's persistent buckets keep its heap from trimming (0 faults per step), a plain loop and
decent-dp fault on every step. PyTorch's CPU tuning guide answers with jemalloc or tcmalloc (``LD_PRELOAD``); this
module gets the same effect from glibc itself, with no dependency: a fixed mmap threshold (glibc's largest, 32 MB)
and a trim threshold of 1 GB, set once per process with ``mallopt`` when an engine has parameters on the CPU.

What it costs: freed memory up to 1 GB stays with the process (training reuses it on the next step anyway); blocks
over 32 MB (a gradient that large) are still mapped afresh. ``DECENT_TRAIN_HOST_MALLOC=keep`` (``auto`` is the
default) leaves malloc as it is; so do settings of the user's own (``MALLOC_TRIM_THRESHOLD_``, ``MALLOC_MMAP_THRESHOLD_``, ``GLIBC_TUNABLES``) and
a C library other than glibc.
"""

from __future__ import annotations

import ctypes
import os

__all__ = ["MALLOC_ENV", "host_malloc_choice", "keep_freed_host_memory"]

MALLOC_ENV = "DECENT_TRAIN_HOST_MALLOC"
MALLOC_CHOICES = ("auto", "keep")
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's malloc.h
_MMAP_THRESHOLD = 32 * 2**20  # glibc refuses more (HEAP_MAX_SIZE / 2 on 64-bit)
_TRIM_THRESHOLD = 2**30
_USER_SETTINGS = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_")

_outcome: str | None = None


def keep_freed_host_memory() -> str:
    """Set glibc's malloc to keep freed memory (once per process); what was done, in a few words for the log."""
    global _outcome
    if _outcome is None:
        _outcome = _configure()
    return _outcome


def host_malloc_choice() -> str:
    """``$DECENT_TRAIN_HOST_MALLOC``: ``auto`` (the default: keep freed memory) or ``keep`` (malloc as it is)."""
    choice = os.environ.get(MALLOC_ENV, "auto").lower() or "auto"
    if choice not in MALLOC_CHOICES:
        raise ValueError(f"{MALLOC_ENV}={choice!r}: valid are {', '.join(MALLOC_CHOICES)}")
    return choice


def _configure() -> str:
    if host_malloc_choice() == "keep":
        return f"malloc left as it is ({MALLOC_ENV}=keep)"
    user = [name for name in _USER_SETTINGS if name in os.environ]
    if "glibc.malloc" in os.environ.get("GLIBC_TUNABLES", ""):
        user.append("GLIBC_TUNABLES")
    if user:
        return f"malloc left to the user's {', '.join(user)}"
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018 -- glibc only: another C library's mallopt means something else
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return "malloc left as it is (not glibc)"
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    if mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD) != 1 or mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD) != 1:
        return "malloc left as it is (mallopt refused)"
    return "malloc keeps freed memory (mmap threshold 32 MB, trim threshold 1 GB)"
