"""Positional embeddings added to a jagged batch of token embeddings.

Legend: B = batch, L = total tokens, D = embedding dim, K = table rows, T_b = targets of
sequence b (at its end), C = contextual prefix length. Table and x dtypes may differ; the
output has x's dtype.

Example, one sequence of length 5 with 2 targets (high = 3) and a 16-row table::

    add_positional_embeddings:            rows P[0], P[1], P[2], P[3], P[3]
    add_timestamp_positional_embeddings:  C = 0: rows P[3], P[2], P[1], P[0], P[0]
"""

from __future__ import annotations

from typing import Optional, Union

import torch

from tzrec_ops.jagged import lengths_from_offsets
from tzrec_ops.ops.validation import (
    check_dim,
    check_jagged,
    check_non_negative,
    check_offsets,
    check_once,
    check_positive,
    check_same_device,
    check_tensor,
    first_true,
)
from tzrec_ops.registry import Backend, select_backend

BackendArg = Union[str, Backend, None]
_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_INTS = (torch.int32, torch.int64)
TIME_BUCKET_FNS = ("sqrt", "log")


def _check_sequences(
    max_seq_len: int,
    seq_offsets: torch.Tensor,
    seq_lengths: torch.Tensor,
    seq_embeddings: torch.Tensor,
    num_targets: Optional[torch.Tensor],
    tables: dict,
) -> None:
    """Shapes, dtypes and devices of the jagged batch and the tables."""
    check_non_negative("max_seq_len", max_seq_len)
    check_tensor("seq_embeddings", seq_embeddings, ndim=2, dtypes=_FLOATS)
    check_tensor("seq_lengths", seq_lengths, ndim=1, dtypes=_INTS)
    batch = seq_lengths.numel()
    check_offsets("seq_offsets", seq_offsets, batch=batch)
    dim = seq_embeddings.shape[1]
    for name, table in tables.items():
        check_tensor(name, table, ndim=2, dtypes=_FLOATS)
        if table.shape[0] < 1:
            raise ValueError(f"{name} must have at least one row, got shape {list(table.shape)}")
        check_dim(name, table, 1, dim, "seq_embeddings.shape[1]")
    if num_targets is not None:
        check_tensor("num_targets", num_targets, ndim=1, dtypes=_INTS)
        check_dim("num_targets", num_targets, 0, batch, "the batch size B = seq_lengths.numel()")
    check_same_device(
        ("seq_embeddings", seq_embeddings),
        ("seq_offsets", seq_offsets),
        ("seq_lengths", seq_lengths),
        ("num_targets", num_targets),
        *tables.items(),
    )


def _check_values(
    max_seq_len: int,
    seq_offsets: torch.Tensor,
    seq_lengths: torch.Tensor,
    seq_embeddings: torch.Tensor,
    num_targets: Optional[torch.Tensor],
    interleave_targets: bool,
) -> None:
    """The values of the offsets, lengths and targets (once per batch)."""
    check_jagged(
        "seq_offsets",
        seq_offsets,
        total=seq_embeddings.shape[0],
        total_what="the token count seq_embeddings.shape[0]",
        max_seq_len=max_seq_len,
        num_targets=num_targets,
        # interleaved targets alternate with their actions: 2 tokens per target
        targets_factor=2 if interleave_targets else 1,
    )
    check_once("seq_lengths = diff(seq_offsets)", (seq_lengths, seq_offsets), _check_lengths)


def _check_lengths(seq_lengths: torch.Tensor, seq_offsets: torch.Tensor) -> None:
    diffs = lengths_from_offsets(seq_offsets)
    if not torch.equal(seq_lengths, diffs):
        b = first_true(seq_lengths != diffs)
        raise ValueError(
            f"seq_lengths must equal seq_offsets[1:] - seq_offsets[:-1], got "
            f"seq_lengths[{b}] = {int(seq_lengths[b])} for a length of {int(diffs[b])}"
        )


def add_positional_embeddings(
    alpha: float,
    max_seq_len: int,
    position_embeddings_weight: torch.Tensor,
    seq_offsets: torch.Tensor,
    seq_lengths: torch.Tensor,
    seq_embeddings: torch.Tensor,
    num_targets: Optional[torch.Tensor],
    interleave_targets: bool,
    *,
    backend: BackendArg = None,
) -> torch.Tensor:
    """``alpha * x[p] + P[min(p, high_b)]``: positions count forward, targets share ``high_b``.

    Args:
        alpha: scale of the token embeddings.
        max_seq_len: upper bound on the sequence lengths.
        position_embeddings_weight: P [K, D]; indices are clamped to K - 1.
        seq_offsets: [B + 1] int32/int64.
        seq_lengths: [B], equal to the offsets' differences.
        seq_embeddings: x [L, D].
        num_targets: [B] or ``None`` (no targets: ``high_b = length_b``).
        interleave_targets: targets are interleaved with actions, so
            ``high_b = length_b - 2 * T_b``.

    Returns:
        [L, D] in x's dtype.
    """
    _check_sequences(
        max_seq_len,
        seq_offsets,
        seq_lengths,
        seq_embeddings,
        num_targets,
        {"position_embeddings_weight": position_embeddings_weight},
    )
    _check_values(
        max_seq_len, seq_offsets, seq_lengths, seq_embeddings, num_targets, interleave_targets
    )
    impl = select_backend(
        "add_positional_embeddings",
        backend,
        device=seq_embeddings.device,
        dtype=seq_embeddings.dtype,
    )
    return impl(
        alpha=alpha,
        max_seq_len=max_seq_len,
        position_embeddings_weight=position_embeddings_weight,
        seq_offsets=seq_offsets,
        seq_lengths=seq_lengths,
        seq_embeddings=seq_embeddings,
        num_targets=num_targets,
        interleave_targets=interleave_targets,
    )


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
    *,
    backend: BackendArg = None,
) -> torch.Tensor:
    """``alpha * x + P[pos] + T[bucket]`` with positions counted back from the history end.

    Position (C = max_contextual_seq_len, high_b = length_b - T_b, or - 2 T_b interleaved):
    a contextual token p < C gets p; a later token gets ``high_b - min(p, high_b) + C``, so
    the newest history token gets C + 1 and every target gets C. Indices clamp to K_p - 1.

    Time bucket: ``g = max(qt - ts[p], 1e-6) / time_bucket_increments``, then sqrt or log,
    then ``int(clamp(g, 0, K_t))``; qt is ``query_time[b]`` when given, else the sequence's
    last timestamp. Contextual tokens usually carry timestamp 0 and land in the top bucket.

    Args:
        timestamp_embeddings_weight: T [K_t + 1, D].
        timestamps: [L] int or float.
        time_bucket_fn: ``"sqrt"`` or ``"log"``.
        time_bucket_increments: > 0, the time unit of one bucket step.
        query_time: ``None``, [B] or [B, 1], same dtype as timestamps.
        (the rest as in :func:`add_positional_embeddings`)

    Returns:
        [L, D] in x's dtype.
    """
    if time_bucket_fn not in TIME_BUCKET_FNS:
        raise ValueError(f"time_bucket_fn must be 'sqrt' or 'log', got {time_bucket_fn!r}")
    check_positive("time_bucket_increments", time_bucket_increments)
    check_non_negative("max_contextual_seq_len", max_contextual_seq_len)
    _check_sequences(
        max_seq_len,
        seq_offsets,
        seq_lengths,
        seq_embeddings,
        num_targets,
        {
            "position_embeddings_weight": position_embeddings_weight,
            "timestamp_embeddings_weight": timestamp_embeddings_weight,
        },
    )
    check_tensor("timestamps", timestamps, ndim=1)
    check_dim("timestamps", timestamps, 0, seq_embeddings.shape[0], "seq_embeddings.shape[0]")
    check_same_device(("seq_embeddings", seq_embeddings), ("timestamps", timestamps))
    if query_time is not None:
        check_tensor("query_time", query_time)
        batch = seq_lengths.numel()
        if tuple(query_time.shape) not in ((batch,), (batch, 1)):
            raise ValueError(
                f"query_time must have shape [{batch}] or [{batch}, 1], "
                f"got {list(query_time.shape)}"
            )
        if query_time.dtype != timestamps.dtype:
            raise TypeError(
                f"query_time has dtype {query_time.dtype} but timestamps has "
                f"{timestamps.dtype}; they must match"
            )
        check_same_device(("seq_embeddings", seq_embeddings), ("query_time", query_time))
    _check_values(
        max_seq_len, seq_offsets, seq_lengths, seq_embeddings, num_targets, interleave_targets
    )
    impl = select_backend(
        "add_timestamp_positional_embeddings",
        backend,
        device=seq_embeddings.device,
        dtype=seq_embeddings.dtype,
        time_bucket_fn=time_bucket_fn,
        query_time=query_time is not None,
    )
    return impl(
        alpha=alpha,
        max_seq_len=max_seq_len,
        max_contextual_seq_len=max_contextual_seq_len,
        position_embeddings_weight=position_embeddings_weight,
        timestamp_embeddings_weight=timestamp_embeddings_weight,
        seq_offsets=seq_offsets,
        seq_lengths=seq_lengths,
        seq_embeddings=seq_embeddings,
        timestamps=timestamps,
        num_targets=num_targets,
        interleave_targets=interleave_targets,
        time_bucket_fn=time_bucket_fn,
        time_bucket_increments=time_bucket_increments,
        query_time=query_time,
    )
