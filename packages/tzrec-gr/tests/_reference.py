"""Independent float64 references for tzrec-gr tests (plain per-sample loops)."""

from __future__ import annotations

from typing import List, Optional

import torch
from torch.nn import functional as F


def attention_mask(
    n: int, targets: int, context: int, window: int, causal: bool = True
) -> torch.Tensor:
    """valid[i, j] for one sample, following the fixed-mask definition (spec 1.2)."""
    history_end = n - (context - 1 if context > 0 else 0) - targets

    def ident(p: int) -> int:
        i = max(p - context + 1, 0) if context > 0 else p
        return min(i, history_end) if targets > 0 else i

    valid = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        for j in range(n):
            dist = ident(i) - ident(j)
            if not causal:
                dist = abs(dist)
            ok = i == j or dist > 0
            if window > 0:
                ok = ok and dist <= window
            if context > 0 and ident(i) == 0 and ident(j) < history_end:
                ok = True
            valid[i, j] = ok
    return valid


def stu_layer(
    layer,
    x: torch.Tensor,
    offsets: List[int],
    max_seq_len: int,
    num_targets: Optional[List[int]] = None,
) -> torch.Tensor:
    """STULayer forward in float64 (eval mode, no dropout), one sample at a time."""
    h, a, v = layer.num_heads, layer.attention_dim, layer.hidden_dim
    p = {name: t.detach().double() for name, t in layer.named_parameters()}
    x = x.double()
    normed = F.layer_norm(x, (x.shape[1],), p["_input_norm_weight"], p["_input_norm_bias"], 1e-6)
    uvqk = normed @ p["_uvqk_weight"] + p["_uvqk_beta"]
    u, vv, q, k = torch.split(uvqk, [h * v, h * v, h * a, h * a], dim=1)
    u = F.silu(u)
    scale = layer.scaling_seqlen if layer.scaling_seqlen > 0 else max_seq_len
    attn = torch.zeros(x.shape[0], h * v, dtype=torch.float64)
    for b in range(len(offsets) - 1):
        s, e = offsets[b], offsets[b + 1]
        n = e - s
        t = num_targets[b] if (num_targets is not None and layer.target_aware) else 0
        mask = attention_mask(n, t, layer.contextual_seq_len, layer.max_attn_len, layer.causal)
        qb = q[s:e].view(n, h, a)
        kb = k[s:e].view(n, h, a)
        vb = vv[s:e].view(n, h, v)
        scores = torch.einsum("ihd,jhd->hij", qb, kb) * layer.attn_alpha
        weights = F.silu(scores) / scale * mask.unsqueeze(0)
        attn[s:e] = torch.einsum("hij,jhd->ihd", weights, vb).reshape(n, h * v)
    if layer.use_group_norm:
        normed_attn = F.group_norm(attn.view(-1, h, v), h, eps=1e-6)
        normed_attn = (
            normed_attn * p["_output_norm_weight"].view(1, h, 1)
            + p["_output_norm_bias"].view(1, h, 1)
        ).reshape(-1, h * v)
    else:
        normed_attn = F.layer_norm(
            attn, (h * v,), p["_output_norm_weight"], p["_output_norm_bias"], 1e-6
        )
    y = torch.cat([u, attn, u * normed_attn], dim=1)
    return x + y @ p["_output_weight"]


def truncate(
    lengths: List[int], targets: Optional[List[int]], context: int, tail: int
) -> List[List[int]]:
    """Kept row positions of each sample after truncation."""
    kept = []
    for b, n in enumerate(lengths):
        t = targets[b] if targets is not None else 0
        hist = n - t - context
        drop = max(hist - tail, 0)
        kept.append(list(range(context)) + list(range(context + drop, n)))
    return kept
