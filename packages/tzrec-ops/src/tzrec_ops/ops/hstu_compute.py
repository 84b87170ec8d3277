"""The STU building blocks: input projection, output projection, and preprocess + attention.

Legend: L = tokens, B = batch, E = embedding dim, H = heads, A = q/k dim per head,
V = value (linear) dim per head. ``uvqk_weight`` is stored [E, 2H(V + A)] (input, output)
and its columns are ``[u | v | q | k]`` with widths HV, HV, HA, HA.
"""

from __future__ import annotations

from typing import Optional, Tuple, Union

import torch

from tzrec_ops.ops.autocast import autocast_inputs
from tzrec_ops.ops.hstu_attention import check_attention_args
from tzrec_ops.ops.layer_norm import FLOATS, check_dropout, check_norm_input
from tzrec_ops.ops.validation import (
    check_dim,
    check_int,
    check_positive,
    check_same_device,
    check_same_dtype,
    check_tensor,
)
from tzrec_ops.registry import Backend, find_implementation, select_backend

BackendArg = Union[str, Backend, None]
Tensors4 = Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def _check_uqvk(
    x: torch.Tensor,
    norm_weight: torch.Tensor,
    norm_bias: torch.Tensor,
    norm_eps: float,
    num_heads: int,
    attn_dim: int,
    hidden_dim: int,
    uvqk_weight: torch.Tensor,
    uvqk_bias: torch.Tensor,
) -> None:
    sizes = (("num_heads", num_heads), ("attn_dim", attn_dim), ("hidden_dim", hidden_dim))
    for name, value in sizes:
        check_int(name, value)
        check_positive(name, value)
    check_norm_input(x, norm_weight, norm_bias, norm_eps, names=("x", "norm_weight", "norm_bias"))
    width = 2 * num_heads * (hidden_dim + attn_dim)
    check_tensor("uvqk_weight", uvqk_weight, ndim=2)
    check_tensor("uvqk_bias", uvqk_bias, ndim=1)
    check_dim("uvqk_weight", uvqk_weight, 0, x.shape[1], "x.shape[1]")
    check_dim("uvqk_weight", uvqk_weight, 1, width, "2 * num_heads * (hidden_dim + attn_dim)")
    check_dim("uvqk_bias", uvqk_bias, 0, width, "2 * num_heads * (hidden_dim + attn_dim)")
    check_same_dtype(("x", x), ("uvqk_weight", uvqk_weight), ("uvqk_bias", uvqk_bias))
    check_same_device(("x", x), ("uvqk_weight", uvqk_weight), ("uvqk_bias", uvqk_bias))


def _run_uqvk(
    backend: BackendArg,
    x: torch.Tensor,
    norm_weight: torch.Tensor,
    norm_bias: torch.Tensor,
    norm_eps: float,
    num_heads: int,
    attn_dim: int,
    hidden_dim: int,
    uvqk_weight: torch.Tensor,
    uvqk_bias: torch.Tensor,
    *,
    recompute_normed_x_in_backward: bool,
    recompute_uvqk_in_backward: bool,
) -> Tensors4:
    """``hstu_compute_uqvk`` on the backend selected for the call; the caller has checked the
    arguments (:func:`_check_uqvk`)."""
    impl = select_backend(
        "hstu_compute_uqvk",
        backend,
        device=x.device,
        dtype=x.dtype,
        recompute_normed_x_in_backward=recompute_normed_x_in_backward,
        recompute_uvqk_in_backward=recompute_uvqk_in_backward,
    )
    return impl(
        x=x,
        norm_weight=norm_weight,
        norm_bias=norm_bias,
        norm_eps=norm_eps,
        num_heads=num_heads,
        attn_dim=attn_dim,
        hidden_dim=hidden_dim,
        uvqk_weight=uvqk_weight,
        uvqk_bias=uvqk_bias,
        recompute_normed_x_in_backward=recompute_normed_x_in_backward,
        recompute_uvqk_in_backward=recompute_uvqk_in_backward,
    )


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
    *,
    backend: BackendArg = None,
) -> Tensors4:
    """``uvqk = layer_norm(x) @ uvqk_weight + uvqk_bias``, split into u, v, q, k; ``u = SiLU(u)``.

    Args:
        x: [L, E].
        norm_weight, norm_bias: [E], any float dtype.
        norm_eps: layer-norm epsilon (>= 0).
        num_heads, attn_dim, hidden_dim: H, A, V.
        uvqk_weight: [E, 2H(V + A)], x's dtype.
        uvqk_bias: [2H(V + A)], x's dtype.
        recompute_normed_x_in_backward: recompute ``layer_norm(x)`` in backward.
        recompute_uvqk_in_backward: recompute the projection in backward. Either flag only
            trades memory for time; results are bitwise the same.

    Returns:
        (u [L, HV], q [L, H, A], k [L, H, A], v [L, H, V]) in x's dtype; q, k, v may be
        strided views of one buffer.
    """
    x, norm_weight, norm_bias, uvqk_weight, uvqk_bias = autocast_inputs(
        x, norm_weight, norm_bias, uvqk_weight, uvqk_bias
    )
    _check_uqvk(
        x, norm_weight, norm_bias, norm_eps, num_heads, attn_dim, hidden_dim, uvqk_weight, uvqk_bias
    )
    return _run_uqvk(
        backend, x, norm_weight, norm_bias, norm_eps, num_heads, attn_dim, hidden_dim,
        uvqk_weight, uvqk_bias,
        recompute_normed_x_in_backward=recompute_normed_x_in_backward,
        recompute_uvqk_in_backward=recompute_uvqk_in_backward,
    )


def hstu_compute_output(
    attn: torch.Tensor,
    u: torch.Tensor,
    x: torch.Tensor,
    norm_weight: torch.Tensor,
    norm_bias: torch.Tensor,
    norm_eps: float,
    output_weight: torch.Tensor,
    num_heads: int,
    linear_dim: int,
    dropout_ratio: float,
    training: bool,
    concat_ux: bool,
    group_norm: bool,
    recompute_y_in_backward: bool,
    *,
    backend: BackendArg = None,
) -> torch.Tensor:
    """``x + dropout(y) @ output_weight`` with ``y = u * norm(attn)`` (a residual block).

    Args:
        attn: [L, HV], the attention output.
        u: [L, HV], SiLU(u) from :func:`hstu_compute_uqvk`.
        x: [L, E], the block input (residual).
        norm_weight, norm_bias: [HV] for a layer norm over all HV features, or [H] with
            ``group_norm`` (normalise each head's V features; one scale and shift per head).
        output_weight: [HV, E], or [3HV, E] with ``concat_ux`` (then y = [u | attn | y]).
        num_heads, linear_dim: H and V.
        dropout_ratio: in [0, 1), applied only when ``training``.
        recompute_y_in_backward: recompute y in backward instead of saving it.

    Returns:
        [L, E] in x's dtype.
    """
    attn, u, x, norm_weight, norm_bias, output_weight = autocast_inputs(
        attn, u, x, norm_weight, norm_bias, output_weight
    )
    check_positive("num_heads", num_heads)
    check_positive("linear_dim", linear_dim)
    hv = num_heads * linear_dim
    check_tensor("attn", attn, ndim=2, dtypes=FLOATS)
    check_dim("attn", attn, 1, hv, "num_heads * linear_dim")
    check_tensor("u", u, ndim=2)
    if u.shape != attn.shape:
        raise ValueError(f"u must have attn's shape {list(attn.shape)}, got {list(u.shape)}")
    check_tensor("x", x, ndim=2)
    check_dim("x", x, 0, attn.shape[0], "attn.shape[0]")
    check_norm_input(
        attn,
        norm_weight,
        norm_bias,
        norm_eps,
        param_size=num_heads if group_norm else None,
        names=("attn", "norm_weight", "norm_bias"),
    )
    check_tensor("output_weight", output_weight, ndim=2)
    check_dim(
        "output_weight",
        output_weight,
        0,
        3 * hv if concat_ux else hv,
        "3 * num_heads * linear_dim (concat_ux)" if concat_ux else "num_heads * linear_dim",
    )
    check_dim("output_weight", output_weight, 1, x.shape[1], "x.shape[1]")
    check_same_dtype(("x", x), ("attn", attn), ("u", u), ("output_weight", output_weight))
    check_same_device(("x", x), ("attn", attn), ("u", u), ("output_weight", output_weight))
    check_dropout(dropout_ratio)
    impl = select_backend(
        "hstu_compute_output",
        backend,
        device=x.device,
        dtype=x.dtype,
        dropout_ratio=dropout_ratio if training else 0.0,
        concat_ux=concat_ux,
        group_norm=group_norm,
        recompute_y_in_backward=recompute_y_in_backward,
    )
    return impl(
        attn=attn,
        u=u,
        x=x,
        norm_weight=norm_weight,
        norm_bias=norm_bias,
        norm_eps=norm_eps,
        output_weight=output_weight,
        num_heads=num_heads,
        linear_dim=linear_dim,
        dropout_ratio=dropout_ratio,
        training=training,
        concat_ux=concat_ux,
        group_norm=group_norm,
        recompute_y_in_backward=recompute_y_in_backward,
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
    *,
    backend: BackendArg = None,
) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]:
    """:func:`hstu_compute_uqvk` followed by ``hstu_mha`` (no attention dropout).

    A backend that implements the fused op ``hstu_preprocess_and_attention`` and accepts
    the call runs it when ``prefill`` is False (it may return ``k = v = None``). Otherwise
    the call runs unfused on the same ``backend`` request: that backend's
    ``hstu_compute_uqvk``, then :func:`tzrec_ops.ops.hstu_attention.hstu_mha`, and returns
    the materialised k and v (a KV cache needs them, hence ``prefill=True``).

    Args: as :func:`hstu_compute_uqvk`, plus ``max_seq_len`` (> 0), ``seq_offsets``
    [B + 1], and the attention options of ``hstu_mha`` (``attn_alpha`` is its alpha).
    Both paths check the jagged batch as ``hstu_mha`` does, before any backend is chosen.

    Returns:
        (u [L, HV], attn [L, HV], k [L, H, A] or None, v [L, H, V] or None).
    """
    x, norm_weight, norm_bias, uvqk_weight, uvqk_bias = autocast_inputs(
        x, norm_weight, norm_bias, uvqk_weight, uvqk_bias
    )
    _check_uqvk(
        x, norm_weight, norm_bias, norm_eps, num_heads, attn_dim, hidden_dim, uvqk_weight, uvqk_bias
    )
    # here, before the fused implementation is looked up: it gets no other check
    check_attention_args(
        max_seq_len,
        seq_offsets,
        num_targets,
        attn_func,
        tokens=("x", x),
        heads=num_heads,
        max_attn_len=max_attn_len,
        contextual_seq_len=contextual_seq_len,
        scaling_seqlen=scaling_seqlen,
    )
    if not prefill:
        fused = find_implementation(
            "hstu_preprocess_and_attention",
            backend,
            device=x.device,
            dtype=x.dtype,
            causal=causal,
            num_targets=num_targets is not None,
            max_attn_len=max_attn_len,
            contextual_seq_len=contextual_seq_len,
            attn_func=attn_func is not None,
            scaling_seqlen=scaling_seqlen,
        )
        if fused is not None:
            return fused(
                x=x,
                norm_weight=norm_weight,
                norm_bias=norm_bias,
                norm_eps=norm_eps,
                num_heads=num_heads,
                attn_dim=attn_dim,
                hidden_dim=hidden_dim,
                uvqk_weight=uvqk_weight,
                uvqk_bias=uvqk_bias,
                max_seq_len=max_seq_len,
                seq_offsets=seq_offsets,
                attn_alpha=attn_alpha,
                causal=causal,
                num_targets=num_targets,
                max_attn_len=max_attn_len,
                contextual_seq_len=contextual_seq_len,
                recompute_uvqk_in_backward=recompute_uvqk_in_backward,
                recompute_normed_x_in_backward=recompute_normed_x_in_backward,
                sort_by_length=sort_by_length,
                prefill=prefill,
                attn_func=attn_func,
                scaling_seqlen=scaling_seqlen,
            )
    from tzrec_ops.ops.hstu_attention import hstu_mha

    u, q, k, v = _run_uqvk(
        backend, x, norm_weight, norm_bias, norm_eps, num_heads, attn_dim, hidden_dim,
        uvqk_weight, uvqk_bias,
        recompute_normed_x_in_backward=recompute_normed_x_in_backward,
        recompute_uvqk_in_backward=recompute_uvqk_in_backward,
    )
    attn = hstu_mha(
        max_seq_len,
        attn_alpha,
        q,
        k,
        v,
        seq_offsets,
        causal=causal,
        dropout_pr=0.0,
        training=False,
        num_targets=num_targets,
        max_attn_len=max_attn_len,
        contextual_seq_len=contextual_seq_len,
        sort_by_length=sort_by_length,
        attn_func=attn_func,
        scaling_seqlen=scaling_seqlen,
        backend=backend,
    )
    return u, attn.reshape(x.shape[0], num_heads * hidden_dim), k, v
