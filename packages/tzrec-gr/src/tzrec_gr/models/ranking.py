"""HSTU ranking: a DlrmHSTU-style multi-task model over user (x) item embeddings.

Legend: B = batch, L_u / L_t = total history / candidate tokens, E = STU width,
K = number of tasks.
"""

from __future__ import annotations

from typing import Dict, Optional, Sequence

import torch
from torch import nn
from torch.nn import functional as F

from tzrec_gr._backend import BackendArg
from tzrec_gr.action_encoder import SimpleActionEncoder
from tzrec_gr.content_encoder import SliceContentEncoder
from tzrec_gr.contextualize_mlps import SimpleContextualizedMLP
from tzrec_gr.hstu_transducer import HSTUTransducer
from tzrec_gr.layers import MLP, LayerNorm, Linear, SwishLayerNorm
from tzrec_gr.positional_encoder import HSTUPositionalEncoder
from tzrec_gr.postprocessors import TimestampLayerNormPostprocessor
from tzrec_gr.preprocessors import ContextualInterleavePreprocessor
from tzrec_gr.stu import STULayer, STUStack

__all__ = ["HSTURanking"]


class HSTURanking(nn.Module):
    """Scores every candidate of a user on K tasks (e.g. click, like, long view).

    The history (items, actions, timestamps) and the candidates go through an
    :class:`HSTUTransducer` (contextual preprocessor with a slice content encoder and a
    simple action encoder, time-aware positional encoder, target-aware STU stack,
    timestamp layer-norm postprocessor). Each candidate's user embedding is multiplied
    elementwise with its item-tower embedding and a multi-task head gives K logits.

    Args:
        num_items (int): catalogue size.
        item_embedding_dim (int): Du = Dt, the item id embedding width.
        embedding_dim (int): E.
        task_bitmasks (Sequence[int]): one label bit per task; a candidate is positive
            for task k when ``label & task_bitmasks[k] != 0``.
        action_weights (Sequence[int]): bits of the history action mask to embed.
        num_heads (int): H. Default: 2.
        attention_dim (int | None): A. Default: E // H.
        hidden_dim (int | None): V. Default: E // H.
        num_layers (int): STU layers. Default: 2.
        contextual_feature_dim (int): Fc, width of each contextual feature. Default: 0.
        max_contextual_seq_len (int): C contextual features. Default: 0.
        enable_interleaving (bool): interleave content and action tokens. Default: False.
        num_position_buckets (int): Default: 1024.
        num_time_buckets (int): Default: 128.
        item_hidden_dim (int): item tower hidden width. Default: 2 * E.
        mtl_hidden_dim (int): task head hidden width. Default: E.
        task_weights (Sequence[float] | None): loss weight per task. Default: all 1.
        dropout_ratio (float): input and STU output dropout. Default: 0.1.
        backend (str | Backend | None): ops backend. Default: None.
        device (torch.device | None): parameter device. Default: None.

    Call Args:
        batch (Dict[str, torch.Tensor]): ``uih.item_id`` [L_u], ``uih.sequence_length`` [B],
            ``uih_action.sequence`` [L_u], ``uih_timestamp.sequence`` [L_u],
            ``candidate.item_id`` [L_t], ``candidate.sequence_length`` [B],
            ``candidate_timestamp.sequence`` [L_t] and, with C > 0, ``contextual``
            [B, C * Fc].
        max_uih_len (int): upper bound on history lengths.
        max_targets (int): upper bound on candidates per user.

    Returns:
        torch.Tensor: [L_t, K] logits, candidates in input order.
    """

    def __init__(
        self,
        num_items: int,
        item_embedding_dim: int,
        embedding_dim: int,
        task_bitmasks: Sequence[int],
        action_weights: Sequence[int],
        num_heads: int = 2,
        attention_dim: Optional[int] = None,
        hidden_dim: Optional[int] = None,
        num_layers: int = 2,
        contextual_feature_dim: int = 0,
        max_contextual_seq_len: int = 0,
        enable_interleaving: bool = False,
        num_position_buckets: int = 1024,
        num_time_buckets: int = 128,
        item_hidden_dim: Optional[int] = None,
        mtl_hidden_dim: Optional[int] = None,
        task_weights: Optional[Sequence[float]] = None,
        dropout_ratio: float = 0.1,
        backend: BackendArg = None,
        device: Optional[torch.device] = None,
    ) -> None:
        super().__init__()
        if not task_bitmasks:
            raise ValueError("task_bitmasks must name at least one task, got []")
        weights = list(task_weights) if task_weights is not None else [1.0] * len(task_bitmasks)
        if len(weights) != len(task_bitmasks):
            raise ValueError(
                f"task_weights has {len(weights)} entries but task_bitmasks has "
                f"{len(task_bitmasks)}; they must match"
            )
        e, du = embedding_dim, item_embedding_dim
        kw = {"backend": backend, "device": device}
        self.num_tasks = len(task_bitmasks)
        self.register_buffer(
            "_task_bits", torch.tensor(list(task_bitmasks), dtype=torch.int64, device=device)
        )
        self.register_buffer(
            "_task_weights", torch.tensor(weights, dtype=torch.float32, device=device)
        )
        self.item_embeddings = nn.Embedding(num_items, du, device=device)
        nn.init.normal_(self.item_embeddings.weight, std=0.02)
        action_encoder = SimpleActionEncoder(8, action_weights, **kw)
        preprocessor = ContextualInterleavePreprocessor(
            du,
            du,
            e,
            content_encoder=SliceContentEncoder(du, du, backend=backend),
            content_mlp=SimpleContextualizedMLP(du, e, 2 * e, **kw),
            action_encoder=action_encoder,
            action_mlp=SimpleContextualizedMLP(action_encoder.output_dim, e, 2 * e, **kw),
            contextual_feature_dim=contextual_feature_dim,
            max_contextual_seq_len=max_contextual_seq_len,
            enable_interleaving=enable_interleaving,
            **kw,
        )
        c = preprocessor.contextual_seq_len()
        layers = [
            STULayer(
                e,
                num_heads,
                hidden_dim or e // num_heads,
                attention_dim or e // num_heads,
                output_dropout_ratio=dropout_ratio,
                contextual_seq_len=c,
                **kw,
            )
            for _ in range(num_layers)
        ]
        self.transducer = HSTUTransducer(
            preprocessor,
            STUStack(layers),
            positional_encoder=HSTUPositionalEncoder(
                e,
                num_position_buckets,
                num_time_buckets,
                use_time_encoding=True,
                contextual_seq_len=c,
                **kw,
            ),
            output_postprocessor=TimestampLayerNormPostprocessor(e, [3600, 86400], [24, 7], **kw),
            input_dropout_ratio=dropout_ratio,
            backend=backend,
        )
        item_hidden = item_hidden_dim or 2 * e
        self.item_tower = nn.Sequential(
            Linear(du, item_hidden, **kw),
            SwishLayerNorm(item_hidden, **kw),
            Linear(item_hidden, e, **kw),
            LayerNorm(e, **kw),
        )
        self.task_head = nn.Sequential(
            MLP(e, [mtl_hidden_dim or e], activation="silu", **kw),
            Linear(mtl_hidden_dim or e, self.num_tasks, **kw),
        )

    def forward(
        self, batch: Dict[str, torch.Tensor], max_uih_len: int, max_targets: int
    ) -> torch.Tensor:
        for key in ("uih.item_id", "candidate.item_id"):
            if key not in batch:
                raise KeyError(
                    f"missing feature {key!r}; features given: {', '.join(sorted(batch))}"
                )
        features = dict(batch)
        features["uih.sequence"] = self.item_embeddings(batch["uih.item_id"])
        cand = self.item_embeddings(batch["candidate.item_id"])
        features["candidate.sequence"] = cand
        user = self.transducer(features, max_uih_len, max_targets).candidate_embeddings
        item = self.item_tower(cand.to(user.dtype))
        return self.task_head(user * item)

    def loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Weighted sum over tasks of the mean binary cross-entropy.

        Args:
            logits (torch.Tensor): [L_t, K] from ``forward``.
            labels (torch.Tensor): [L_t] integer label bitmasks.

        Returns:
            torch.Tensor: scalar.
        """
        if labels.shape != logits.shape[:1]:
            raise ValueError(
                f"labels must be [L_t] = [{logits.shape[0]}] bitmasks, got {tuple(labels.shape)}"
            )
        targets = torch.bitwise_and(labels.to(torch.int64).unsqueeze(1), self._task_bits) > 0
        per_task = F.binary_cross_entropy_with_logits(
            logits.float(), targets.float(), reduction="none"
        ).mean(dim=0)
        return (per_task * self._task_weights).sum()
