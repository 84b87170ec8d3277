"""``--show-configs``: the tile configs Triton's autotuner chose for the attention kernels.

This reads the triton backend's kernel objects (``_fwd_kernel``, ``_bwd_dkdv_kernel``,
``_bwd_dq_kernel``), which are not tzrec-ops's public API: if they move, the line says so
instead of failing the benchmark.
"""

from __future__ import annotations

import importlib

KERNELS = (("fwd", "_fwd_kernel"), ("dkdv", "_bwd_dkdv_kernel"), ("dq", "_bwd_dq_kernel"))


def chosen_configs() -> str:
    """``fwd 128x32 halves w4 s3; dkdv ...``: BLOCK_MxBLOCK_N, ``halves`` when the forward's
    query block runs as two row halves, warps, stages and ``rN`` for a register cap; a kernel
    not tuned yet is left out."""
    try:
        impl = importlib.import_module("tzrec_ops.backends.triton.hstu_attention")
    except ImportError as exc:
        return f"unknown ({exc})"
    chosen = []
    for label, name in KERNELS:
        config = getattr(getattr(impl, name, None), "best_config", None)
        if config is not None:
            kw = config.kwargs
            halves = " halves" if kw.get("Q_SPLITS", 1) == 2 else ""
            cap = f" r{config.maxnreg}" if config.maxnreg else ""
            chosen.append(f"{label} {kw['BLOCK_M']}x{kw['BLOCK_N']}{halves} "
                          f"w{config.num_warps} s{config.num_stages}{cap}")
    return "; ".join(chosen)
