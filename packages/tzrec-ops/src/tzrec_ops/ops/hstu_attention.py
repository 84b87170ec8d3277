"""HSTU attention: ``hstu_mha`` (jagged, differentiable) and ``delta_hstu_mha`` (cached,
forward-only).

Legend: B = batch, L = total tokens of the jagged batch (``seq_offsets[-1]``), H = heads,
A = q/k dim (attention dim), V = value dim, N = ``max_seq_len``, D = new queries per
sequence in ``delta_hstu_mha``.

HSTU attention has no softmax: for query i and key j of one sequence and one head,
``a_ij = SiLU(alpha * <q_i, k_j>) / S * valid(i, j)`` and ``out_i = sum_j a_ij v_j``, with
``S = scaling_seqlen`` (or ``max_seq_len`` when it is -1). A fixed ``S`` makes a sequence's
output independent of what else is in the batch.

The mask ``valid`` (reference spec §1.2). Each sequence is laid out as
``[contextual prefix (C) | history (U) | targets (T)]``. Positions get ids: with ``C > 0`` the
prefix shares id 0 and history starts at id 1; with targets every target gets the history
bound ``M`` (``n``, minus ``C - 1`` when ``C > 0``, minus ``T``). A query sees a key when it is
the key itself or has a larger id (``|dist| > 0`` when ``causal=False``); a window
``max_attn_len = w > 0`` keeps only ``dist <= w`` (except the queries with id
``>= M - min_full_attn_seq_len`` when that is > 0); prefix queries also see every key with
id ``< M``. So targets see the prefix, the history and themselves, never each other, and no
history token sees a target. One sequence of length 5 with 2 targets (causal, no window,
no prefix), rows are queries, columns keys::

        k0 k1 k2 k3 k4
    q0   1  0  0  0  0
    q1   1  1  0  0  0
    q2   1  1  1  0  0
    q3   1  1  1  1  0      <- target
    q4   1  1  1  0  1      <- target: sees itself, not q3's key
"""

from __future__ import annotations

from typing import Optional, Tuple, Union

import torch

from tzrec_ops.ops.autocast import autocast_inputs
from tzrec_ops.ops.validation import (
    check_dim,
    check_int,
    check_jagged,
    check_non_negative,
    check_offsets,
    check_positive,
    check_same_device,
    check_same_dtype,
    check_tensor,
)
from tzrec_ops.registry import Backend, select_backend

__all__ = ["hstu_mha", "delta_hstu_mha", "check_attention_args"]

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_INDEX_DTYPES = (torch.int32, torch.int64)


def _check_options(
    max_seq_len: int, max_attn_len: int, contextual_seq_len: int, scaling_seqlen: int
) -> None:
    check_int("max_seq_len", max_seq_len)
    check_positive("max_seq_len", max_seq_len)
    check_int("max_attn_len", max_attn_len)
    check_non_negative("max_attn_len", max_attn_len)
    check_int("contextual_seq_len", contextual_seq_len)
    check_non_negative("contextual_seq_len", contextual_seq_len)
    check_int("scaling_seqlen", scaling_seqlen)
    if scaling_seqlen != -1 and scaling_seqlen <= 0:
        raise ValueError(
            f"scaling_seqlen must be -1 (use max_seq_len) or > 0, got {scaling_seqlen}"
        )


def _check_num_targets(num_targets: Optional[torch.Tensor], batch: int) -> None:
    if num_targets is None:
        return
    check_tensor("num_targets", num_targets, ndim=1, dtypes=_INDEX_DTYPES)
    if num_targets.shape[0] != batch:
        raise ValueError(
            f"num_targets must have B = {batch} entries (one per sequence), "
            f"got {num_targets.shape[0]}"
        )


def _check_attn_func(attn_func: Optional[torch.Tensor], heads: int, total: int) -> None:
    if attn_func is None:
        return
    check_tensor("attn_func", attn_func, ndim=3, dtypes=(torch.int32,))
    if tuple(attn_func.shape) != (heads, 3, total):
        raise ValueError(
            f"attn_func must have shape (H, 3, L) = {(heads, 3, total)}, "
            f"got {tuple(attn_func.shape)}"
        )


def check_attention_args(
    max_seq_len: int,
    seq_offsets: torch.Tensor,
    num_targets: Optional[torch.Tensor],
    attn_func: Optional[torch.Tensor],
    *,
    tokens: Tuple[str, torch.Tensor],
    heads: int,
    max_attn_len: int,
    contextual_seq_len: int,
    scaling_seqlen: int,
) -> None:
    """The jagged batch and mask arguments of :func:`hstu_mha`, shared with
    :func:`tzrec_ops.ops.hstu_compute.hstu_preprocess_and_attention` so that its fused
    path checks exactly what the unfused one does.

    ``tokens`` names the ``[L, ...]`` tensor the offsets index (its device is the call's);
    ``heads`` is H. The offsets' and ``num_targets``' values are checked once per batch.
    """
    _check_options(max_seq_len, max_attn_len, contextual_seq_len, scaling_seqlen)
    check_offsets("seq_offsets", seq_offsets)
    _check_num_targets(num_targets, seq_offsets.shape[0] - 1)
    total = tokens[1].shape[0]
    _check_attn_func(attn_func, heads, total)
    check_same_device(
        tokens,
        ("seq_offsets", seq_offsets),
        ("num_targets", num_targets),
        ("attn_func", attn_func),
    )
    check_jagged(
        "seq_offsets",
        seq_offsets,
        total=total,
        total_what=f"the token count {tokens[0]}.shape[0]",
        max_seq_len=max_seq_len,
        num_targets=num_targets,
    )


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
    *,
    backend: Union[str, Backend, None] = None,
) -> torch.Tensor:
    """Jagged HSTU attention (mask and maths in the module docstring).

    Args:
        max_seq_len: N, an upper bound on every sequence length (> 0); it sizes padding
            and is the default divisor S.
        alpha: scale applied to ``<q_i, k_j>`` before SiLU (typically ``1 / sqrt(A)``).
        q: [L, H, A] queries. float32, bfloat16, float16 (float64: reference only).
        k: [L, H, A] keys, same dtype and device as q.
        v: [L, H, V] values.
        seq_offsets: [B + 1], int32 or int64: 0, then the running sum of lengths (ends at L).
        causal: ``False`` makes the mask bidirectional (``|dist|`` replaces ``dist``).
        dropout_pr: dropout on the attention weights while ``training`` (pytorch only).
        training: whether dropout applies.
        num_targets: [B] int32/int64 targets at the end of each sequence, or ``None``.
        max_attn_len: window w; 0 means no window.
        contextual_seq_len: C, length of the contextual prefix of every sequence; 0 = none.
        min_full_attn_seq_len: with a window, the last f history ids (and the targets)
            keep full attention; 0 = off (pytorch only).
        sort_by_length: schedule long sequences first (Triton only; a hint, results are
            identical).
        attn_func: [H, 3, L] int32 arbitrary mask, replacing causal/window/targets/prefix:
            query i sees keys ``[0, cmax0) U [cmin0, cmax1)`` of its own sequence, with
            ``(cmax0, cmin0, cmax1) = attn_func[h, :, token]`` (see
            :func:`tzrec_ops.ops.hstu_attention_utils.build_sla_func_tensor`).
        scaling_seqlen: the divisor S; -1 means ``max_seq_len``.
        backend: backend name or record; ``None`` selects one (see :mod:`tzrec_ops.registry`).

    Returns:
        [L, H, V] in the input dtype.

    Raises:
        TypeError / ValueError: bad ranks, shapes, dtypes, devices or option values, and
            (eager mode) offsets that do not start at 0, decrease or do not end at L,
            lengths above ``max_seq_len``, and ``num_targets`` outside ``[0, length]``.
        tzrec_ops.BackendError: the requested backend cannot run this call.
    """
    q, k, v = autocast_inputs(q, k, v)
    check_int("min_full_attn_seq_len", min_full_attn_seq_len)
    check_non_negative("min_full_attn_seq_len", min_full_attn_seq_len)
    if not 0.0 <= dropout_pr <= 1.0:
        raise ValueError(f"dropout_pr must be in [0, 1], got {dropout_pr}")
    check_tensor("q", q, ndim=3, dtypes=_FLOAT_DTYPES)
    check_tensor("k", k, ndim=3)
    check_tensor("v", v, ndim=3)
    for dim in range(3):
        check_dim("k", k, dim, q.shape[dim], f"q.shape[{dim}]")
    check_dim("v", v, 0, q.shape[0], "q.shape[0]")
    check_dim("v", v, 1, q.shape[1], "q.shape[1]")
    check_same_dtype(("q", q), ("k", k), ("v", v))
    check_same_device(("q", q), ("k", k), ("v", v))
    check_attention_args(
        max_seq_len,
        seq_offsets,
        num_targets,
        attn_func,
        tokens=("q", q),
        heads=q.shape[1],
        max_attn_len=max_attn_len,
        contextual_seq_len=contextual_seq_len,
        scaling_seqlen=scaling_seqlen,
    )

    impl = select_backend(
        "hstu_mha",
        backend,
        device=q.device,
        dtype=q.dtype,
        causal=bool(causal),
        dropout_pr=float(dropout_pr) if training else 0.0,
        num_targets=num_targets is not None,
        max_attn_len=max_attn_len,
        contextual_seq_len=contextual_seq_len,
        min_full_attn_seq_len=min_full_attn_seq_len,
        sort_by_length=bool(sort_by_length),
        attn_func=attn_func is not None,
    )
    return impl(
        max_seq_len=max_seq_len,
        alpha=alpha,
        q=q,
        k=k,
        v=v,
        seq_offsets=seq_offsets,
        causal=causal,
        dropout_pr=dropout_pr,
        training=training,
        num_targets=num_targets,
        max_attn_len=max_attn_len,
        contextual_seq_len=contextual_seq_len,
        min_full_attn_seq_len=min_full_attn_seq_len,
        sort_by_length=sort_by_length,
        attn_func=attn_func,
        scaling_seqlen=scaling_seqlen,
    )


def _check_split_kv(
    delta_q: torch.Tensor,
    v: torch.Tensor,
    delta_k: Optional[torch.Tensor],
    delta_v: Optional[torch.Tensor],
) -> bool:
    """Shapes of the split cached form's new keys/values; whether the form is used."""
    if delta_k is None and delta_v is None:
        return False
    if delta_k is None or delta_v is None:
        given, missing = ("delta_k", "delta_v") if delta_v is None else ("delta_v", "delta_k")
        raise ValueError(
            f"delta_k and delta_v must be given together (or both left None): {given} was "
            f"given but {missing} is None"
        )
    check_tensor("delta_k", delta_k, ndim=3)
    check_tensor("delta_v", delta_v, ndim=3)
    for dim in range(3):
        check_dim("delta_k", delta_k, dim, delta_q.shape[dim], f"delta_q.shape[{dim}]")
    check_dim("delta_v", delta_v, 0, delta_q.shape[0], "delta_q.shape[0]")
    check_dim("delta_v", delta_v, 1, delta_q.shape[1], "delta_q.shape[1]")
    check_dim("delta_v", delta_v, 2, v.shape[2], "v.shape[2]")
    return True


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
    backend: Union[str, Backend, None] = None,
) -> torch.Tensor:
    """Cached (KV-cache) HSTU attention for the last D positions of every sequence.

    Query row ``d`` of sequence b sits at position ``n_b - D + d`` and sees keys by the same
    causal mask as :func:`hstu_mha` (targets, prefix and window included; no
    ``min_full_attn_seq_len``, no ``attn_func``, no dropout). **Forward only**: the output
    never requires grad.

    Two forms describe the keys and values:

    * concatenated (``delta_k``/``delta_v`` left ``None``): ``k``, ``v`` and ``seq_offsets``
      hold the full sequences, cache and new tokens together;
    * split (``delta_k`` and ``delta_v`` given): ``k``, ``v`` and ``seq_offsets`` hold only
      the cached prefix of each sequence (c_b tokens) and ``delta_k``/``delta_v`` the D new
      ones, so sequence b is ``[k_b ; delta_k_b]`` of length ``n_b = c_b + D``. The result
      equals the concatenated call's (targets still count from the end of the full
      sequence), but the cache is read in place: nothing of size ``[L, H, *]`` is copied.
      A backend runs this form only if its ``supports`` check accepts the call option
      ``split_kv=True`` (the concatenated form passes ``split_kv=False``).

    Args:
        max_seq_len: N, an upper bound on every FULL sequence length n_b (> 0).
        alpha: scale applied to ``<q, k>`` before SiLU.
        delta_q: [B * D, H, A] the new queries, D per sequence, sequence-major.
        k: [L, H, A] keys of the full sequences (cache + new tokens), or of the cached
            prefixes only in the split form.
        v: [L, H, V] values, like ``k``.
        seq_offsets: [B + 1], int32 or int64 offsets into ``k``/``v`` (ends at L).
        num_targets: [B] targets at the end of each full sequence, or ``None``.
        max_attn_len: window w; 0 means no window.
        contextual_seq_len: C, contextual prefix length; 0 = none.
        scaling_seqlen: the divisor S; -1 means ``max_seq_len``.
        delta_k: [B * D, H, A] the new keys, sequence-major like ``delta_q`` (split form).
        delta_v: [B * D, H, V] the new values (split form; given with ``delta_k``).
        backend: backend name or record; ``None`` selects one.

    Returns:
        [B * D, H, V] in the input dtype.

    Raises:
        TypeError / ValueError: as :func:`hstu_mha`, plus ``delta_q.shape[0]`` not a
            multiple of B, (eager mode) a sequence shorter than D, only one of
            ``delta_k``/``delta_v`` given, or their shapes, dtypes or devices not matching.
        tzrec_ops.BackendError: the requested backend cannot run this call.
    """
    delta_q, k, v, delta_k, delta_v = autocast_inputs(delta_q, k, v, delta_k, delta_v)
    _check_options(max_seq_len, max_attn_len, contextual_seq_len, scaling_seqlen)
    check_tensor("delta_q", delta_q, ndim=3, dtypes=_FLOAT_DTYPES)
    check_tensor("k", k, ndim=3)
    check_tensor("v", v, ndim=3)
    heads = delta_q.shape[1]
    check_dim("k", k, 1, heads, "delta_q.shape[1]")
    check_dim("k", k, 2, delta_q.shape[2], "delta_q.shape[2]")
    check_dim("v", v, 0, k.shape[0], "k.shape[0]")
    check_dim("v", v, 1, heads, "delta_q.shape[1]")
    split = _check_split_kv(delta_q, v, delta_k, delta_v)
    check_same_dtype(
        ("delta_q", delta_q),
        ("k", k),
        ("v", v),
        *((("delta_k", delta_k), ("delta_v", delta_v)) if split else ()),
    )
    check_offsets("seq_offsets", seq_offsets)
    batch = seq_offsets.shape[0] - 1
    if (batch == 0 and delta_q.shape[0] != 0) or (batch > 0 and delta_q.shape[0] % batch != 0):
        raise ValueError(
            f"delta_q.shape[0] ({delta_q.shape[0]}) must be a multiple of the batch size "
            f"B ({batch}): every sequence contributes the same number of queries"
        )
    _check_num_targets(num_targets, batch)
    check_same_device(
        ("delta_q", delta_q),
        ("k", k),
        ("v", v),
        ("seq_offsets", seq_offsets),
        ("num_targets", num_targets),
        ("delta_k", delta_k),
        ("delta_v", delta_v),
    )
    delta = delta_q.shape[0] // batch if batch > 0 else 0
    # split: offsets describe the cached prefixes and the D new tokens follow each one, so
    # lengths (and the targets' room) count them; concatenated: each length includes them
    check_jagged(
        "seq_offsets",
        seq_offsets,
        total=k.shape[0],
        total_what="the token count k.shape[0]",
        max_seq_len=max_seq_len,
        appended=delta if split else 0,
        min_length=delta,
        min_length_why=f"its D = {delta} new queries, delta_q.shape[0] / B",
        num_targets=num_targets,
    )

    # the split form is a call option: a backend that cannot read the cache in place refuses
    # it in ``supports`` and still serves the concatenated form
    impl = select_backend(
        "delta_hstu_mha",
        backend,
        device=delta_q.device,
        dtype=delta_q.dtype,
        num_targets=num_targets is not None,
        max_attn_len=max_attn_len,
        contextual_seq_len=contextual_seq_len,
        split_kv=split,
    )
    return impl(
        max_seq_len=max_seq_len,
        alpha=alpha,
        delta_q=delta_q,
        k=k,
        v=v,
        seq_offsets=seq_offsets,
        num_targets=num_targets,
        max_attn_len=max_attn_len,
        contextual_seq_len=contextual_seq_len,
        scaling_seqlen=scaling_seqlen,
        delta_k=delta_k,
        delta_v=delta_v,
    )
