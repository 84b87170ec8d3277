"""HIP autotune configurations, keyed by kernel name.

Each Triton kernel module that wants ROCm tuning adds a builder here under its stable kernel
name (the same name it passes to :func:`tzrec_ops.registry.autotune_configs`).
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List

_BUILDERS: Dict[str, Callable[[], List[Any]]] = {}


def for_kernel(kernel: str) -> List[Any]:
    """The HIP configs for ``kernel`` (empty when it has none)."""
    builder = _BUILDERS.get(kernel)
    return builder() if builder is not None else []
