"""Action encoders: embed the interaction bitmask of each history token.

Legend: B = batch, L_u / L_t = total history / candidate tokens, T = action types,
A = per-type embedding width.
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import torch
from torch import nn

from tzrec_gr._backend import BackendArg, resolve_module_backend
from tzrec_ops import concat_2D_jagged

__all__ = ["SimpleActionEncoder"]


class SimpleActionEncoder(nn.Module):
    """Sum of per-action embeddings for the bits set in each history token's action mask.

    ``T = len(action_weights) + len(watchtime_to_action_thresholds)`` types; type i is set
    on a history token when ``actions & weight_i != 0`` (watch-time types are first turned
    into bits: ``actions |= (watchtime >= threshold_j) * watchtime_weight_j``). A set type
    contributes its row of the ``[T, A]`` table to its slot of the ``[T * A]`` output; an
    unset one contributes zeros. Candidate tokens, whose actions are unknown, all get one
    learned ``[T * A]`` placeholder.

    Args:
        action_embedding_dim (int): A.
        action_weights (Sequence[int]): one bitmask per action type (e.g. click 1, like 2).
        watchtime_to_action_thresholds (Sequence[int] | None): watch-time thresholds that
            define further action types. Default: None.
        watchtime_to_action_weights (Sequence[int] | None): the bit of each threshold; same
            length as the thresholds. Default: None.
        backend (str | Backend | None): ops backend. Default: None.
        device (torch.device | None): parameter device. Default: None.

    Call Args:
        seq_actions (torch.Tensor): [L_u] (or [L_u, 1]) integer action bitmasks.
        max_uih_len (int): upper bound on history lengths.
        uih_offsets (torch.Tensor): [B + 1].
        max_targets (int): upper bound on candidate counts (0: no candidates).
        target_offsets (torch.Tensor): [B + 1].
        total_targets (int): L_t.
        seq_watchtimes (torch.Tensor | None): [L_u] watch times; required with thresholds.

    Returns:
        torch.Tensor: [L_u + L_t, T * A] float32, history rows then candidates per sample.
    """

    def __init__(
        self,
        action_embedding_dim: int,
        action_weights: Sequence[int],
        watchtime_to_action_thresholds: Optional[Sequence[int]] = None,
        watchtime_to_action_weights: Optional[Sequence[int]] = None,
        backend: BackendArg = None,
        device: Optional[torch.device] = None,
    ) -> None:
        super().__init__()
        thresholds: List[int] = list(watchtime_to_action_thresholds or [])
        tw: List[int] = list(watchtime_to_action_weights or [])
        if len(thresholds) != len(tw):
            raise ValueError(
                f"watchtime_to_action_weights has {len(tw)} entries but "
                f"watchtime_to_action_thresholds has {len(thresholds)}; they must match"
            )
        if action_embedding_dim <= 0:
            raise ValueError(f"action_embedding_dim must be > 0, got {action_embedding_dim}")
        weights = list(action_weights) + tw
        if not weights:
            raise ValueError("action_weights and watchtime_to_action_weights are both empty")
        if any(w <= 0 for w in weights):
            raise ValueError(f"action weights must be positive bitmasks, got {weights}")
        self.action_embedding_dim = action_embedding_dim
        self.num_action_types = len(weights)
        self.output_dim = self.num_action_types * action_embedding_dim
        self.need_watchtime = bool(thresholds)
        self.register_buffer("_weights", torch.tensor(weights, dtype=torch.int64, device=device))
        self.register_buffer(
            "_thresholds", torch.tensor(thresholds, dtype=torch.int64, device=device)
        )
        self.register_buffer(
            "_threshold_weights", torch.tensor(tw, dtype=torch.int64, device=device)
        )
        self.action_table = nn.Parameter(
            torch.randn(self.num_action_types, action_embedding_dim, device=device) * 0.1
        )
        self.target_action_table = nn.Parameter(
            torch.randn(1, self.output_dim, device=device) * 0.1
        )
        self._backend = resolve_module_backend(backend, ("concat_2D_jagged",))

    def forward(
        self,
        seq_actions: torch.Tensor,
        max_uih_len: int,
        uih_offsets: torch.Tensor,
        max_targets: int,
        target_offsets: torch.Tensor,
        total_targets: int,
        seq_watchtimes: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        actions = seq_actions.reshape(-1).to(torch.int64)
        if self.need_watchtime:
            if seq_watchtimes is None:
                raise ValueError(
                    "seq_watchtimes is required: this encoder has watchtime_to_action_thresholds"
                )
            watch = seq_watchtimes.reshape(-1)
            if watch.shape != actions.shape:
                raise ValueError(
                    f"seq_watchtimes has {watch.numel()} rows but seq_actions has "
                    f"{actions.numel()}; they must match"
                )
            hits = watch.to(torch.int64).unsqueeze(1) >= self._thresholds.unsqueeze(0)
            extra = (hits.to(torch.int64) * self._threshold_weights.unsqueeze(0)).sum(dim=1)
            actions = torch.bitwise_or(actions, extra)
        exploded = torch.bitwise_and(actions.unsqueeze(1), self._weights.unsqueeze(0)) > 0
        emb = exploded.unsqueeze(-1).to(self.action_table.dtype) * self.action_table.unsqueeze(0)
        emb = emb.reshape(actions.shape[0], self.output_dim)
        if max_targets == 0:
            return emb
        placeholder = self.target_action_table.expand(total_targets, -1)
        return concat_2D_jagged(
            values_left=emb,
            values_right=placeholder,
            max_len_left=max_uih_len,
            max_len_right=max_targets,
            offsets_left=uih_offsets,
            offsets_right=target_offsets,
            backend=self._backend,
        )
