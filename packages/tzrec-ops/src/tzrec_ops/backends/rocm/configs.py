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


def _hstu_attention_configs(tiles: List[tuple], **kernel_args: int) -> List[Any]:
    """MI200/MI300 candidates: 16/32-wide MFMA, one or two stages, kpack 2; ``kernel_args``
    are added to every config."""
    import triton

    return [
        triton.Config(
            {"BLOCK_M": bm, "BLOCK_N": bn, "matrix_instr_nonkdim": nonk, "waves_per_eu": 0,
             "kpack": 2, **kernel_args},
            num_warps=warps,
            num_stages=stages,
        )
        for bm, bn in tiles
        for warps in (4, 8)
        for stages in (1, 2)
        for nonk in (16, 32)
    ]


_BUILDERS["hstu_attention_fwd"] = lambda: _hstu_attention_configs(
    [(64, 64), (128, 64), (128, 32)], Q_SPLITS=1
)
_BUILDERS["hstu_attention_bwd_dq"] = lambda: _hstu_attention_configs([(64, 64), (128, 32)])
_BUILDERS["hstu_attention_bwd_dkdv"] = lambda: _hstu_attention_configs(
    [(32, 64), (64, 64), (32, 128)]
)


# -- GEMMs and row kernels of the STU ops (backends/triton/{mm,jagged,layer_norm,position}.py) --


def _gemm_configs(tiles: List[tuple], group_m: bool) -> List[Any]:
    """MI200/MI300 GEMM candidates: 16-wide MFMA, kpack 2, one or two stages."""
    import triton

    return [
        triton.Config(
            {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "matrix_instr_nonkdim": 16,
             "waves_per_eu": 0, "kpack": 2, **({"GROUP_M": 8} if group_m else {})},
            num_warps=warps,
            num_stages=stages,
        )
        for bm, bn, bk, warps in tiles
        for stages in (1, 2)
    ]


def _row_configs() -> List[Any]:
    """Row-wise kernels (norms): the wave is 64 lanes, so fewer warps cover a row."""
    import triton

    return [triton.Config({}, num_warps=w) for w in (1, 2, 4, 8)]


def _block_n_configs() -> List[Any]:
    import triton

    return [triton.Config({"BLOCK_N": n}, num_warps=w) for n in (16, 32, 64) for w in (2, 4)]


_BUILDERS["addmm"] = lambda: _gemm_configs(
    [(256, 256, 32, 8), (128, 128, 64, 4), (128, 256, 32, 8), (64, 128, 64, 4)], group_m=True)
_BUILDERS["jagged_dense_bmm"] = lambda: _gemm_configs(
    [(128, 128, 32, 8), (64, 128, 64, 4), (64, 64, 64, 4)], group_m=False)
_BUILDERS["jagged_jagged_bmm"] = _BUILDERS["jagged_dense_bmm"]
_BUILDERS["norm_fwd"] = _row_configs
_BUILDERS["norm_bwd"] = _row_configs
_BUILDERS["jagged_concat_split"] = _block_n_configs
_BUILDERS["add_position_fwd"] = _block_n_configs
_BUILDERS["add_timestamp_fwd"] = _block_n_configs
