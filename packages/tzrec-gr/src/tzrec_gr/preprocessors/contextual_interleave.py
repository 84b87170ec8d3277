"""The history + candidates preprocessor: content, actions (summed or interleaved) and the
contextual prefix."""

from __future__ import annotations

from typing import Optional

import torch

from tzrec_gr._backend import BackendArg
from tzrec_gr.action_encoder import SimpleActionEncoder
from tzrec_gr.content_encoder import ContentEncoder
from tzrec_gr.contextualize_mlps import ContextualizedMLP
from tzrec_gr.features import (
    CANDIDATE_LENGTHS,
    CANDIDATE_SEQUENCE,
    CANDIDATE_TIMESTAMPS,
    CONTEXTUAL,
    HISTORY,
    actions_key,
    lengths_key,
    sequence_key,
    timestamps_key,
    watchtimes_key,
)
from tzrec_gr.preprocessors.base import (
    Features,
    PreprocessorOutput,
    _check_lengths,
    _ContextualBase,
    _flat1,
    _get,
)
from tzrec_ops.jagged import (
    as_int64,
    concat_jagged_rows,
    mirror,
    offsets_from_lengths,
    row_positions,
)

__all__ = ["ContextualInterleavePreprocessor"]


def _interleaved_lengths(lengths: torch.Tensor, num_targets: torch.Tensor) -> torch.Tensor:
    """Lengths once every history token became a (content, action) pair."""
    return 2 * (lengths - num_targets) + num_targets


class ContextualInterleavePreprocessor(_ContextualBase):
    """History + candidates with content, action and contextual features.

    Content: ``content_mlp(content_encoder(history, candidates))``. Actions (optional):
    ``action_mlp(action_encoder(...))``. Without interleaving the two are summed per token.
    With interleaving each history token becomes two tokens ``[content, action]``; candidates
    become pairs too in training, and keep only their content token in eval (their actions
    are unknown). Finally C contextual tokens (with timestamp 0) are prepended.

    Args:
        uih_embedding_dim (int): Du.
        target_embedding_dim (int): Dt.
        output_embedding_dim (int): E.
        content_encoder (ContentEncoder): history + candidates -> [L, Dc].
        content_mlp (ContextualizedMLP): [L, Dc] -> [L, E].
        action_encoder (SimpleActionEncoder | None): Default: None.
        action_mlp (ContextualizedMLP | None): [L, T * A] -> [L, E]; required with an action
            encoder. Default: None.
        contextual_feature_dim (int): Fc (0: no contextual tokens). Default: 0.
        max_contextual_seq_len (int): C. Default: 0.
        contextual_group_name (str): feature key of the contextual features.
            Default: "contextual".
        enable_interleaving (bool): interleave content and action tokens; needs an action
            encoder. Default: False.
        name (str): prefix of the history feature keys. Default: "uih".
        backend (str | Backend | None): ops backend. Default: None.
        device (torch.device | None): parameter device. Default: None.

    Call Args / Returns: see :class:`InputPreprocessor`.
    """

    def __init__(
        self,
        uih_embedding_dim: int,
        target_embedding_dim: int,
        output_embedding_dim: int,
        content_encoder: ContentEncoder,
        content_mlp: ContextualizedMLP,
        action_encoder: Optional[SimpleActionEncoder] = None,
        action_mlp: Optional[ContextualizedMLP] = None,
        contextual_feature_dim: int = 0,
        max_contextual_seq_len: int = 0,
        contextual_group_name: str = CONTEXTUAL,
        enable_interleaving: bool = False,
        name: str = HISTORY,
        backend: BackendArg = None,
        device: Optional[torch.device] = None,
    ) -> None:
        super().__init__(
            output_embedding_dim,
            contextual_feature_dim,
            max_contextual_seq_len,
            contextual_group_name,
            name,
            backend,
            device,
        )
        if enable_interleaving and action_encoder is None:
            raise ValueError("enable_interleaving=True needs an action_encoder")
        if action_encoder is not None and action_mlp is None:
            raise ValueError("action_encoder needs an action_mlp to map it to the output width")
        if content_mlp.output_dim != output_embedding_dim:
            raise ValueError(
                f"content_mlp.output_dim ({content_mlp.output_dim}) must equal "
                f"output_embedding_dim ({output_embedding_dim})"
            )
        if action_mlp is not None and action_mlp.output_dim != output_embedding_dim:
            raise ValueError(
                f"action_mlp.output_dim ({action_mlp.output_dim}) must equal "
                f"output_embedding_dim ({output_embedding_dim})"
            )
        self.uih_embedding_dim = uih_embedding_dim
        self.target_embedding_dim = target_embedding_dim
        self.content_encoder = content_encoder
        self.content_mlp = content_mlp
        self.action_encoder = action_encoder
        self.action_mlp = action_mlp
        self.enable_interleaving = enable_interleaving

    def interleave_targets(self) -> bool:
        return self.enable_interleaving and self.training

    def max_output_len(self, max_uih_len: int, max_targets: int) -> int:
        # interleaving makes two tokens of every event (of every candidate too in training)
        per_event = 2 if self.enable_interleaving else 1
        return self._contextual_seq_len + per_event * (max_uih_len + max_targets)

    def forward(
        self, features: Features, max_uih_len: int, max_targets: int = 0
    ) -> PreprocessorOutput:
        k = self.name
        uih = _get(features, sequence_key(k))
        uih_lengths = _get(features, lengths_key(k))
        cand = _get(features, CANDIDATE_SEQUENCE)
        cand_lengths = _get(features, CANDIDATE_LENGTHS)
        _check_lengths(lengths_key(k), uih_lengths, None)
        batch = uih_lengths.shape[0]
        _check_lengths(CANDIDATE_LENGTHS, cand_lengths, batch)
        total_uih, total_t = uih.shape[0], cand.shape[0]
        uih_ts = _flat1(
            timestamps_key(k),
            _get(features, timestamps_key(k)),
            total_uih,
            "history",
        )
        cand_ts = _flat1(
            CANDIDATE_TIMESTAMPS,
            _get(features, CANDIDATE_TIMESTAMPS),
            total_t,
            "candidate",
        )
        raw_ctx = self._raw_contextual(features, batch)

        uih_offsets = mirror(offsets_from_lengths, uih_lengths)
        cand_offsets = mirror(offsets_from_lengths, cand_lengths)
        num_targets = as_int64(cand_lengths)
        lengths = mirror(torch.add, as_int64(uih_lengths), num_targets)
        # the running sums of history and candidate lengths add up (int64, exact)
        offsets = mirror(torch.add, uih_offsets, cand_offsets)
        max_len = max_uih_len + max_targets
        content = self.content_encoder(
            uih, cand, max_uih_len, max_targets, uih_offsets, cand_offsets
        )
        content = self.content_mlp(content, offsets, max_len, raw_ctx)
        cand_ts = cand_ts.to(torch.int64)
        timestamps = concat_jagged_rows(uih_ts.to(torch.int64), cand_ts, uih_offsets, cand_offsets)

        def one_token_per_event(embeddings: torch.Tensor) -> PreprocessorOutput:
            return PreprocessorOutput(
                max_len,
                total_uih,
                total_t,
                lengths,
                offsets,
                timestamps,
                embeddings,
                num_targets,
                cand_offsets,
                cand_ts,
            )

        if self.action_encoder is None or self.action_mlp is None:
            return self._add_prefix(one_token_per_event(content), raw_ctx)

        actions = _flat1(actions_key(k), _get(features, actions_key(k)), total_uih, "history")
        watch = None
        if self.action_encoder.need_watchtime:
            watch = _flat1(
                watchtimes_key(k),
                _get(features, watchtimes_key(k)),
                total_uih,
                "history",
            )
        action = self.action_encoder(
            actions, max_uih_len, uih_offsets, max_targets, cand_offsets, total_t, watch
        ).to(content.dtype)
        action = self.action_mlp(action, offsets, max_len, raw_ctx)

        if not self.enable_interleaving:
            out = one_token_per_event(content + action)
        elif self.training:
            pairs = torch.stack([content, action], dim=1).reshape(-1, content.shape[1])
            out = PreprocessorOutput(
                2 * max_len,
                2 * total_uih,
                2 * total_t,
                mirror(torch.mul, lengths, 2),
                mirror(torch.mul, offsets, 2),
                timestamps.unsqueeze(1).expand(-1, 2).reshape(-1),
                pairs,
                mirror(torch.mul, num_targets, 2),
                mirror(torch.mul, cand_offsets, 2),
            )
        else:
            out = self._interleave_history_only(
                content,
                action,
                timestamps,
                lengths,
                offsets,
                num_targets,
                2 * max_uih_len + max_targets,
                total_uih,
                total_t,
            )._replace(target_offsets=cand_offsets, target_timestamps=cand_ts)
        return self._add_prefix(out, raw_ctx)

    @staticmethod
    def _interleave_history_only(
        content: torch.Tensor,
        action: torch.Tensor,
        timestamps: torch.Tensor,
        lengths: torch.Tensor,
        offsets: torch.Tensor,
        num_targets: torch.Tensor,
        max_len: int,
        total_uih: int,
        total_t: int,
    ) -> PreprocessorOutput:
        """History tokens -> (content, action) pairs; candidates keep their content only."""
        uih_len = lengths - num_targets
        new_lengths = mirror(_interleaved_lengths, lengths, num_targets)
        new_offsets = mirror(offsets_from_lengths, new_lengths)
        total = 2 * total_uih + total_t
        sample, pos = row_positions(new_offsets, total)
        hist = uih_len[sample]
        in_history = pos < 2 * hist
        token = torch.where(in_history, torch.div(pos, 2, rounding_mode="floor"), pos - hist)
        slot = torch.where(in_history, pos % 2, torch.zeros_like(pos))
        source = offsets[sample] + token
        pairs = torch.stack([content, action], dim=1).reshape(-1, content.shape[1])
        return PreprocessorOutput(
            max_len,
            2 * total_uih,
            total_t,
            new_lengths,
            new_offsets,
            timestamps.index_select(0, source),
            pairs.index_select(0, 2 * source + slot),
            num_targets,
        )
