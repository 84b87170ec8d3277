"""Truncating STU inputs to their newest history: a plan computed once, replayed on tensors.

Each sequence is laid out ``[C contextual | U_b history | T_b targets]``. Truncation keeps
``[C | the newest min(U_b, tail) history tokens | all T_b targets]``: the oldest history
tokens are dropped. Example, C = 1, tail = 2, one sequence ``[c, h0, h1, h2, t0]`` (T = 1)
becomes ``[c, h1, h2, t0]``.

:func:`compute_stu_truncation_plan` reads the offsets and targets back at most once (from
their host copies, see :mod:`tzrec_ops.jagged`) for the plan's integer sizes;
:func:`apply_stu_truncation_plan` reads nothing back, so one plan can be replayed on every
tensor of the batch (embeddings, timestamps, ...).
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Tuple, Union

import torch

from tzrec_ops.jagged import (
    check_once,
    host_copies,
    known_host_copy,
    lengths_from_offsets,
    mirror,
    offsets_from_lengths,
)
from tzrec_ops.ops.jagged_2d import concat_2D_jagged, split_2D_jagged
from tzrec_ops.ops.validation import (
    check_dim,
    check_jagged,
    check_non_negative,
    check_offsets,
    check_same_device,
    check_tensor,
)
from tzrec_ops.registry import Backend

BackendArg = Union[str, Backend, None]


@dataclasses.dataclass(frozen=True)
class STUTruncationPlan:
    """Offsets and sizes that describe one truncation (B = batch, C = contextual length).

    Attributes:
        new_lengths: [B] lengths after truncation.
        new_x_offsets: [B + 1] offsets after truncation (x_offsets' dtype).
        new_max_seq_len: the longest new length (0 for an empty batch).
        pre_max_seq_len: the max_seq_len bound before truncation.
        contextual_seq_len: C.
        offsets_head: [B + 1] cumulative counts of dropped history tokens.
        offsets_tail: [B + 1] cumulative counts of kept tokens after the prefix.
        total_dropped: dropped tokens in the batch.
        total_kept: kept tokens, excluding the B * C prefix tokens.
        offsets_prefix: [B + 1] ``arange(B + 1) * C``.
        offsets_rest: [B + 1] ``x_offsets - offsets_prefix``.
        total_prefix: B * C.
        total_rest: tokens after the prefixes (``total_dropped + total_kept``).
    """

    new_lengths: torch.Tensor
    new_x_offsets: torch.Tensor
    new_max_seq_len: int
    pre_max_seq_len: int
    contextual_seq_len: int
    offsets_head: torch.Tensor
    offsets_tail: torch.Tensor
    total_dropped: int
    total_kept: int
    offsets_prefix: torch.Tensor
    offsets_rest: torch.Tensor
    total_prefix: int
    total_rest: int


PlanOffsets = Tuple[torch.Tensor, ...]


def _plan_offsets(
    x_offsets: torch.Tensor,
    num_targets: Optional[torch.Tensor],
    truncate_tail_len: int,
    contextual_seq_len: int,
) -> PlanOffsets:
    """The plan's index tensors, in :class:`STUTruncationPlan` order: new_lengths,
    new_x_offsets, offsets_head, offsets_tail, offsets_prefix, offsets_rest.

    Plain torch whose results do not depend on the device, so :func:`mirror` can replay
    it on the host copies.
    """
    offsets = x_offsets.to(torch.int64)
    lengths = lengths_from_offsets(offsets)
    targets = torch.zeros_like(lengths) if num_targets is None else num_targets.to(torch.int64)
    history = lengths - targets - contextual_seq_len
    dropped = history - history.clamp(max=truncate_tail_len)
    new_lengths = lengths - dropped
    offsets_prefix = torch.arange(lengths.numel() + 1, device=offsets.device) * contextual_seq_len
    return (
        new_lengths.to(x_offsets.dtype),
        offsets_from_lengths(new_lengths).to(x_offsets.dtype),
        offsets_from_lengths(dropped),
        offsets_from_lengths(new_lengths - contextual_seq_len),
        offsets_prefix,
        offsets - offsets_prefix,
    )


def _check_truncated_total_len(
    x_offsets: torch.Tensor,
    num_targets: Optional[torch.Tensor],
    truncate_tail_len: int,
    contextual_seq_len: int,
    truncated_total_len: int,
) -> None:
    """The caller's ``truncated_total_len`` is the real token count after truncation.

    Checked on the inputs' host copies, once per batch and value; without this check the
    plan's splits would fail with a message that does not name ``truncated_total_len``.
    """

    def check(offsets: torch.Tensor, targets: Optional[torch.Tensor]) -> None:
        new_offsets = _plan_offsets(offsets, targets, truncate_tail_len, contextual_seq_len)[1]
        kept = int(new_offsets[-1])
        if kept != truncated_total_len:
            raise ValueError(
                f"truncated_total_len ({truncated_total_len}) must equal the number of tokens "
                f"left after truncation ({kept})"
            )

    key = ("truncated_total_len", truncated_total_len, truncate_tail_len, contextual_seq_len)
    check_once(key, (x_offsets, num_targets), check)


def _plan_of_known_size(
    x_offsets: torch.Tensor,
    num_targets: Optional[torch.Tensor],
    max_seq_len: int,
    truncate_tail_len: int,
    contextual_seq_len: int,
    total_len: Optional[int],
    truncated_total_len: int,
    truncated_max_seq_len: Optional[int],
) -> STUTruncationPlan:
    """:func:`compute_stu_truncation_plan` with the sizes from the caller (no host read)."""
    if total_len is None:
        raise ValueError("truncated_total_len needs total_len, the token count before truncation")
    c = contextual_seq_len
    total_prefix = (x_offsets.numel() - 1) * c
    if not total_prefix <= truncated_total_len <= total_len:
        raise ValueError(
            f"truncated_total_len ({truncated_total_len}) must be between B * C "
            f"({total_prefix}) and the number of tokens ({total_len})"
        )
    # before the plan is derived, so that the plan's tensors get host copies too
    _check_truncated_total_len(x_offsets, num_targets, truncate_tail_len, c, truncated_total_len)
    new_lengths, new_x_offsets, offsets_head, offsets_tail, offsets_prefix, offsets_rest = mirror(
        _plan_offsets, x_offsets, num_targets, truncate_tail_len, c
    )
    return STUTruncationPlan(
        new_lengths=new_lengths,
        new_x_offsets=new_x_offsets,
        new_max_seq_len=min(max_seq_len, truncated_max_seq_len or max_seq_len),
        pre_max_seq_len=max_seq_len,
        contextual_seq_len=c,
        offsets_head=offsets_head,
        offsets_tail=offsets_tail,
        total_dropped=total_len - truncated_total_len,
        total_kept=truncated_total_len - total_prefix,
        offsets_prefix=offsets_prefix,
        offsets_rest=offsets_rest,
        total_prefix=total_prefix,
        total_rest=total_len - total_prefix,
    )


def compute_stu_truncation_plan(
    x_offsets: torch.Tensor,
    num_targets: Optional[torch.Tensor],
    max_seq_len: int,
    *,
    truncate_tail_len: int,
    contextual_seq_len: int = 0,
    total_len: Optional[int] = None,
    truncated_total_len: Optional[int] = None,
    truncated_max_seq_len: Optional[int] = None,
) -> STUTruncationPlan:
    """Plan keeping the newest ``truncate_tail_len`` history tokens of every sequence.

    Args:
        x_offsets: [B + 1] int32/int64 offsets of the jagged batch.
        num_targets: [B] targets at the end of each sequence, or ``None`` (everything after
            the prefix is history).
        max_seq_len: the batch's current max_seq_len bound (kept as ``pre_max_seq_len``).
        truncate_tail_len: history tokens to keep per sequence (>= 0).
        contextual_seq_len: C, the prefix kept in front of every sequence (>= 0).
        total_len: L, the batch's token count (``x.shape[0]``); needed with
            ``truncated_total_len``. Default: None.
        truncated_total_len: the token count after truncation (the B * C prefix tokens
            included), from the caller: the plan then takes no size from the offsets, and
            this count is checked on their host copies once per batch (no read when they are
            known). Default: None (the sizes come from the host copies).
        truncated_max_seq_len: with ``truncated_total_len``, an upper bound on the new
            lengths. Default: None (``max_seq_len``).

    Returns:
        The :class:`STUTruncationPlan`. Its sizes come from the host copies of
        ``x_offsets`` and ``num_targets`` (one device-to-host transfer for both, none for
        tensors moved with :func:`~tzrec_ops.jagged.to_device`), or from the caller's
        ``truncated_total_len``; its index tensors carry host copies too, so applying the
        plan reads nothing back.
    """
    if truncated_total_len is not None:
        return _plan_of_known_size(
            x_offsets,
            num_targets,
            max_seq_len,
            truncate_tail_len,
            contextual_seq_len,
            total_len,
            truncated_total_len,
            truncated_max_seq_len,
        )
    check_non_negative("truncate_tail_len", truncate_tail_len)
    check_non_negative("contextual_seq_len", contextual_seq_len)
    check_non_negative("max_seq_len", max_seq_len)
    check_offsets("x_offsets", x_offsets)
    batch = x_offsets.numel() - 1
    if num_targets is not None:
        check_tensor("num_targets", num_targets, ndim=1, dtypes=(torch.int32, torch.int64))
        check_dim("num_targets", num_targets, 0, batch, "x_offsets.numel() - 1")
        check_same_device(("x_offsets", x_offsets), ("num_targets", num_targets))
    # one transfer for both copies; the plan's sizes need them even with value checks off
    total = int(host_copies([x_offsets, num_targets])[0].values[-1])
    check_jagged(
        "x_offsets",
        x_offsets,
        total=None,
        max_seq_len=max_seq_len,
        min_length=contextual_seq_len,
        min_length_why="contextual_seq_len, the prefix every sequence holds",
        num_targets=num_targets,
        targets_reserve=contextual_seq_len,
        targets_reserve_why="contextual_seq_len",
    )
    new_lengths, new_x_offsets, offsets_head, offsets_tail, offsets_prefix, offsets_rest = mirror(
        _plan_offsets, x_offsets, num_targets, truncate_tail_len, contextual_seq_len
    )
    host_new_lengths = known_host_copy(new_lengths).values
    total_dropped = int(known_host_copy(offsets_head).values[-1])
    total_prefix = batch * contextual_seq_len
    return STUTruncationPlan(
        new_lengths=new_lengths,
        new_x_offsets=new_x_offsets,
        new_max_seq_len=int(host_new_lengths.max()) if batch > 0 else 0,
        pre_max_seq_len=max_seq_len,
        contextual_seq_len=contextual_seq_len,
        offsets_head=offsets_head,
        offsets_tail=offsets_tail,
        total_dropped=total_dropped,
        total_kept=total - total_prefix - total_dropped,
        offsets_prefix=offsets_prefix,
        offsets_rest=offsets_rest,
        total_prefix=total_prefix,
        total_rest=total - total_prefix,
    )


def apply_stu_truncation_plan(
    x: torch.Tensor, plan: STUTruncationPlan, *, backend: BackendArg = None
) -> torch.Tensor:
    """Apply ``plan`` to a jagged tensor of the planned batch, without host syncs.

    Args:
        x: [L, D] or [L] (e.g. timestamps), with L = the planned batch's token count.
        plan: from :func:`compute_stu_truncation_plan`.
        backend: used for the jagged split/concat.

    Returns:
        [L', D] or [L'], L' = ``plan.total_prefix + plan.total_kept``.
    """
    if not isinstance(plan, STUTruncationPlan):
        raise TypeError(f"plan must be an STUTruncationPlan, got {type(plan).__name__}")
    check_tensor("x", x)
    if x.dim() not in (1, 2):
        raise ValueError(f"x must be 1-D or 2-D, got {x.dim()}-D with shape {tuple(x.shape)}")
    expected = plan.total_prefix + plan.total_rest
    if x.shape[0] != expected:
        raise ValueError(
            f"x.shape[0] ({x.shape[0]}) must equal the planned token count ({expected})"
        )
    values = x.unsqueeze(-1) if x.dim() == 1 else x
    c = plan.contextual_seq_len
    if c > 0:
        prefix, rest = split_2D_jagged(
            plan.pre_max_seq_len,
            values,
            total_len_left=plan.total_prefix,
            total_len_right=plan.total_rest,
            max_len_left=c,
            offsets_right=plan.offsets_rest,
            backend=backend,
        )
    else:
        rest = values
    _, tail = split_2D_jagged(
        plan.pre_max_seq_len,
        rest,
        total_len_left=plan.total_dropped,
        total_len_right=plan.total_kept,
        offsets_left=plan.offsets_head,
        offsets_right=plan.offsets_tail,
        backend=backend,
    )
    if c > 0:
        tail = concat_2D_jagged(
            prefix,
            tail,
            max_len_left=c,
            max_len_right=plan.new_max_seq_len,
            offsets_right=plan.offsets_tail,
            backend=backend,
        )
    return tail.squeeze(-1) if x.dim() == 1 else tail
