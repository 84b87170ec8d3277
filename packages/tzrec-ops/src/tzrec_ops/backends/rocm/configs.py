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


# -- HSTU attention (backends/triton/_attention_kernels.py) -----------------------------------


def _hstu_attention_configs(tiles: List[tuple]) -> List[Any]:
    """MI200/MI300 candidates: 16/32-wide MFMA, one or two stages, kpack 2."""
    import triton

    return [
        triton.Config(
            {"BLOCK_M": bm, "BLOCK_N": bn, "matrix_instr_nonkdim": nonk, "waves_per_eu": 0,
             "kpack": 2},
            num_warps=warps,
            num_stages=stages,
        )
        for bm, bn in tiles
        for warps in (4, 8)
        for stages in (1, 2)
        for nonk in (16, 32)
    ]


_BUILDERS["hstu_attention_fwd"] = lambda: _hstu_attention_configs([(64, 64), (128, 64), (128, 32)])
_BUILDERS["hstu_attention_bwd_dq"] = lambda: _hstu_attention_configs([(64, 64), (128, 32)])
_BUILDERS["hstu_attention_bwd_dkdv"] = lambda: _hstu_attention_configs([(32, 64), (64, 64), (32, 128)])
