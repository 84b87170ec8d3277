"""Independent float64 oracle for ``hstu_mha`` and ``delta_hstu_mha``.

Written straight from the mask rules (reference spec §1.2), deliberately unlike the backends:
the mask is decided one ``(query, key)`` pair at a time in plain Python, and the output is
built one query row at a time. It is slow and meant for small shapes only. Every tensor op is
a float64 torch op, so ``torch.autograd`` differentiates it (use it for backward checks).

Legend: B = batch, L = total tokens, H = heads, A = q/k dim, V = value dim, n = one
sequence's length, T = its target count, C = ``contextual_seq_len``, w = ``max_attn_len``,
f = ``min_full_attn_seq_len``.
"""

from __future__ import annotations

from typing import List, Optional

import torch


def position_ids(n: int, num_targets: Optional[int], contextual_seq_len: int) -> List[int]:
    """Ids of positions ``0..n-1``: contextual tokens share id 0, targets share the top id."""
    ids = []
    for p in range(n):
        pid = p if contextual_seq_len <= 0 else max(p - contextual_seq_len + 1, 0)
        if num_targets is not None:
            pid = min(pid, history_bound(n, num_targets, contextual_seq_len))
        ids.append(pid)
    return ids


def history_bound(n: int, num_targets: Optional[int], contextual_seq_len: int) -> int:
    """``M``: ``n``, minus ``C - 1`` when ``C > 0``, minus ``T`` when targets are given."""
    bound = n
    if contextual_seq_len > 0:
        bound -= contextual_seq_len - 1
    if num_targets is not None:
        bound -= num_targets
    return bound


def is_visible(
    i: int,
    j: int,
    n: int,
    num_targets: Optional[int] = None,
    contextual_seq_len: int = 0,
    max_attn_len: int = 0,
    min_full_attn_seq_len: int = 0,
    causal: bool = True,
) -> bool:
    """Whether query position ``i`` sees key position ``j`` in a sequence of length ``n``."""
    if not (0 <= i < n and 0 <= j < n):
        return False
    ids = position_ids(n, num_targets, contextual_seq_len)
    bound = history_bound(n, num_targets, contextual_seq_len)
    dist = ids[i] - ids[j]
    if not causal:
        dist = abs(dist)
    visible = i == j or dist > 0
    if max_attn_len > 0:
        in_window = dist <= max_attn_len
        if min_full_attn_seq_len > 0 and ids[i] >= bound - min_full_attn_seq_len:
            in_window = True
        visible = visible and in_window
    if contextual_seq_len > 0 and ids[i] == 0 and ids[j] < bound:
        visible = True
    return visible


def visible_from_func(j: int, n: int, cmax0: int, cmin0: int, cmax1: int) -> bool:
    """``attn_func`` rule: key ``j`` is visible if in ``[0, cmax0)`` or ``[cmin0, cmax1)``."""
    if not 0 <= j < n:
        return False
    return j < cmax0 or cmin0 <= j < cmax1


def _row(
    alpha: float, scale: float, q_i: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keys: List[int]
) -> torch.Tensor:
    """One query's output ``[V]`` for one head: ``sum_j SiLU(alpha q.k_j) / S * v_j``."""
    if not keys:
        return v.new_zeros(v.shape[-1]) + 0 * q_i.sum()
    kk = k[keys]
    vv = v[keys]
    s = alpha * (kk * q_i).sum(-1)
    weights = s * torch.sigmoid(s) / scale
    return (weights[:, None] * vv).sum(0)


def hstu_mha_oracle(
    max_seq_len: int,
    alpha: float,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    seq_offsets: torch.Tensor,
    causal: bool = True,
    num_targets: Optional[torch.Tensor] = None,
    max_attn_len: int = 0,
    contextual_seq_len: int = 0,
    min_full_attn_seq_len: int = 0,
    attn_func: Optional[torch.Tensor] = None,
    scaling_seqlen: int = -1,
) -> torch.Tensor:
    """Jagged HSTU attention (no dropout) in float64: q, k ``[L, H, A]``, v ``[L, H, V]``,
    seq_offsets ``[B + 1]``, num_targets ``[B]``, attn_func ``[H, 3, L]`` -> ``[L, H, V]``."""
    q, k, v = (t.to(torch.float64) for t in (q, k, v))
    scale = float(max_seq_len if scaling_seqlen == -1 else scaling_seqlen)
    offsets = [int(x) for x in seq_offsets.tolist()]
    targets = None if num_targets is None else [int(x) for x in num_targets.tolist()]
    func = None if attn_func is None else attn_func.tolist()
    heads = q.shape[1]
    rows = []
    for b in range(len(offsets) - 1):
        start, n = offsets[b], offsets[b + 1] - offsets[b]
        t_b = None if targets is None else targets[b]
        for i in range(n):
            fixed_keys = [
                j
                for j in range(n)
                if is_visible(
                    i, j, n, t_b, contextual_seq_len, max_attn_len, min_full_attn_seq_len, causal
                )
            ]
            per_head = []
            for h in range(heads):
                keys = fixed_keys
                if func is not None:
                    c = [func[h][r][start + i] for r in range(3)]
                    keys = [j for j in range(n) if visible_from_func(j, n, *c)]
                qkv = (q[start + i, h], k[start : start + n, h], v[start : start + n, h])
                per_head.append(_row(alpha, scale, *qkv, keys))
            rows.append(torch.stack(per_head))
    if not rows:
        return v.new_zeros(0, v.shape[1], v.shape[2])
    return torch.stack(rows)


def delta_hstu_mha_oracle(
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
) -> torch.Tensor:
    """Cached attention in float64: delta_q ``[B * D, H, A]`` holds the last D positions of
    each sequence; k ``[L, H, A]``, v ``[L, H, V]`` the full sequences -> ``[B * D, H, V]``."""
    delta_q, k, v = (t.to(torch.float64) for t in (delta_q, k, v))
    scale = float(max_seq_len if scaling_seqlen == -1 else scaling_seqlen)
    offsets = [int(x) for x in seq_offsets.tolist()]
    batch = len(offsets) - 1
    delta = delta_q.shape[0] // batch if batch > 0 else 0
    targets = None if num_targets is None else [int(x) for x in num_targets.tolist()]
    rows = []
    for b in range(batch):
        start, n = offsets[b], offsets[b + 1] - offsets[b]
        t_b = None if targets is None else targets[b]
        for d in range(delta):
            i = n - delta + d
            keys = [
                j for j in range(n) if is_visible(i, j, n, t_b, contextual_seq_len, max_attn_len)
            ]
            per_head = [
                _row(
                    alpha,
                    scale,
                    delta_q[b * delta + d, h],
                    k[start : start + n, h],
                    v[start : start + n, h],
                    keys,
                )
                for h in range(delta_q.shape[1])
            ]
            rows.append(torch.stack(per_head))
    if not rows:
        return v.new_zeros(0, v.shape[1], v.shape[2])
    return torch.stack(rows)
