"""Reference positional and timestamp embeddings, gathered per token (no padding).

Legend: B = batch, L = total tokens, D = embedding dim, K = table rows. The table rows and
``alpha * x`` are summed in float32 (float64 for float64 x) and cast to x's dtype.
"""

from __future__ import annotations

from typing import Optional

import torch

from tzrec_ops.backends.pytorch._common import compute_dtype
from tzrec_ops.jagged import row_positions


def _history_end(
    seq_lengths: torch.Tensor, num_targets: Optional[torch.Tensor], interleave_targets: bool
) -> torch.Tensor:
    """Per-sequence index of the first target: ``length - T`` (``- 2T`` when interleaved)."""
    lengths = seq_lengths.to(torch.int64)
    if num_targets is None:
        return lengths
    factor = 2 if interleave_targets else 1
    return lengths - factor * num_targets.to(torch.int64)


def add_positional_embeddings(
    alpha: float,
    max_seq_len: int,
    position_embeddings_weight: torch.Tensor,
    seq_offsets: torch.Tensor,
    seq_lengths: torch.Tensor,
    seq_embeddings: torch.Tensor,
    num_targets: Optional[torch.Tensor],
    interleave_targets: bool,
) -> torch.Tensor:
    """[L, D]: ``alpha * x[p] + P[min(p, high_b, K - 1)]``, high_b = the first target's index."""
    cd = compute_dtype(seq_embeddings.dtype)
    rows = seq_embeddings.shape[0]
    seg, pos = row_positions(seq_offsets, rows)
    high = _history_end(seq_lengths, num_targets, interleave_targets)
    index = torch.minimum(pos, high[seg])
    index = index.clamp(max=position_embeddings_weight.shape[0] - 1)
    table = position_embeddings_weight.to(cd)
    out = seq_embeddings.to(cd) * alpha + table.index_select(0, index)
    return out.to(seq_embeddings.dtype)


def time_buckets(
    timestamps: torch.Tensor,
    query_times: torch.Tensor,
    time_bucket_fn: str,
    time_bucket_increments: float,
    num_buckets: int,
) -> torch.Tensor:
    """[L] int64 buckets: ``int(clamp(f(max(qt - ts, 1e-6) / increments), 0, num_buckets))``.

    ``f`` is sqrt or log; the difference is taken in the timestamps' dtype (exact for integer
    times) and the bucket maths runs in float64.
    """
    delta = (query_times - timestamps).to(torch.float64).clamp(min=1e-6) / time_bucket_increments
    scaled = torch.sqrt(delta) if time_bucket_fn == "sqrt" else torch.log(delta)
    return scaled.clamp(0, num_buckets).to(torch.int64)


def add_timestamp_positional_embeddings(
    alpha: float,
    max_seq_len: int,
    max_contextual_seq_len: int,
    position_embeddings_weight: torch.Tensor,
    timestamp_embeddings_weight: torch.Tensor,
    seq_offsets: torch.Tensor,
    seq_lengths: torch.Tensor,
    seq_embeddings: torch.Tensor,
    timestamps: torch.Tensor,
    num_targets: Optional[torch.Tensor],
    interleave_targets: bool,
    time_bucket_fn: str = "sqrt",
    time_bucket_increments: float = 60.0,
    query_time: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """[L, D]: ``alpha * x + P[pos] + T[bucket]``, positions counted back from the history end.

    With C = max_contextual_seq_len and high_b the first target's index: a contextual token
    (p < C) has position p; any other has ``high_b - min(p, high_b) + C``; all clamped to
    ``K_p - 1``. The query time is ``query_time[b]``, else the sequence's last timestamp.
    """
    cd = compute_dtype(seq_embeddings.dtype)
    rows = seq_embeddings.shape[0]
    seg, pos = row_positions(seq_offsets, rows)
    high = _history_end(seq_lengths, num_targets, interleave_targets)[seg]
    from_end = high - torch.minimum(pos, high) + max_contextual_seq_len
    pos_index = torch.where(pos < max_contextual_seq_len, pos, from_end)
    pos_index = pos_index.clamp(max=position_embeddings_weight.shape[0] - 1)

    if query_time is None:
        last = seq_offsets.to(torch.int64)[1:] - 1
        query_times = timestamps[last[seg]]
    else:
        query_times = query_time.reshape(-1)[seg]
    buckets = time_buckets(
        timestamps,
        query_times,
        time_bucket_fn,
        time_bucket_increments,
        timestamp_embeddings_weight.shape[0] - 1,
    )
    out = (
        seq_embeddings.to(cd) * alpha
        + position_embeddings_weight.to(cd).index_select(0, pos_index)
        + timestamp_embeddings_weight.to(cd).index_select(0, buckets)
    )
    return out.to(seq_embeddings.dtype)
