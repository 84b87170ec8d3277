"""Jagged HSTU attention on Triton: backends ``triton`` (pointer loads) and ``triton_tma``.

Layers, top to bottom: the kernels (``_attention_kernels``, autotuned here), the launchers
:func:`hstu_attention_fwd` / :func:`hstu_attention_bwd`, the ``torch.library`` ops
(``tzrec_ops::hstu_mha_triton[_tma]`` with autograd, ``tzrec_ops::delta_hstu_mha_triton[_tma]``
forward only), and the backend functions the registry calls.

Decisions:

* Head dims need not be powers of two: tiles are padded to the next power of two (>= 16)
  with masked loads and stores, and the padding costs compute, not correctness.
* SiLU's sigmoid uses the hardware ``tanh.approx`` for bf16 inputs (fp32 and fp16 keep the
  exact sigmoid); ``1 / S`` and ``alpha`` are applied once to the fp32 accumulators.
* The backward is deterministic: dK/dV and dQ are separate passes, no atomics; dQ, dK and
  dV accumulate in fp32 registers and are rounded once to the input dtype.
* Workspace: none beyond the outputs and gradients (O(tokens * H * d)); nothing N x N.
* ``triton_tma`` reads through per-sequence tensor descriptors built from each tensor's real
  strides. TMA needs 16-byte aligned row/head strides and storage offsets; a tensor that is
  not aligned (e.g. an odd slice of a fused buffer) is read through pointers instead, in the
  same kernel, so the results never depend on alignment. The plugin offers ``triton_tma``
  for bfloat16 attention only (see ``refusals.tma_call_rejection``); other dtypes reaching
  the ``_tma`` ops directly are read through pointers too.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Optional, Tuple

import torch
import triton

from tzrec_ops.backends.triton import _attention_kernels as kernels
from tzrec_ops.backends.triton import autotune
from tzrec_ops.backends.triton._eager import launchable, triton_library_op
from tzrec_ops.backends.triton._kernel_utils import quantize_rows
from tzrec_ops.backends.triton.length_order import length_order
from tzrec_ops.backends.triton.refusals import TMA_ATTENTION_DTYPE
from tzrec_ops.backends.triton.refusals import reject_unsupported_attention as _reject_unsupported
from tzrec_ops.ops.utils import (
    autotune_max_seq_len,
    cdiv,
    next_power_of_2,
    switch_to_contiguous_if_needed,
)

__all__ = [
    "attention_kernels",
    "hstu_attention_fwd",
    "hstu_attention_bwd",
    "hstu_mha",
    "hstu_mha_tma",
    "delta_hstu_mha",
    "delta_hstu_mha_tma",
]

# The kernels, by the names the ``tzrec_ops_autotune_configs`` hook knows them by, in launch
# order. Each has one autotuner for head dims <= 128 and one for wider heads (smaller tiles),
# built on first use: building one asks the plugins for extra configs, which discovers them,
# and importing this module (e.g. to load an exported program) must not.
_KERNELS = {
    autotune.FWD: kernels._hstu_attn_fwd_kernel,
    autotune.BWD_DKDV: kernels._hstu_attn_bwd_dkdv_kernel,
    autotune.BWD_DQ: kernels._hstu_attn_bwd_dq_kernel,
}
_built: Dict[Tuple[str, bool], Any] = {}


def _tuned(kernel: str, wide: bool) -> Any:
    """The autotuner of ``kernel`` (a key of :data:`_KERNELS`) for wide heads or not, built
    once."""
    # a plain bool: under symbolic shapes ``wide`` may come as a SymBool, which cannot be
    # part of a dict key (bool() guards on it, as the launch depends on it anyway)
    wide = bool(wide)
    found = _built.get((kernel, wide))
    if found is None:
        tuner = autotune.autotuned(kernel, _KERNELS[kernel], wide)
        found = _built.setdefault((kernel, wide), tuner)
    return found


def attention_kernels(wide: bool = False) -> Dict[str, Any]:
    """The autotuned attention kernels the launchers run, for inspection and tuning work.

    Args:
        wide: the kernels for head dims above 128 (``max(A, V) > 128``), which have their
            own, smaller tiles; else those for head dims up to 128.

    Returns:
        ``{autotune.FWD: ..., autotune.BWD_DKDV: ..., autotune.BWD_DQ: ...}``
        (``"hstu_attention_fwd"``, ``"hstu_attention_bwd_dkdv"``, ``"hstu_attention_bwd_dq"``,
        the kernel names of the ``tzrec_ops_autotune_configs`` hook), in launch order, each a
        ``triton.runtime.Autotuner``: ``.configs`` are its candidates, ``.best_config`` the
        config chosen at the last tuned key (absent before the first launch), ``.cache`` the
        choice per key. The same objects every call; building them the first time asks the
        plugins for autotune configs.
    """
    return {kernel: _tuned(kernel, wide) for kernel in _KERNELS}


def _block_d(dim: int) -> int:
    if dim > 256:
        raise ValueError(f"head dims up to 256 are supported, got {dim}")
    return max(16, next_power_of_2(dim))


def _precision(dtype: torch.dtype) -> str:
    """``tl.dot`` input precision: fp32 follows ``torch.backends.cuda.matmul.allow_tf32``
    (half-precision dots ignore it; "ieee" is the one value every target accepts)."""
    if dtype == torch.float32 and not autotune.interpreting():
        return "tf32" if torch.backends.cuda.matmul.allow_tf32 else "ieee"
    return "tf32" if torch.version.hip is None and not autotune.interpreting() else "ieee"


def _upcast(dtype: torch.dtype) -> bool:
    """The interpreter computes half-precision tiles in fp32 (numpy has no bf16 matmul)."""
    return autotune.interpreting() and dtype != torch.float32


def _fast_silu(dtype: torch.dtype) -> bool:
    """bf16 on NVIDIA uses the hardware tanh for sigmoid (see ``_sigmoid``); its error
    (~2^-11) is far below bf16's rounding, but not below fp16's, so fp16 keeps the exact one."""
    return dtype == torch.bfloat16 and not autotune.interpreting() and torch.version.hip is None


def _tma_aligned(*tensors: torch.Tensor) -> bool:
    """Whether every tensor's storage offset and row/head strides are 16-byte multiples."""
    for t in tensors:
        size = t.element_size()
        for value in (t.storage_offset(), t.stride(0), t.stride(1)):
            if (value * size) % 16 != 0:
                return False
    return True


def _use_tma(enable_tma: bool, *tensors: torch.Tensor) -> bool:
    """Descriptor loads for aligned bfloat16 tensors only. fp16 and fp32 through descriptors
    failed the oracle on an H200 (see ``refusals.tma_call_rejection``); the registry never
    routes them here, but a ``*_triton_tma`` op called directly (e.g. after an export pass
    swapped it in) can, so they take the pointer loads that are tested for them."""
    if not enable_tma or any(t.dtype != TMA_ATTENTION_DTYPE for t in tensors):
        return False
    if not _tma_aligned(*tensors):
        return False
    # device-side descriptors live in a scratch buffer; the allocator is a context variable,
    # so set it on every launch (the backward runs on autograd's own thread)
    triton.set_allocator(
        lambda size, alignment, stream: torch.empty(size, dtype=torch.int8, device="cuda")
    )
    return True


def _sort_indices(seq_offsets: torch.Tensor, sort_by_length: bool) -> torch.Tensor:
    """Sequences by descending length when ``sort_by_length`` (else a placeholder)."""
    return length_order(seq_offsets) if sort_by_length else seq_offsets


def _inv_scale(max_seq_len: int, scaling_seqlen: int) -> float:
    return 1.0 / (max_seq_len if scaling_seqlen == -1 else scaling_seqlen)


def hstu_attention_fwd(
    max_seq_len: int,
    alpha: float,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    seq_offsets: torch.Tensor,
    causal: bool,
    num_targets: Optional[torch.Tensor],
    max_attn_len: int,
    contextual_seq_len: int,
    sort_by_length: bool,
    scaling_seqlen: int,
    enable_tma: bool,
    delta_size: int = 0,
    delta_k: Optional[torch.Tensor] = None,
    delta_v: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Launch the forward kernel.

    Args:
        q: ``[L, H, A]``, or ``[B * delta_size, H, A]`` (each sequence's last ``delta_size``
            positions) when ``delta_size > 0``.
        k: ``[L, H, A]``; v: ``[L, H, V]``; seq_offsets: ``[B + 1]`` int32/int64.
        delta_k, delta_v: ``[B * delta_size, H, A | V]`` (with ``delta_size > 0``): the split
            cached form, k/v/seq_offsets then hold only each sequence's cached prefix.
    Returns:
        ``[rows of q, H, V]`` in v's dtype.
    """
    q, k, v = (switch_to_contiguous_if_needed(t) for t in (q, k, v))
    split = delta_k is not None and delta_v is not None
    if split:
        delta_k, delta_v = (switch_to_contiguous_if_needed(t) for t in (delta_k, delta_v))
    else:
        # unused by the kernel; a placeholder pointer must be an input, never the output
        delta_k, delta_v = k, v
    seq_offsets = seq_offsets.contiguous()
    rows, heads, dim_q = q.shape
    dim_v = v.shape[2]
    batch = seq_offsets.shape[0] - 1
    out = torch.empty((rows, heads, dim_v), dtype=v.dtype, device=v.device)
    if batch == 0 or rows == 0:
        return out.zero_()
    is_delta = delta_size > 0
    targets = num_targets.contiguous() if num_targets is not None else seq_offsets
    sort_idx = _sort_indices(seq_offsets, sort_by_length and not is_delta)
    grid_rows = delta_size if is_delta else max_seq_len

    def grid(meta):
        return (cdiv(grid_rows, meta["BLOCK_M"]), batch * heads)

    kernel = _tuned(autotune.FWD, max(dim_q, dim_v) > 128)
    # The split form reads every cached key once per query block of D rows: it is
    # memory-bound, so it always takes pointer loads (no per-sequence descriptors to build
    # for two sources), also on triton_tma.
    launchable(kernel)[grid](
        q, k, v, delta_k, delta_v, out, seq_offsets, targets, sort_idx,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        delta_k.stride(0), delta_k.stride(1), delta_v.stride(0), delta_v.stride(1),
        out.stride(0), out.stride(1),
        float(alpha), _inv_scale(max_seq_len, scaling_seqlen), max_attn_len, contextual_seq_len,
        heads, delta_size, quantize_rows(batch), autotune_max_seq_len(grid_rows),
        DIM_Q=dim_q, DIM_V=dim_v, CAUSAL=causal, HAS_TARGETS=num_targets is not None,
        HAS_CONTEXTUAL=contextual_seq_len > 0, HAS_MAX_ATTN_LEN=max_attn_len > 0,
        SORT_BY_LENGTH=sort_by_length and not is_delta, IS_DELTA=is_delta,
        SPLIT_KV=is_delta and split, PRECISION=_precision(q.dtype),
        ENABLE_TMA=_use_tma(enable_tma and not split, q, k, v),
        UPCAST=_upcast(q.dtype), FAST_SILU=_fast_silu(q.dtype), BLOCK_D_Q=_block_d(dim_q),
        BLOCK_D_V=_block_d(dim_v),
    )
    return out


def hstu_attention_bwd(
    max_seq_len: int,
    alpha: float,
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    seq_offsets: torch.Tensor,
    causal: bool,
    num_targets: Optional[torch.Tensor],
    max_attn_len: int,
    contextual_seq_len: int,
    sort_by_length: bool,
    scaling_seqlen: int,
    enable_tma: bool,
    grads: Optional[Tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch the backward; returns ``(dq, dk, dv)`` shaped like q, k, v: new contiguous
    tensors, or ``grads`` (views with unit last stride, e.g. column slices of one fused
    gradient buffer) written in place.

    Two passes: dK/dV, then dQ, each accumulating in fp32 registers without atomics, so the
    gradients are bitwise reproducible."""
    dout, q, k, v = (switch_to_contiguous_if_needed(t) for t in (dout, q, k, v))
    seq_offsets = seq_offsets.contiguous()
    total, heads, dim_q = q.shape
    dim_v = v.shape[2]
    batch = seq_offsets.shape[0] - 1
    if grads is None:
        grads = tuple(torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v))
    dq, dk, dv = grads
    if batch == 0 or total == 0:
        return dq.zero_(), dk.zero_(), dv.zero_()
    targets = num_targets.contiguous() if num_targets is not None else seq_offsets
    sort_idx = _sort_indices(seq_offsets, sort_by_length)
    flags = dict(
        DIM_Q=dim_q, DIM_V=dim_v, CAUSAL=causal, HAS_TARGETS=num_targets is not None,
        HAS_CONTEXTUAL=contextual_seq_len > 0, HAS_MAX_ATTN_LEN=max_attn_len > 0,
        SORT_BY_LENGTH=sort_by_length, PRECISION=_precision(q.dtype),
        ENABLE_TMA=_use_tma(enable_tma, q, k, v, dout), UPCAST=_upcast(q.dtype),
        FAST_SILU=_fast_silu(q.dtype), BLOCK_D_Q=_block_d(dim_q), BLOCK_D_V=_block_d(dim_v),
    )
    scalars = (float(alpha), _inv_scale(max_seq_len, scaling_seqlen), max_attn_len,
               contextual_seq_len, heads, quantize_rows(batch),
               autotune_max_seq_len(max_seq_len))

    def grid_n(meta):
        return (cdiv(max_seq_len, meta["BLOCK_N"]), batch * heads)

    def grid_m(meta):
        return (cdiv(max_seq_len, meta["BLOCK_M"]), batch * heads)

    wide = max(dim_q, dim_v) > 128
    launchable(_tuned(autotune.BWD_DKDV, wide))[grid_n](
        q, k, v, dout, dk, dv, seq_offsets, targets, sort_idx,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        dout.stride(0), dout.stride(1), dk.stride(0), dk.stride(1), dv.stride(0), dv.stride(1),
        *scalars, **flags,
    )
    launchable(_tuned(autotune.BWD_DQ, wide))[grid_m](
        q, k, v, dout, dq, seq_offsets, targets, sort_idx,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        dout.stride(0), dout.stride(1), dq.stride(0), dq.stride(1),
        *scalars, **flags,
    )
    return dq, dk, dv


# ---------------------------------------------------------------------------------------------
# torch.library ops
# ---------------------------------------------------------------------------------------------


def _define(tma: bool):
    """Register the forward, backward and delta ops of one variant (TMA or pointer loads)."""
    suffix = "_tma" if tma else ""

    @triton_library_op(f"tzrec_ops::hstu_mha_triton{suffix}")
    def forward(
        max_seq_len: int,
        alpha: float,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        seq_offsets: torch.Tensor,
        causal: bool,
        num_targets: Optional[torch.Tensor],
        max_attn_len: int,
        contextual_seq_len: int,
        sort_by_length: bool,
        scaling_seqlen: int,
    ) -> torch.Tensor:
        return hstu_attention_fwd(
            max_seq_len, alpha, q, k, v, seq_offsets, causal, num_targets, max_attn_len,
            contextual_seq_len, sort_by_length, scaling_seqlen, tma,
        )

    @triton_library_op(f"tzrec_ops::hstu_mha_triton{suffix}_bwd")
    def backward_op(
        max_seq_len: int,
        alpha: float,
        dout: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        seq_offsets: torch.Tensor,
        causal: bool,
        num_targets: Optional[torch.Tensor],
        max_attn_len: int,
        contextual_seq_len: int,
        sort_by_length: bool,
        scaling_seqlen: int,
    ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return hstu_attention_bwd(
            max_seq_len, alpha, dout, q, k, v, seq_offsets, causal, num_targets, max_attn_len,
            contextual_seq_len, sort_by_length, scaling_seqlen, tma,
        )

    @triton_library_op(f"tzrec_ops::delta_hstu_mha_triton{suffix}")
    def delta(
        max_seq_len: int,
        alpha: float,
        delta_q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        seq_offsets: torch.Tensor,
        num_targets: Optional[torch.Tensor],
        max_attn_len: int,
        contextual_seq_len: int,
        scaling_seqlen: int,
        delta_k: Optional[torch.Tensor] = None,
        delta_v: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        batch = seq_offsets.shape[0] - 1
        delta_size = delta_q.shape[0] // batch if batch > 0 else 0
        return hstu_attention_fwd(
            max_seq_len, alpha, delta_q, k, v, seq_offsets, True, num_targets, max_attn_len,
            contextual_seq_len, False, scaling_seqlen, tma, delta_size=delta_size,
            delta_k=delta_k, delta_v=delta_v,
        )

    @forward.register_fake
    def _(max_seq_len, alpha, q, k, v, *args):
        return v.new_empty((q.shape[0], q.shape[1], v.shape[2]))

    @backward_op.register_fake
    def _(max_seq_len, alpha, dout, q, k, v, *args):
        return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)

    @delta.register_fake
    def _(max_seq_len, alpha, delta_q, k, v, *args):
        return v.new_empty((delta_q.shape[0], delta_q.shape[1], v.shape[2]))

    def setup_context(ctx, inputs, output):
        (max_seq_len, alpha, q, k, v, seq_offsets, causal, num_targets, max_attn_len,
         contextual_seq_len, sort_by_length, scaling_seqlen) = inputs
        ctx.save_for_backward(q, k, v, seq_offsets, num_targets)
        ctx.options = (max_seq_len, alpha, causal, max_attn_len, contextual_seq_len,
                       sort_by_length, scaling_seqlen)

    def backward(ctx, dout):
        q, k, v, seq_offsets, num_targets = ctx.saved_tensors
        (max_seq_len, alpha, causal, max_attn_len, contextual_seq_len, sort_by_length,
         scaling_seqlen) = ctx.options
        dq, dk, dv = backward_op(
            max_seq_len, alpha, dout, q, k, v, seq_offsets, causal, num_targets, max_attn_len,
            contextual_seq_len, sort_by_length, scaling_seqlen,
        )
        return None, None, dq, dk, dv, None, None, None, None, None, None, None

    forward.register_autograd(backward, setup_context=setup_context)
    return forward, delta


# ---------------------------------------------------------------------------------------------
# backend functions (the public signatures minus ``backend``)
# ---------------------------------------------------------------------------------------------


Attention = Callable[..., torch.Tensor]


def _backend_functions(tma: bool) -> Tuple[Attention, Attention]:
    """The ``hstu_mha`` and ``delta_hstu_mha`` implementations of backend ``triton``
    (pointer loads) or, with ``tma``, ``triton_tma`` (tensor descriptors): one kernel with a
    flag, each variant with its own ``tzrec_ops::*_triton[_tma]`` ops (see :func:`_define`)."""
    forward_op, delta_op = _define(tma)
    suffix = "_tma" if tma else ""
    loads = "tensor descriptors" if tma else "pointer loads"

    def hstu_mha(
        max_seq_len: int,
        alpha: float,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        seq_offsets: torch.Tensor,
        causal: bool = True,
        dropout_pr: float = 0.0,
        training: bool = True,
        num_targets: Optional[torch.Tensor] = None,
        max_attn_len: int = 0,
        contextual_seq_len: int = 0,
        min_full_attn_seq_len: int = 0,
        sort_by_length: bool = False,
        attn_func: Optional[torch.Tensor] = None,
        scaling_seqlen: int = -1,
    ) -> torch.Tensor:
        _reject_unsupported(dropout_pr, training, min_full_attn_seq_len, attn_func)
        return forward_op(
            int(max_seq_len), float(alpha), q, k, v, seq_offsets, bool(causal), num_targets,
            int(max_attn_len), int(contextual_seq_len), bool(sort_by_length), int(scaling_seqlen),
        )

    def delta_hstu_mha(
        max_seq_len: int,
        alpha: float,
        delta_q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        seq_offsets: torch.Tensor,
        num_targets: Optional[torch.Tensor] = None,
        max_attn_len: int = 0,
        contextual_seq_len: int = 0,
        scaling_seqlen: int = -1,
        *,
        delta_k: Optional[torch.Tensor] = None,
        delta_v: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        return delta_op(
            int(max_seq_len), float(alpha), delta_q, k, v, seq_offsets, num_targets,
            int(max_attn_len), int(contextual_seq_len), int(scaling_seqlen), delta_k, delta_v,
        )

    hstu_mha.__doc__ = (
        f"HSTU attention ``[L, H, V]`` with {loads} (``tzrec_ops::hstu_mha_triton{suffix}``)."
    )
    delta_hstu_mha.__doc__ = (
        f"Cached attention ``[B * D, H, V]`` of each sequence's last D queries (forward only) "
        f"with {loads} (``tzrec_ops::delta_hstu_mha_triton{suffix}``); with ``delta_k``/"
        f"``delta_v`` the split form, which reads the cache in place through pointer loads "
        f"(see :func:`hstu_attention_fwd`)."
    )
    for fn in (hstu_mha, delta_hstu_mha):
        fn.__name__ = fn.__qualname__ = fn.__name__ + suffix
    return hstu_mha, delta_hstu_mha


hstu_mha, delta_hstu_mha = _backend_functions(tma=False)
hstu_mha_tma, delta_hstu_mha_tma = _backend_functions(tma=True)
