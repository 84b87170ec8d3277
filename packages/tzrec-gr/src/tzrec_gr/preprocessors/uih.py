"""The history-only preprocessor: a linear map of the history, optional actions and the
contextual prefix."""

from __future__ import annotations

from typing import Optional

import torch

from tzrec_gr._backend import BackendArg
from tzrec_gr.action_encoder import SimpleActionEncoder
from tzrec_gr.contextualize_mlps import ContextualizedMLP
from tzrec_gr.features import (
    CONTEXTUAL,
    HISTORY,
    actions_key,
    lengths_key,
    sequence_key,
    timestamps_key,
    watchtimes_key,
)
from tzrec_gr.layers import Linear
from tzrec_gr.preprocessors.base import (
    Features,
    PreprocessorOutput,
    _check_lengths,
    _ContextualBase,
    _flat1,
    _get,
)
from tzrec_ops.jagged import as_int64, mirror, offsets_from_lengths

__all__ = ["UIHPreprocessor"]


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
