"""Triton STU building blocks: the input projection, the fused preprocess + attention, and the
fused output projection.

Legend: L = tokens, E = embedding dim, H = heads, A = q/k dim per head, V = value dim per head;
``uvqk`` is ``[L, 2H(V + A)]`` with columns ``[u | v | q | k]``.

* :func:`hstu_compute_uqvk`: Triton layer norm -> Triton addmm -> split -> SiLU(u), with the
  reference's activation-checkpointing options.
* :func:`hstu_preprocess_and_attention` (one op with one backward): layer norm -> uvqk GEMM,
  whose epilogue also writes SiLU(u) -> jagged attention on q/k/v *views* of uvqk. The backward
  allocates one ``duvqk`` buffer and writes du (SiLU's backward), dv, dq, dk into its column
  views, so the GEMM backward reads a single matrix without a concatenation. ``normed_x``
  and/or ``uvqk`` are recomputed in the backward instead of saved when the recompute flags ask
  for it. Traced (``torch.compile``, export) the four gradients get buffers of their own and
  one concatenation: Inductor cannot take kernels writing column views of a buffer that an
  earlier launch wrote (see :func:`preprocess_and_attention_bwd_op`).
* :func:`hstu_compute_output` (one op with one backward): the fused norm-mul-dropout of
  ``[u | attn | u * Norm(attn)]``, then ``out = x + y @ W`` as one GEMM. It lives in
  :mod:`._stu_output` and is re-exported here, where the registry looks for every op of
  ``tzrec_ops.ops.hstu_compute`` (:func:`tzrec_ops.contract.mirrored_op_table`).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from tzrec_ops.backends.triton import hstu_attention as attention
from tzrec_ops.backends.triton._eager import tracing, triton_library_op
from tzrec_ops.backends.triton._norm_kernels import PLAIN, norm_backward, norm_forward
from tzrec_ops.backends.triton._stu_output import hstu_compute_output
from tzrec_ops.backends.triton.layer_norm import layer_norm_op
from tzrec_ops.backends.triton.mm import addmm_fwd, matmul
from tzrec_ops.backends.triton.refusals import raise_if_refused
from tzrec_ops.backends.triton.silu import silu_backward
from tzrec_ops.ops.utils import switch_to_contiguous_if_needed

__all__ = ["hstu_compute_uqvk", "hstu_preprocess_and_attention", "hstu_compute_output"]

Tensors4 = Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def _split_uvqk(uvqk: torch.Tensor, num_heads: int, attn_dim: int, hidden_dim: int) -> Tensors4:
    """Column views ``(u [L, HV], v [L, H, V], q [L, H, A], k [L, H, A])`` of uvqk."""
    rows = uvqk.shape[0]
    hv, ha = num_heads * hidden_dim, num_heads * attn_dim
    u, v, q, k = torch.split(uvqk, [hv, hv, ha, ha], dim=1)
    return (
        u,
        v.view(rows, num_heads, hidden_dim),
        q.view(rows, num_heads, attn_dim),
        k.view(rows, num_heads, attn_dim),
    )


# --------------------------------------------------------------------------------------------
# hstu_compute_uqvk: composition of the registered Triton ops


def _normed(x, norm_weight, norm_bias, norm_eps):  # type: ignore[no-untyped-def]
    return layer_norm_op(x, norm_weight, norm_bias, norm_eps)[0]


def _project(normed, uvqk_weight, uvqk_bias, num_heads, attn_dim, hidden_dim):  # type: ignore[no-untyped-def]
    uvqk = addmm_fwd(uvqk_bias, normed, uvqk_weight)
    u, v, q, k = _split_uvqk(uvqk, num_heads, attn_dim, hidden_dim)
    return F.silu(u), q, k, v


def _whole_chain(
    x,
    norm_weight,
    norm_bias,
    norm_eps,
    uvqk_weight,
    uvqk_bias,
    num_heads,  # type: ignore[no-untyped-def]
    attn_dim,
    hidden_dim,
):
    normed = _normed(x, norm_weight, norm_bias, norm_eps)
    return _project(normed, uvqk_weight, uvqk_bias, num_heads, attn_dim, hidden_dim)


def _normed_uvqk(x, norm_weight, norm_bias, norm_eps, uvqk_weight, uvqk_bias):  # type: ignore[no-untyped-def]
    return addmm_fwd(uvqk_bias, _normed(x, norm_weight, norm_bias, norm_eps), uvqk_weight)


def hstu_compute_uqvk(
    x: torch.Tensor,
    norm_weight: torch.Tensor,
    norm_bias: torch.Tensor,
    norm_eps: float,
    num_heads: int,
    attn_dim: int,
    hidden_dim: int,
    uvqk_weight: torch.Tensor,
    uvqk_bias: torch.Tensor,
    recompute_normed_x_in_backward: bool = False,
    recompute_uvqk_in_backward: bool = False,
) -> Tensors4:
    """Triton backend of :func:`tzrec_ops.ops.hstu_compute.hstu_compute_uqvk`."""
    x = switch_to_contiguous_if_needed(x)
    remat_normed = recompute_normed_x_in_backward and torch.is_grad_enabled()
    remat_uvqk = recompute_uvqk_in_backward and torch.is_grad_enabled()
    dims = (num_heads, attn_dim, hidden_dim)
    if remat_normed and remat_uvqk:
        return checkpoint(
            _whole_chain,
            x,
            norm_weight,
            norm_bias,
            norm_eps,
            uvqk_weight,
            uvqk_bias,
            *dims,
            use_reentrant=False,
        )
    if remat_normed:
        uvqk = checkpoint(
            _normed_uvqk,
            x,
            norm_weight,
            norm_bias,
            norm_eps,
            uvqk_weight,
            uvqk_bias,
            use_reentrant=False,
        )
        u, v, q, k = _split_uvqk(uvqk, *dims)
        return F.silu(u), q, k, v
    normed = _normed(x, norm_weight, norm_bias, norm_eps)
    if remat_uvqk:
        return checkpoint(_project, normed, uvqk_weight, uvqk_bias, *dims, use_reentrant=False)
    return _project(normed, uvqk_weight, uvqk_bias, *dims)


# --------------------------------------------------------------------------------------------
# hstu_preprocess_and_attention: one fused op


def _uvqk_forward(
    normed: torch.Tensor,
    uvqk_weight: torch.Tensor,
    uvqk_bias: torch.Tensor,
    silu_u: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """``uvqk = normed @ W + b``; ``silu_u`` ([L, HV]), if given, gets ``silu(u)`` from the
    GEMM epilogue."""
    uvqk = torch.empty(
        (normed.shape[0], uvqk_weight.shape[1]), dtype=normed.dtype, device=normed.device
    )
    matmul(normed, uvqk_weight, uvqk, bias=uvqk_bias, silu_out=silu_u)
    return uvqk


@triton_library_op("tzrec_ops::hstu_preprocess_and_attention_triton")
def preprocess_and_attention_op(
    x: torch.Tensor,
    norm_weight: torch.Tensor,
    norm_bias: torch.Tensor,
    norm_eps: float,
    num_heads: int,
    attn_dim: int,
    hidden_dim: int,
    uvqk_weight: torch.Tensor,
    uvqk_bias: torch.Tensor,
    max_seq_len: int,
    seq_offsets: torch.Tensor,
    attn_alpha: float,
    causal: bool,
    num_targets: Optional[torch.Tensor],
    max_attn_len: int,
    contextual_seq_len: int,
    recompute_uvqk_in_backward: bool,
    recompute_normed_x_in_backward: bool,
    sort_by_length: bool,
    scaling_seqlen: int,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(u [L, HV], attn [L, HV], saved normed x, saved uvqk, mean [L], rstd [L]).

    The saved tensors are empty when the matching recompute flag is set.
    """
    normed, mean, rstd = norm_forward(
        x, None, norm_weight, norm_bias, norm_eps, 1, False, False, PLAIN, False, 0.0, None
    )
    silu_u = torch.empty((x.shape[0], num_heads * hidden_dim), dtype=x.dtype, device=x.device)
    uvqk = _uvqk_forward(normed, uvqk_weight, uvqk_bias, silu_u)
    _, v, q, k = _split_uvqk(uvqk, num_heads, attn_dim, hidden_dim)
    attn = attention.hstu_attention_fwd(
        max_seq_len,
        attn_alpha,
        q,
        k,
        v,
        seq_offsets,
        causal,
        num_targets,
        max_attn_len,
        contextual_seq_len,
        sort_by_length,
        scaling_seqlen,
        False,
    )
    return (
        silu_u,
        attn.view(x.shape[0], num_heads * hidden_dim),
        x.new_empty(0) if recompute_normed_x_in_backward else normed,
        x.new_empty(0) if recompute_uvqk_in_backward else uvqk,
        mean,
        rstd,
    )


@triton_library_op("tzrec_ops::hstu_preprocess_and_attention_bwd_triton")
def preprocess_and_attention_bwd_op(
    du: torch.Tensor,
    dattn: torch.Tensor,
    x: torch.Tensor,
    norm_weight: torch.Tensor,
    norm_bias: torch.Tensor,
    uvqk_weight: torch.Tensor,
    uvqk_bias: torch.Tensor,
    saved_normed: torch.Tensor,
    saved_uvqk: torch.Tensor,
    mean: torch.Tensor,
    rstd: torch.Tensor,
    seq_offsets: torch.Tensor,
    num_targets: Optional[torch.Tensor],
    num_heads: int,
    attn_dim: int,
    hidden_dim: int,
    max_seq_len: int,
    attn_alpha: float,
    causal: bool,
    max_attn_len: int,
    contextual_seq_len: int,
    sort_by_length: bool,
    scaling_seqlen: int,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx, d_norm_weight, d_norm_bias, d_uvqk_weight, d_uvqk_bias)."""
    L = x.shape[0]
    if saved_normed.numel() == 0 and L > 0:
        normed, _, _ = norm_forward(
            x,
            None,
            norm_weight,
            norm_bias,
            0.0,
            1,
            False,
            False,
            PLAIN,
            False,
            0.0,
            None,
            mean=mean,
            rstd=rstd,
        )
    else:
        normed = saved_normed.view(L, x.shape[1])
    if saved_uvqk.numel() == 0 and L > 0:
        uvqk = _uvqk_forward(normed, uvqk_weight, uvqk_bias)
    else:
        uvqk = saved_uvqk.view(L, uvqk_weight.shape[1])
    u, v, q, k = _split_uvqk(uvqk, num_heads, attn_dim, hidden_dim)
    if tracing():
        # Compiled (see the module docstring): each gradient gets a buffer of its own, joined
        # by one concatenation. Written column views of one buffer crash Inductor's
        # backward: it clones a kernel's written arguments over their storage span
        # (clone_preserve_strides), but a view of a buffer that an earlier launch wrote is a
        # compact temporary to Inductor, so the clone of dq (or du) read ~4x its size past
        # the end (illegal memory access, pytorch/pytorch#161115).
        du_view = torch.empty(u.shape, dtype=uvqk.dtype, device=uvqk.device)
        dv_view, dq_view, dk_view = (
            torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (v, q, k)
        )
    else:
        duvqk = torch.empty_like(uvqk)
        du_view, dv_view, dq_view, dk_view = _split_uvqk(duvqk, num_heads, attn_dim, hidden_dim)
    attention.hstu_attention_bwd(
        max_seq_len,
        attn_alpha,
        dattn.view(L, num_heads, hidden_dim),
        q,
        k,
        v,
        seq_offsets,
        causal,
        num_targets,
        max_attn_len,
        contextual_seq_len,
        sort_by_length,
        scaling_seqlen,
        False,
        grads=(dq_view, dk_view, dv_view),
    )
    silu_backward(du, u, du_view)
    if tracing():
        duvqk = torch.cat([du_view, *(t.view(L, -1) for t in (dv_view, dq_view, dk_view))], 1)
    d_normed = torch.empty_like(normed)
    d_uvqk_weight = torch.empty_like(uvqk_weight)
    d_uvqk_bias = torch.empty(uvqk_weight.shape[1], dtype=torch.float32, device=x.device)
    matmul(duvqk, uvqk_weight.t(), d_normed)
    matmul(normed.t(), duvqk, d_uvqk_weight, colsum=d_uvqk_bias)
    dx, _, d_norm_weight, d_norm_bias, _ = norm_backward(
        d_normed,
        x,
        None,
        norm_weight,
        norm_bias,
        mean,
        rstd,
        1,
        False,
        False,
        PLAIN,
        False,
        0.0,
        None,
        False,
    )
    return dx, d_norm_weight, d_norm_bias, d_uvqk_weight, d_uvqk_bias.to(uvqk_bias.dtype)


def _setup_preprocess(ctx, inputs, output):  # type: ignore[no-untyped-def]
    (
        x,
        norm_weight,
        norm_bias,
        _,
        num_heads,
        attn_dim,
        hidden_dim,
        uvqk_weight,
        uvqk_bias,
        max_seq_len,
        seq_offsets,
        attn_alpha,
        causal,
        num_targets,
        max_attn_len,
        contextual_seq_len,
        _,
        _,
        sort_by_length,
        scaling_seqlen,
    ) = inputs
    _, _, saved_normed, saved_uvqk, mean, rstd = output
    ctx.save_for_backward(
        x,
        norm_weight,
        norm_bias,
        uvqk_weight,
        uvqk_bias,
        saved_normed,
        saved_uvqk,
        mean,
        rstd,
        seq_offsets,
        num_targets,
    )
    ctx.options = (
        num_heads,
        attn_dim,
        hidden_dim,
        max_seq_len,
        attn_alpha,
        causal,
        max_attn_len,
        contextual_seq_len,
        sort_by_length,
        scaling_seqlen,
    )


def _preprocess_backward(ctx, du, dattn, *unused):  # type: ignore[no-untyped-def]
    (
        x,
        norm_weight,
        norm_bias,
        uvqk_weight,
        uvqk_bias,
        saved_normed,
        saved_uvqk,
        mean,
        rstd,
        seq_offsets,
        num_targets,
    ) = ctx.saved_tensors
    dx, dnw, dnb, duw, dub = preprocess_and_attention_bwd_op(
        du.contiguous(),
        dattn.contiguous(),
        x,
        norm_weight,
        norm_bias,
        uvqk_weight,
        uvqk_bias,
        saved_normed,
        saved_uvqk,
        mean,
        rstd,
        seq_offsets,
        num_targets,
        *ctx.options,
    )
    return (dx, dnw, dnb, None, None, None, None, duw, dub) + (None,) * 11


preprocess_and_attention_op.register_autograd(
    _preprocess_backward, setup_context=_setup_preprocess, grad_outputs=2
)


def hstu_preprocess_and_attention(
    x: torch.Tensor,
    norm_weight: torch.Tensor,
    norm_bias: torch.Tensor,
    norm_eps: float,
    num_heads: int,
    attn_dim: int,
    hidden_dim: int,
    uvqk_weight: torch.Tensor,
    uvqk_bias: torch.Tensor,
    max_seq_len: int,
    seq_offsets: torch.Tensor,
    attn_alpha: float,
    causal: bool,
    num_targets: Optional[torch.Tensor],
    max_attn_len: int,
    contextual_seq_len: int,
    recompute_uvqk_in_backward: bool,
    recompute_normed_x_in_backward: bool,
    sort_by_length: bool,
    prefill: bool = False,
    attn_func: Optional[torch.Tensor] = None,
    scaling_seqlen: int = -1,
) -> Tuple[torch.Tensor, torch.Tensor, None, None]:
    """Triton backend (fused) of :func:`tzrec_ops.ops.hstu_compute.hstu_preprocess_and_attention`.

    Returns ``k = v = None``: the fused path keeps them inside uvqk. ``prefill=True`` and
    ``attn_func`` are served by the unfused path of the public op, never here.
    """
    raise_if_refused(
        "hstu_preprocess_and_attention", prefill=prefill, attn_func=attn_func is not None
    )
    u, attn, *_ = preprocess_and_attention_op(
        switch_to_contiguous_if_needed(x),
        norm_weight,
        norm_bias,
        float(norm_eps),
        num_heads,
        attn_dim,
        hidden_dim,
        uvqk_weight,
        uvqk_bias,
        int(max_seq_len),
        seq_offsets,
        float(attn_alpha),
        bool(causal),
        num_targets,
        int(max_attn_len),
        int(contextual_seq_len),
        bool(recompute_uvqk_in_backward),
        bool(recompute_normed_x_in_backward),
        bool(sort_by_length),
        int(scaling_seqlen),
    )
    return u, attn, None, None
