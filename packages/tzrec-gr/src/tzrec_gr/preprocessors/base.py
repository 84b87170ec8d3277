"""The preprocessors' output, their interface, the contextual prefix they share and the
feature checks (the feature keys are in :mod:`tzrec_gr.preprocessors`)."""

from __future__ import annotations

import abc
import math
from typing import Dict, NamedTuple, Optional

import torch
from torch import nn

from tzrec_gr._backend import BackendArg, resolve_module_backend
from tzrec_gr.features import HISTORY, UIH_LENGTHS
from tzrec_ops import concat_2D_jagged
from tzrec_ops.jagged import concat_jagged_rows, mirror, offsets_from_lengths

__all__ = ["PreprocessorOutput", "InputPreprocessor", "ContextualProjection"]

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
        features (Dict[str, torch.Tensor]): see :mod:`tzrec_gr.preprocessors`.
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
