"""``--show-configs``: the tile configs Triton's autotuner chose for the attention kernels.

The kernels come from tzrec-ops' ``tzrec_ops.backends.triton.hstu_attention.attention_kernels``
(those for head dims up to 128); without triton the line says why instead of failing the
benchmark.
"""

from __future__ import annotations

import importlib

#: (label, kernel name of ``attention_kernels()``), in launch order
KERNELS = (
    ("fwd", "hstu_attention_fwd"),
    ("dkdv", "hstu_attention_bwd_dkdv"),
    ("dq", "hstu_attention_bwd_dq"),
)


def chosen_configs() -> str:
    """``fwd 128x32 halves w4 s3; dkdv ...``: BLOCK_MxBLOCK_N, ``halves`` when the forward's
    query block runs as two row halves, warps, stages and ``rN`` for a register cap; a kernel
    not tuned yet is left out."""
    try:
        impl = importlib.import_module("tzrec_ops.backends.triton.hstu_attention")
    except ImportError as exc:
        return f"unknown ({exc})"
    kernels = impl.attention_kernels()
    chosen = []
    for label, name in KERNELS:
        config = getattr(kernels[name], "best_config", None)
        if config is not None:
            kw = config.kwargs
            halves = " halves" if kw.get("Q_SPLITS", 1) == 2 else ""
            cap = f" r{config.maxnreg}" if config.maxnreg else ""
            chosen.append(f"{label} {kw['BLOCK_M']}x{kw['BLOCK_N']}{halves} "
                          f"w{config.num_warps} s{config.num_stages}{cap}")
    return "; ".join(chosen)
