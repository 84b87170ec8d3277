"""Test helper: cut a jagged attention batch into the split cached form of delta_hstu_mha."""

from __future__ import annotations

from typing import Tuple

import torch

from tzrec_ops.testing.generators import AttentionInputs, offsets_from_lengths


def split_cached(inp: AttentionInputs, delta: int) -> Tuple[torch.Tensor, ...]:
    """Each sequence of ``inp`` cut into its cached prefix and its last ``delta`` tokens.

    Returns ``(delta_q, cache_k, cache_v, cache_offsets, delta_k, delta_v, new_rows)``:
    ``delta_*`` ``[B * delta, H, *]`` sequence-major, the cache ``[L - B * delta, H, *]`` with
    its offsets (same dtype as ``inp.seq_offsets``), and the rows of ``inp`` holding the new
    tokens. The new q, k, v are column slices of one fused ``[B * delta, H, 2A + V]`` buffer,
    so ``delta_k``/``delta_v`` are strided views, as an STU layer's projection gives them.
    """
    device = inp.q.device
    starts = inp.seq_offsets.tolist()[:-1]
    new = [o + n - delta + d for o, n in zip(starts, inp.lengths) for d in range(delta)]
    cached = [o + p for o, n in zip(starts, inp.lengths) for p in range(n - delta)]
    new_rows = torch.tensor(new, dtype=torch.int64, device=device)
    cached_rows = torch.tensor(cached, dtype=torch.int64, device=device)
    a, v_dim = inp.q.shape[2], inp.v.shape[2]
    fused = torch.cat([t[new_rows] for t in (inp.q, inp.k, inp.v)], dim=-1)
    delta_q, delta_k, delta_v = torch.split(fused, [a, a, v_dim], dim=-1)
    cache_offsets = offsets_from_lengths([n - delta for n in inp.lengths], inp.seq_offsets.dtype)
    return (
        delta_q,
        inp.k[cached_rows],
        inp.v[cached_rows],
        cache_offsets.to(device),
        delta_k,
        delta_v,
        new_rows,
    )
