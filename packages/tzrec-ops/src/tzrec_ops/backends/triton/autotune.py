"""Autotune configurations of the HSTU attention kernels.

CUDA configs live here; other platforms add theirs through the ``tzrec_ops_autotune_configs``
hook (the ROCm plugin answers it on HIP, see ``backends/rocm/configs.py``), and when a plugin
answers, its configs replace the CUDA ones. Under ``TRITON_INTERPRET=1`` every kernel gets one
small config, so CPU runs never benchmark. ``TZREC_OPS_TRITON_AUTOTUNE=0`` (read at import)
keeps only each kernel's first candidate: quick compiles for tests, no tuning.

Every kernel is keyed on ``AUTOTUNE_Z = prev_power_of_2(B)``, the heads, the quantized
``AUTOTUNE_MAX_SEQ_LEN = autotune_max_seq_len(max_seq_len)``, the head dims and the mask
flags, so a configuration is chosen per problem size rather than once per process. Each
candidate is timed over at least :data:`MIN_TIMED_RUNS` runs (:func:`bench_candidate`).
"""

from __future__ import annotations

import os
from typing import Any, Callable, Dict, List, Sequence, Tuple

import torch
import triton
import triton.testing

from tzrec_ops.backends.triton._kernel_utils import AUTOTUNE_ENV, interpreting
from tzrec_ops.registry import autotune_configs

__all__ = [
    "BWD_DKDV",
    "BWD_DQ",
    "FWD",
    "FWD_KEY",
    "KEY",
    "MIN_TIMED_RUNS",
    "autotuned",
    "bench_candidate",
    "configs",
    "tile_config",
    "tuned_keys",
]

FWD = "hstu_attention_fwd"
BWD_DQ = "hstu_attention_bwd_dq"
BWD_DKDV = "hstu_attention_bwd_dkdv"

KEY = [
    "AUTOTUNE_Z",
    "H",
    "AUTOTUNE_MAX_SEQ_LEN",
    "DIM_Q",
    "DIM_V",
    "CAUSAL",
    "HAS_MAX_ATTN_LEN",
    "ENABLE_TMA",
]
FWD_KEY = KEY + ["delta_size", "IS_DELTA", "SPLIT_KV"]

# (BLOCK_M, BLOCK_N, num_warps, num_stages[, Q_SPLITS[, maxnreg]]) for head dims <= 128.
# The figures that chose these candidates are in docs/tzrec-ops-measurements.md and the
# CHANGELOG.
# Q_SPLITS=2 runs the forward's query block as two row halves of 64 rows per warp group, so one
# half's SiLU overlaps the other's value product.
# 64x16 w4 s4 is for short sequences, where the forward waits on memory: capped at 128
# registers (no spills, with pointer or TMA loads), four programs share an SM and more loads
# are in flight.
# 128x32 w8 s3 capped at 128 registers runs two 8-warp programs per SM (medium lengths).
# The backward tiles have no warp-specialized variant: Triton 3.6's automatic warp
# specialization (``tl.range(..., warp_specialize=True)`` on the unmasked query loop of dK/dV
# and key loop of dQ) fails its NVGPUWarpSpecialization pass for every 4-warp tile, and the
# 8-warp tiles it compiles time like the same tiles without it on long sequences and slower
# on short ones. A Gluon probe of the causal dK/dV pass with explicit warpgroups was barely
# faster than this kernel, and warp specialization added nothing to it.
_CUDA: Dict[str, Sequence[Tuple[int, ...]]] = {
    FWD: (
        (128, 64, 8, 2),
        (128, 64, 8, 3),
        (128, 128, 8, 2),
        (64, 64, 4, 3),
        (64, 128, 4, 2),
        (128, 32, 4, 3),
        (64, 32, 4, 2),
        (128, 64, 4, 2),
        (128, 32, 4, 3, 2),
        (128, 64, 4, 2, 2),
        (128, 32, 4, 4, 2),
        (64, 16, 4, 4, 1, 128),
        (128, 32, 8, 3, 1, 128),
    ),
    BWD_DQ: (
        (128, 64, 8, 2),
        (128, 32, 8, 2),
        (64, 64, 4, 2),
        (64, 128, 8, 2),
        (64, 32, 4, 3),
        (128, 64, 8, 3),
        (128, 32, 4, 3),
    ),
    BWD_DKDV: (
        (64, 128, 8, 2),
        (32, 128, 8, 2),
        (64, 64, 4, 2),
        (32, 64, 4, 2),
        (64, 64, 8, 3),
        (32, 64, 4, 3),
    ),
}
# head dims in (128, 256]: the fp32 accumulators and operand tiles are twice as wide, so the
# tiles shrink to stay in registers and under the 227 KB of shared memory of a Hopper SM
_CUDA_WIDE: Dict[str, Sequence[Tuple[int, ...]]] = {
    FWD: ((64, 64, 4, 2), (64, 32, 4, 2), (128, 32, 8, 2)),
    BWD_DQ: ((64, 32, 4, 2), (64, 64, 8, 2), (32, 64, 4, 2)),
    BWD_DKDV: ((32, 32, 4, 2), (64, 32, 8, 2), (32, 64, 8, 2)),
}
# One config per kernel for the interpreter: small grids, and several key/query blocks per
# sequence at test sizes so the loop bounds are exercised.
_INTERPRETER = {FWD: (32, 16, 4, 1, 1), BWD_DQ: (32, 16, 4, 1), BWD_DKDV: (16, 32, 4, 1)}


def _device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def configs(kernel: str, wide: bool = False) -> List[triton.Config]:
    """The autotune candidates of ``kernel`` on this machine (``wide``: head dims > 128)."""
    if interpreting():
        return [tile_config(kernel, _INTERPRETER[kernel])]
    table = _CUDA_WIDE if wide else _CUDA
    candidates = list(autotune_configs(kernel, _device())) or [
        tile_config(kernel, tile) for tile in table[kernel]
    ]
    if os.environ.get(AUTOTUNE_ENV, "1") == "0":
        # no tuning: the smallest tile, the one config that fits shared memory in every dtype
        return [min(candidates, key=_tile_volume)]
    return candidates


def tile_config(kernel: str, tile: Tuple[int, ...]) -> triton.Config:
    """``(BLOCK_M, BLOCK_N, num_warps, num_stages[, Q_SPLITS[, maxnreg]])`` as a config of
    ``kernel``; the forward always gets an explicit ``Q_SPLITS`` (1 unless given), and
    ``maxnreg`` caps the registers per thread (none unless given)."""
    block_m, block_n, warps, stages = tile[:4]
    kwargs = {"BLOCK_M": block_m, "BLOCK_N": block_n}
    if kernel == FWD:
        kwargs["Q_SPLITS"] = tile[4] if len(tile) > 4 else 1
    maxnreg = tile[5] if len(tile) > 5 else None
    return triton.Config(kwargs, num_warps=warps, num_stages=stages, maxnreg=maxnreg)


def _tile_volume(config: triton.Config) -> int:
    return config.kwargs["BLOCK_M"] * config.kwargs["BLOCK_N"] * max(config.num_stages, 1)


# Triton's default of 100 ms gives a 15 ms kernel (the forward at N=4096, B=512) six timed
# runs: too few to tell apart configs 2-3% apart on a power-capped GPU.
MIN_TIMED_RUNS = 25
_MIN_BENCH_MS = 100.0


def bench_candidate(kernel_call: Callable[[], Any], quantiles: Sequence[float]) -> List[float]:
    """Times of one autotune candidate at ``quantiles`` (the first is the median): Triton's
    100 ms benchmark, repeated over :data:`MIN_TIMED_RUNS` runs when it held fewer."""
    times = triton.testing.do_bench(kernel_call, rep=_MIN_BENCH_MS, quantiles=list(quantiles))
    if times[0] * MIN_TIMED_RUNS > _MIN_BENCH_MS:
        times = triton.testing.do_bench(kernel_call, rep=times[0] * MIN_TIMED_RUNS,
                                        quantiles=list(quantiles))
    return times


def autotuned(kernel: str, fn: Callable[..., Any], wide: bool = False) -> Any:
    """``fn`` wrapped in ``triton.autotune`` with ``kernel``'s configs and key."""
    return triton.autotune(configs=configs(kernel, wide), key=FWD_KEY if kernel == FWD else KEY,
                           do_bench=bench_candidate)(fn)


def tuned_keys() -> int:
    """How many problem keys the autotuners of the eagerly launched tzrec-ops kernels have
    tuned in this process so far (a new key benchmarks its candidates once): read it before
    and after a timed run to see whether tuning happened inside it."""
    from tzrec_ops.backends.triton._eager import _LAUNCHERS

    return sum(len(getattr(tuner, "cache", ())) for tuner in list(_LAUNCHERS))
