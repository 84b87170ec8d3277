"""Input preprocessors: turn grouped features into one jagged token sequence per sample.

Legend: B = batch, L_u / L_t = total history (UIH) / candidate tokens, Du / Dt their
embedding widths, E = output width, C = contextual prefix tokens, Fc = width of one
contextual feature, U_b / T_b = history / candidate tokens of sample b.

Features are a plain ``Dict[str, torch.Tensor]`` (use :mod:`tzrec_gr.torchrec_adapters` for
torchrec inputs). With ``name = "uih"`` the keys are (:mod:`tzrec_gr.features` names them):

=============================== ===================== =====================================
key                             shape                 meaning
=============================== ===================== =====================================
``uih.sequence``                [L_u, Du] float       history item embeddings
``uih.sequence_length``         [B] int               U_b
``uih_timestamp.sequence``      [L_u] int             history timestamps (seconds)
``uih_action.sequence``         [L_u] int             action bitmask (with an action encoder)
``uih_watchtime.sequence``      [L_u] int             watch time (with watch-time actions)
``candidate.sequence``          [L_t, Dt] float       candidate item embeddings
``candidate.sequence_length``   [B] int               T_b (= num_targets)
``candidate_timestamp.sequence`` [L_t] int            candidate timestamps
``contextual``                  [B, C * Fc] float     contextual features (C > 0)
=============================== ===================== =====================================

Sizes are never read from the device: the caller passes upper bounds ``max_uih_len`` and
``max_targets``; totals come from tensor shapes.

Output sequence of sample b: ``[C contextual tokens | U_b history | T_b candidates]``
(with interleaving, each history token becomes a (content, action) pair; in training the
candidates too).

One module, a little over 600 lines, on purpose: the two preprocessors share the
contextual-prefix base, the jagged helpers and the feature table above, and each is about
a hundred to two hundred lines; split them when a third preprocessor comes.
"""

from __future__ import annotations

import abc
import math
from typing import Dict, NamedTuple, Optional

import torch
from torch import nn

from tzrec_gr._backend import BackendArg, resolve_module_backend
from tzrec_gr.action_encoder import SimpleActionEncoder
from tzrec_gr.content_encoder import ContentEncoder
from tzrec_gr.contextualize_mlps import ContextualizedMLP
from tzrec_gr.features import (
    CANDIDATE_LENGTHS,
    CANDIDATE_SEQUENCE,
    CANDIDATE_TIMESTAMPS,
    CONTEXTUAL,
    HISTORY,
    UIH_LENGTHS,
    actions_key,
    lengths_key,
    sequence_key,
    timestamps_key,
    watchtimes_key,
)
from tzrec_gr.layers import Linear
from tzrec_ops import concat_2D_jagged
from tzrec_ops.jagged import (
    as_int64,
    concat_jagged_rows,
    mirror,
    offsets_from_lengths,
    row_positions,
)

__all__ = [
    "PreprocessorOutput",
    "InputPreprocessor",
    "ContextualProjection",
    "ContextualInterleavePreprocessor",
    "UIHPreprocessor",
]

Features = Dict[str, torch.Tensor]


class PreprocessorOutput(NamedTuple):
    """The token sequence the STU stack consumes.

    Attributes:
        max_seq_len: upper bound on ``seq_lengths``.
        total_uih_len: rows that are not candidates (prefix + history), an int.
        total_targets: candidate rows, an int.
        seq_lengths: [B] int64.
        seq_offsets: [B + 1] int64.
        seq_timestamps: [L] int64 (contextual tokens carry 0).
        seq_embeddings: [L, E].
        num_targets: [B] int64, candidate rows at the end of each sample.
        target_offsets: [B + 1] int64 offsets of ``num_targets`` (the candidate rows), or
            None (then whoever needs them derives them from ``num_targets``).
        target_timestamps: [total_targets] int64 timestamps of the candidate rows (those of
            ``seq_timestamps``), or None (then they are gathered from ``seq_timestamps``).
    """

    max_seq_len: int
    total_uih_len: int
    total_targets: int
    seq_lengths: torch.Tensor
    seq_offsets: torch.Tensor
    seq_timestamps: torch.Tensor
    seq_embeddings: torch.Tensor
    num_targets: torch.Tensor
    target_offsets: Optional[torch.Tensor] = None
    target_timestamps: Optional[torch.Tensor] = None


def _get(features: Features, key: str) -> torch.Tensor:
    if key not in features:
        known = ", ".join(sorted(features)) or "none"
        raise KeyError(f"missing feature {key!r}; features given: {known}")
    return features[key]


def _flat1(name: str, x: torch.Tensor, rows: int, what: str) -> torch.Tensor:
    x = x.reshape(x.shape[0], -1) if x.dim() > 1 else x
    if x.dim() == 2:
        if x.shape[1] != 1:
            raise ValueError(f"{name} must be [{what}] or [{what}, 1], got {tuple(x.shape)}")
        x = x[:, 0]
    if x.shape[0] != rows:
        raise ValueError(
            f"{name} has {x.shape[0]} rows but there are {rows} {what} tokens; they must match"
        )
    return x


def _interleaved_lengths(lengths: torch.Tensor, num_targets: torch.Tensor) -> torch.Tensor:
    """Lengths once every history token became a (content, action) pair."""
    return 2 * (lengths - num_targets) + num_targets


def _check_lengths(name: str, lengths: torch.Tensor, batch: Optional[int]) -> None:
    if lengths.dim() != 1:
        raise ValueError(f"{name} must be 1-D [B], got shape {tuple(lengths.shape)}")
    if batch is not None and lengths.shape[0] != batch:
        raise ValueError(
            f"{name} has B = {lengths.shape[0]} entries but {UIH_LENGTHS} has "
            f"{batch}; every feature must have the same batch size"
        )


class ContextualProjection(nn.Module):
    """One linear map per contextual slot: ``ctx[b, c] = x[b, c] @ W_c + b_c``.

    Args:
        num_slots (int): C.
        feature_dim (int): Fc.
        output_dim (int): E.
        device (torch.device | None): parameter device. Default: None.

    Call Args:
        x (torch.Tensor): [B, C * Fc].

    Returns:
        torch.Tensor: [B * C, E], the C prefix tokens of each sample.
    """

    def __init__(
        self,
        num_slots: int,
        feature_dim: int,
        output_dim: int,
        device: Optional[torch.device] = None,
    ) -> None:
        super().__init__()
        self.num_slots = num_slots
        self.feature_dim = feature_dim
        self.output_dim = output_dim
        std = math.sqrt(2.0 / (feature_dim + output_dim))
        self.weight = nn.Parameter(
            torch.randn(num_slots, feature_dim, output_dim, device=device) * std
        )
        self.bias = nn.Parameter(torch.zeros(num_slots, 1, output_dim, device=device))

    def forward(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        width = self.num_slots * self.feature_dim
        if x.dim() != 2 or x.shape[1] != width:
            raise ValueError(
                f"contextual features must be [B, C * Fc] = [B, {width}], got {tuple(x.shape)}"
            )
        slots = x.to(dtype).reshape(-1, self.num_slots, self.feature_dim).transpose(0, 1)
        out = torch.baddbmm(self.bias.to(dtype), slots, self.weight.to(dtype))  # [C, B, E]
        return out.transpose(0, 1).reshape(-1, self.output_dim)


class InputPreprocessor(nn.Module, abc.ABC):
    """Interface.

    Call Args:
        features (Dict[str, torch.Tensor]): see the module docstring.
        max_uih_len (int): upper bound on history lengths U_b.
        max_targets (int): upper bound on candidate counts T_b (0 for history-only).

    Returns:
        PreprocessorOutput.
    """

    output_dim: int

    def interleave_targets(self) -> bool:
        """True when candidates are (content, action) pairs in the output."""
        return False

    def contextual_seq_len(self) -> int:
        """C, the contextual tokens prepended to each sample."""
        return 0

    def contextual_feature_key(self) -> Optional[str]:
        """The feature key of the contextual features (None: no contextual prefix)."""
        return None

    def max_output_len(self, max_uih_len: int, max_targets: int) -> int:
        """The longest sequence this preprocessor outputs for these bounds, in train and
        eval mode (one token per history event and candidate, after the C prefix)."""
        return self.contextual_seq_len() + max_uih_len + max_targets

    @abc.abstractmethod
    def forward(
        self, features: Features, max_uih_len: int, max_targets: int = 0
    ) -> PreprocessorOutput: ...


class _ContextualBase(InputPreprocessor):
    def __init__(
        self,
        output_embedding_dim: int,
        contextual_feature_dim: int,
        max_contextual_seq_len: int,
        contextual_group_name: str,
        name: str,
        backend: BackendArg,
        device: Optional[torch.device],
    ) -> None:
        super().__init__()
        if max_contextual_seq_len < 0 or contextual_feature_dim < 0:
            raise ValueError(
                "max_contextual_seq_len and contextual_feature_dim must be >= 0, got "
                f"{max_contextual_seq_len} and {contextual_feature_dim}"
            )
        if (max_contextual_seq_len > 0) != (contextual_feature_dim > 0):
            raise ValueError(
                "max_contextual_seq_len and contextual_feature_dim must both be > 0 or both 0, "
                f"got {max_contextual_seq_len} and {contextual_feature_dim}"
            )
        self.output_dim = output_embedding_dim
        self._contextual_seq_len = max_contextual_seq_len
        self.contextual_feature_dim = contextual_feature_dim
        self.contextual_group_name = contextual_group_name
        self.name = name or HISTORY
        self.contextual = (
            ContextualProjection(
                max_contextual_seq_len, contextual_feature_dim, output_embedding_dim, device=device
            )
            if max_contextual_seq_len > 0
            else None
        )
        self._concat_backend = resolve_module_backend(backend, ("concat_2D_jagged",))

    def contextual_seq_len(self) -> int:
        return self._contextual_seq_len

    def contextual_feature_key(self) -> Optional[str]:
        return self.contextual_group_name if self.contextual is not None else None

    def _raw_contextual(self, features: Features, batch: int) -> Optional[torch.Tensor]:
        if self.contextual is None:
            return None
        raw = _get(features, self.contextual_group_name)
        if raw.dim() != 2 or raw.shape[0] != batch:
            raise ValueError(
                f"{self.contextual_group_name} must be [B={batch}, C * Fc], got {tuple(raw.shape)}"
            )
        return raw

    def _add_prefix(
        self, out: PreprocessorOutput, raw: Optional[torch.Tensor]
    ) -> PreprocessorOutput:
        if raw is None or self.contextual is None:
            return out
        c = self._contextual_seq_len
        batch = out.seq_lengths.shape[0]
        prefix = self.contextual(raw, out.seq_embeddings.dtype)
        emb = concat_2D_jagged(
            values_left=prefix,
            values_right=out.seq_embeddings,
            max_len_left=c,
            max_len_right=out.max_seq_len,
            offsets_left=None,
            offsets_right=out.seq_offsets,
            backend=self._concat_backend,
        )
        prefix_offsets = torch.arange(batch + 1, device=out.seq_offsets.device) * c
        ts = concat_jagged_rows(
            torch.zeros(
                batch * c, dtype=out.seq_timestamps.dtype, device=out.seq_timestamps.device
            ),
            out.seq_timestamps,
            prefix_offsets,
            out.seq_offsets,
        )
        lengths = mirror(torch.add, out.seq_lengths, c)
        return PreprocessorOutput(
            max_seq_len=out.max_seq_len + c,
            total_uih_len=out.total_uih_len + batch * c,
            total_targets=out.total_targets,
            seq_lengths=lengths,
            seq_offsets=mirror(offsets_from_lengths, lengths),
            seq_timestamps=ts,
            seq_embeddings=emb,
            num_targets=out.num_targets,
            target_offsets=out.target_offsets,
            target_timestamps=out.target_timestamps,
        )


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


class UIHPreprocessor(_ContextualBase):
    """History only (no candidates): ``Linear(Du -> E)`` plus optional actions and prefix.

    Args:
        uih_embedding_dim (int): Du.
        output_embedding_dim (int): E.
        contextual_feature_dim (int): Fc. Default: 0.
        max_contextual_seq_len (int): C. Default: 0.
        contextual_group_name (str): Default: "contextual".
        action_encoder (SimpleActionEncoder | None): Default: None.
        action_mlp (ContextualizedMLP | None): required with an action encoder. Default: None.
        name (str): prefix of the history feature keys. Default: "uih".
        backend (str | Backend | None): ops backend. Default: None.
        device (torch.device | None): parameter device. Default: None.

    Call Args / Returns: see :class:`InputPreprocessor`; ``max_targets`` is ignored and the
    output has ``total_targets = 0`` and ``num_targets`` zeros.
    """

    def __init__(
        self,
        uih_embedding_dim: int,
        output_embedding_dim: int,
        contextual_feature_dim: int = 0,
        max_contextual_seq_len: int = 0,
        contextual_group_name: str = CONTEXTUAL,
        action_encoder: Optional[SimpleActionEncoder] = None,
        action_mlp: Optional[ContextualizedMLP] = None,
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
        if action_encoder is not None and action_mlp is None:
            raise ValueError("action_encoder needs an action_mlp to map it to the output width")
        self.uih_embedding_dim = uih_embedding_dim
        self.projection = Linear(
            uih_embedding_dim, output_embedding_dim, backend=backend, device=device
        )
        self.action_encoder = action_encoder
        self.action_mlp = action_mlp

    def max_output_len(self, max_uih_len: int, max_targets: int) -> int:
        return self._contextual_seq_len + max_uih_len

    def forward(
        self, features: Features, max_uih_len: int, max_targets: int = 0
    ) -> PreprocessorOutput:
        k = self.name
        uih = _get(features, sequence_key(k))
        lengths = _get(features, lengths_key(k))
        _check_lengths(lengths_key(k), lengths, None)
        if uih.dim() != 2 or uih.shape[1] != self.uih_embedding_dim:
            raise ValueError(
                f"{sequence_key(k)} must be [L_u, {self.uih_embedding_dim}], got {tuple(uih.shape)}"
            )
        batch, total = lengths.shape[0], uih.shape[0]
        ts = _flat1(timestamps_key(k), _get(features, timestamps_key(k)), total, "history")
        raw_ctx = self._raw_contextual(features, batch)
        lengths = as_int64(lengths)
        offsets = mirror(offsets_from_lengths, lengths)
        emb = self.projection(uih)
        if self.action_encoder is not None and self.action_mlp is not None:
            actions = _flat1(actions_key(k), _get(features, actions_key(k)), total, "history")
            watch = None
            if self.action_encoder.need_watchtime:
                watch = _flat1(
                    watchtimes_key(k),
                    _get(features, watchtimes_key(k)),
                    total,
                    "history",
                )
            action = self.action_encoder(
                actions, max_uih_len, offsets, 0, torch.zeros_like(offsets), 0, watch
            ).to(emb.dtype)
            emb = emb + self.action_mlp(action, offsets, max_uih_len, raw_ctx)
        out = PreprocessorOutput(
            max_uih_len,
            total,
            0,
            lengths,
            offsets,
            ts.to(torch.int64),
            emb,
            mirror(torch.zeros_like, lengths),
        )
        return self._add_prefix(out, raw_ctx)
