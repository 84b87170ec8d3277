"""Backend-agnostic helpers for HSTU attention masks.

Legend: B = batch, L = total tokens, H = heads, n = one sequence's length, T = its targets.
"""

from __future__ import annotations

from typing import Optional, Union

import torch

from tzrec_ops.jagged import lengths_from_offsets
from tzrec_ops.ops.validation import (
    check_jagged,
    check_non_negative,
    check_offsets,
    check_positive,
    check_same_device,
    check_tensor,
)

__all__ = ["build_sla_func_tensor"]


def build_sla_func_tensor(
    nheads: int,
    sla_k1: int,
    sla_k2: int,
    seq_offsets: torch.Tensor,
    total_q: Union[int, torch.SymInt],
    num_targets: Optional[torch.Tensor] = None,
    contextual_seq_len: int = 0,
    device: Optional[Union[torch.device, str]] = None,
) -> torch.Tensor:
    """The ``attn_func`` tensor of Semi-Local Attention (SLA) for ``hstu_mha``.

    With ``K2 = max(sla_k2, contextual_seq_len)``, position p of a sequence and its history
    end ``Hb = max(n - T, 0)``:

    * a history row (``p < Hb``) sees the global prefix ``[0, min(K2, p + 1))`` and the local
      causal window ``[max(K2, p - sla_k1 + 1), p + 1)``;
    * a target row (``p >= Hb``) sees exactly the history ``[0, Hb)`` (not itself).

    For example n = 6, T = 1, k1 = 2, k2 = 1 (rows are queries, columns keys)::

            0 1 2 3 4 5
        0   1 . . . . .
        1   1 1 . . . .
        2   1 1 1 . . .
        3   1 . 1 1 . .
        4   1 . . 1 1 .
        5   1 1 1 1 1 .     <- target

    Args:
        nheads: H (> 0); every head gets the same mask.
        sla_k1: local window size (>= 0).
        sla_k2: global prefix size (>= 0).
        seq_offsets: [B + 1] int32/int64 offsets of the jagged batch.
        total_q: L, the token count (pass ``x.size(0)`` so no host sync is needed).
        num_targets: [B] targets per sequence on ``seq_offsets``' device, or ``None``.
        contextual_seq_len: prefix length; the global prefix is at least this long.
        device: where to build the tensor (default: ``seq_offsets.device``).

    Returns:
        int32 [H, 3, L], rows ``(cmax0, cmin0, cmax1)``; a stride-0 expand over heads (call
        ``.contiguous()`` if a kernel needs it).
    """
    check_positive("nheads", nheads)
    check_non_negative("sla_k1", sla_k1)
    check_non_negative("sla_k2", sla_k2)
    check_non_negative("contextual_seq_len", contextual_seq_len)
    check_offsets("seq_offsets", seq_offsets)
    if num_targets is not None:
        check_tensor("num_targets", num_targets, ndim=1, dtypes=(torch.int32, torch.int64))
        if num_targets.shape[0] != seq_offsets.shape[0] - 1:
            raise ValueError(
                f"num_targets must have B = {seq_offsets.shape[0] - 1} entries, "
                f"got {num_targets.shape[0]}"
            )
        check_same_device(("seq_offsets", seq_offsets), ("num_targets", num_targets))
    check_jagged(
        "seq_offsets", seq_offsets, total=total_q, total_what="total_q", num_targets=num_targets
    )
    device = seq_offsets.device if device is None else torch.device(device)
    offsets = seq_offsets.to(device=device, dtype=torch.int32)
    lengths = lengths_from_offsets(offsets)
    history_end = lengths
    if num_targets is not None:
        history_end = torch.clamp(lengths - num_targets.to(device=device, dtype=torch.int32), min=0)
    # per-token copies of per-sequence values (repeat_interleave, no gather/searchsorted)
    start = torch.repeat_interleave(offsets[:-1], lengths, output_size=total_q)
    hb = torch.repeat_interleave(history_end, lengths, output_size=total_q)
    pos = torch.arange(total_q, device=device, dtype=torch.int32) - start
    k2 = max(int(sla_k2), int(contextual_seq_len))
    is_history = pos < hb
    cmax0 = torch.where(is_history, torch.clamp(pos + 1, max=k2), hb)
    cmin0 = torch.where(is_history, torch.clamp(pos - sla_k1 + 1, min=k2), hb)
    cmax1 = torch.where(is_history, pos + 1, hb)
    func = torch.stack([cmax0, cmin0, cmax1]).to(torch.int32)
    return func.unsqueeze(0).expand(nheads, 3, func.shape[1])
