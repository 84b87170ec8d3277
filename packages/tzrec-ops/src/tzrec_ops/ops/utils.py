"""Small utilities shared by ops and kernels: contiguity and autotune keys."""

from __future__ import annotations

import threading
from typing import List, Sequence

import torch

__all__ = [
    "switch_to_contiguous_if_needed",
    "prev_power_of_2",
    "next_power_of_2",
    "set_static_max_seq_lens",
    "set_use_runtime_max_seq_len",
    "autotune_max_seq_len",
]


def tracing() -> bool:
    """True while torch.compile, torch.export or FX symbolic tracing runs the code."""
    return torch.compiler.is_compiling() or torch.fx._symbolic_trace.is_fx_symbolic_tracing()


def switch_to_contiguous_if_needed(x: torch.Tensor) -> torch.Tensor:
    """``x`` if its last dimension is contiguous (row strides may be anything), else a copy."""
    if torch.compiler.is_compiling():
        torch._check(x.size(0) >= 0)
    if x.stride(-1) == 1:
        return x
    return x.contiguous()


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for non-negative ints (or SymInts while tracing); the plain Python
    arithmetic costs a fraction of ``triton.cdiv``'s call on every kernel launch."""
    return (a + b - 1) // b


def prev_power_of_2(n: int) -> int:
    """The largest power of two <= ``n`` (``n >= 1``): 30 -> 16, 32 -> 32, 33 -> 32."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    return 1 << (int(n).bit_length() - 1)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= ``n`` (``n >= 1``)."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    return 1 << (int(n) - 1).bit_length()


_lock = threading.Lock()
_static_max_seq_lens: List[int] = []
_use_runtime_max_seq_len: bool = True


def set_static_max_seq_lens(lens: Sequence[int]) -> None:
    """Autotune on these sequence lengths only: a call uses the smallest one >= its length.

    With a static list set, kernels tune once per listed length, which keeps AOT-compiled
    models to a fixed set of configs. An empty list restores runtime keys.
    """
    global _static_max_seq_lens
    if any(int(n) < 1 for n in lens):
        raise ValueError(f"static max sequence lengths must be >= 1, got {list(lens)}")
    with _lock:
        _static_max_seq_lens = sorted(int(n) for n in lens)


def set_use_runtime_max_seq_len(enabled: bool) -> None:
    """Key autotuning on ``prev_power_of_2(max_seq_len)`` even when a static list is set."""
    global _use_runtime_max_seq_len
    with _lock:
        _use_runtime_max_seq_len = bool(enabled)


def autotune_max_seq_len(runtime_max_seq_len: int) -> int:
    """The quantized sequence length that autotune caches are keyed on.

    Unlike a key that collapses to a constant when nothing is configured, the default here
    is ``prev_power_of_2(max_seq_len)``, so configurations follow the problem size (one
    tuning per power of two). With :func:`set_static_max_seq_lens` and runtime keys turned
    off, the key is the smallest static length >= the runtime one (or the largest).
    """
    n = max(int(runtime_max_seq_len), 1)
    if _use_runtime_max_seq_len or not _static_max_seq_lens:
        return prev_power_of_2(n)
    for candidate in _static_max_seq_lens:
        if candidate >= n:
            return candidate
    return _static_max_seq_lens[-1]
