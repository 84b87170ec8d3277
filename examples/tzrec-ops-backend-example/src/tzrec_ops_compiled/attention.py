"""``hstu_mha`` as one compiled graph: pad, scores, mask, SiLU, values, unpad.

Padding is a gather at ``seq_offsets[b] + p`` (positions past a sequence's end are zeroed), so
every shape depends on L, B and N only and one dynamic-shape compile serves every batch; the
masks follow the reference spec (prefix, targets, window, causal or not), and causal masks
skip the key blocks after each query block. Inductor fuses the
mask, SiLU and scaling into the two batched matmuls' neighbours and derives the backward.
``alpha`` is folded into q, ``1 / S`` applied to the output and the upcast to float32 done
outside the graph, so new values of either, and bfloat16 or float16 input, do not recompile.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

# row blocks of a causal mask (block i sees key blocks 0..i): 1 + 2 + ... + 8 of 64 tiles
_BLOCKS = 8


def _visible(
    row: torch.Tensor,
    col: torch.Tensor,
    n: torch.Tensor,
    num_targets: Optional[torch.Tensor],
    causal: bool,
    max_attn_len: int,
    contextual_seq_len: int,
) -> torch.Tensor:
    """Which keys ``col`` ``[1, 1, c]`` the queries ``row`` ``[1, r, 1]`` see in sequences of
    lengths ``n`` ``[B, 1, 1]``: ``[B, r, c]`` (the reference spec's mask)."""
    row_id, col_id, bound = row, col, n
    if contextual_seq_len > 0:  # the prefix shares position id 0
        row_id = (row - (contextual_seq_len - 1)).clamp(min=0)
        col_id = (col - (contextual_seq_len - 1)).clamp(min=0)
        bound = bound - (contextual_seq_len - 1)
    if num_targets is not None:  # every target gets the history bound as its id
        bound = bound - num_targets.to(torch.int64)[:, None, None]
        row_id = torch.minimum(row_id, bound)
        col_id = torch.minimum(col_id, bound)
    dist = row_id - col_id
    if not causal:
        dist = dist.abs()
    visible = (row == col) | (dist > 0)
    if max_attn_len > 0:
        visible = visible & (dist <= max_attn_len)
    if contextual_seq_len > 0:
        visible = visible | ((row_id == 0) & (col_id < bound))
    return visible & (col < n) & (row < n)


def _attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    seq_offsets: torch.Tensor,
    num_targets: Optional[torch.Tensor],
    max_seq_len: int,
    causal: bool,
    max_attn_len: int,
    contextual_seq_len: int,
) -> torch.Tensor:
    """``sum_j SiLU(<q_i, k_j>) v_j`` over the visible keys, ``[L, H, V]``, in q's dtype
    (float32 or float64: the caller upcasts); q is already scaled by alpha.

    A causal mask without a contextual prefix never lets a query see a later key (targets
    and windows only remove keys), so the padded sequence is cut into ``_BLOCKS`` row blocks
    and block i multiplies only keys of blocks 0..i: about half the work of the full square.
    """
    total = q.shape[0]
    offsets = seq_offsets.to(torch.int64)
    lengths = offsets[1:] - offsets[:-1]
    blocks = _BLOCKS if causal and contextual_seq_len == 0 else 1
    size = (max_seq_len + blocks - 1) // blocks
    pos = torch.arange(blocks * size, device=q.device)
    inside = pos[None, :] < lengths[:, None]  # [B, N']
    rows = (offsets[:-1, None] + pos[None, :]).clamp(max=max(total - 1, 0))

    def pad(t: torch.Tensor) -> torch.Tensor:
        return torch.where(inside[:, :, None, None], t[rows], 0.0)

    qp, kp, vp = pad(q), pad(k), pad(v)
    n = lengths[:, None, None]
    outs = []
    for i in range(blocks):
        r0, r1 = i * size, (i + 1) * size
        keys = r1 if blocks > 1 else blocks * size
        visible = _visible(
            pos[None, r0:r1, None], pos[None, None, :keys], n, num_targets, causal,
            max_attn_len, contextual_seq_len,
        )
        scores = torch.einsum("bnhd,bmhd->bhnm", qp[:, r0:r1], kp[:, :keys])
        weights = torch.where(visible[:, None], F.silu(scores), 0.0)
        outs.append(torch.einsum("bhnm,bmhd->bnhd", weights, vp[:, :keys]))
    padded = torch.cat(outs, dim=1) if blocks > 1 else outs[0]
    token = torch.arange(total, device=q.device)
    seq = torch.searchsorted(offsets, token, right=True) - 1
    return padded[seq, token - offsets[seq]]


_compiled = torch.compile(_attention, dynamic=True)


def hstu_mha(
    max_seq_len: int,
    alpha: float,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    seq_offsets: torch.Tensor,
    causal: bool,
    dropout_pr: float,
    training: bool,
    num_targets: Optional[torch.Tensor],
    max_attn_len: int,
    contextual_seq_len: int,
    min_full_attn_seq_len: int,
    sort_by_length: bool,
    attn_func: Optional[torch.Tensor],
    scaling_seqlen: int,
) -> torch.Tensor:
    """Jagged HSTU attention ``[L, H, V]`` (dropout, ``min_full_attn_seq_len`` and
    ``attn_func`` are refused by the plugin's ``supports``; ``sort_by_length`` is a hint)."""
    scale = float(max_seq_len if scaling_seqlen == -1 else scaling_seqlen)
    # one graph for every input dtype and layout: the upcast (and the copy of a strided view)
    # happens here, and so does the scaling, so neither triggers a recompile
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    out = _compiled(
        q.to(compute) * alpha, k.to(compute).contiguous(), v.to(compute).contiguous(),
        seq_offsets, num_targets, int(max_seq_len), bool(causal), int(max_attn_len),
        int(contextual_seq_len),
    )
    return (out / scale).to(q.dtype)
