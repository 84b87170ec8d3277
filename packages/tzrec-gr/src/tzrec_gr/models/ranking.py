"""HSTU ranking: a DlrmHSTU-style multi-task model over user (x) item embeddings.

Legend: B = batch, L_u / L_t = total history / candidate tokens, E = STU width,
K = number of tasks, C = contextual features.
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from tzrec_gr._backend import BackendArg
from tzrec_gr.action_encoder import SimpleActionEncoder
from tzrec_gr.content_encoder import SliceContentEncoder
from tzrec_gr.contextualize_mlps import SimpleContextualizedMLP
from tzrec_gr.embeddings import TableFactory, embedding_table
from tzrec_gr.features import (
    CANDIDATE_ITEM_ID,
    CANDIDATE_LENGTHS,
    CANDIDATE_SEQUENCE,
    CANDIDATE_TIMESTAMPS,
    CONTEXTUAL,
    QUERY_TIME,
    UIH_ACTIONS,
    UIH_ITEM_ID,
    UIH_LENGTHS,
    UIH_SEQUENCE,
    UIH_TIMESTAMPS,
)
from tzrec_gr.hstu_transducer import HSTUTransducer
from tzrec_gr.layers import MLP, LayerNorm, Linear, SwishLayerNorm
from tzrec_gr.losses import multitask_bce_loss
from tzrec_gr.models.inputs import (
    check_batch,
    check_bound,
    check_finite,
    check_int_tensor,
    check_item_ids,
    check_lengths,
    check_rows,
)
from tzrec_gr.models.registry import ModelRecord, register_model
from tzrec_gr.positional_encoder import HSTUPositionalEncoder
from tzrec_gr.postprocessors import TimestampLayerNormPostprocessor
from tzrec_gr.preprocessors import ContextualInterleavePreprocessor
from tzrec_gr.stu import STULayer, STUStack

Batch = Dict[str, torch.Tensor]

__all__ = ["HSTURanking"]


class HSTURanking(nn.Module):
    """Scores every candidate of a user on K tasks (e.g. click, like, long view).

    The history (items, actions, timestamps) and the candidates go through an
    :class:`HSTUTransducer` (contextual preprocessor with a slice content encoder and a
    simple action encoder, positional encoder, target-aware STU stack, timestamp layer-norm
    postprocessor). Each candidate's user embedding is multiplied elementwise with its
    item-tower embedding and a multi-task head gives K logits.

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
        max_uih_len (int): the longest history the model takes (keyword only).
            Default: 1024.
        max_targets (int): the most candidates per user (keyword only). Attention divides
            by ``C + max_uih_len + max_targets`` (twice the events with interleaving), so a
            user's logits depend neither on a call's bounds nor on the other users of the
            batch, and serving gives what ``forward`` gives. Default: 128.
        use_time_encoding (bool): time-aware positions (counted back from the newest event)
            plus time-gap buckets; False: positions counted forward, no time buckets, which
            appending events to a serving cache needs (``RankingServer.extend``). Keyword
            only. Default: True.
        validate_inputs (bool): also check item ids that are on a GPU (one device read per
            call; ids on the CPU are always checked) and that ``contextual`` holds no NaN or
            inf. Keyword only. Default: False.
        embedding_tables (str | TableFactory): the item table's implementation
            (:func:`tzrec_gr.embeddings.embedding_table`): ``"plain"``, an ``nn.Embedding``;
            ``"torchrec"``, a torchrec ``EmbeddingCollection`` that
            ``DistributedModelParallel`` can shard (needs ``tzrec-gr[torchrec]``); or a
            factory that builds the table. The same weights give the same outputs. Keyword
            only. Default: ``"plain"``.
        linear_terms (bool): add to each candidate's K logits a linear map of its user
            embedding and of its item embedding, beside the head's MLP of their product
            (the first-order terms of a factorisation machine): an item's own action rates
            and a user's own action rates then need no interaction to be learned. Keyword
            only. Default: False.

    Call Args:
        batch (Dict[str, torch.Tensor]): ``uih.item_id`` [L_u], ``uih.sequence_length`` [B],
            ``uih_action.sequence`` [L_u], ``uih_timestamp.sequence`` [L_u],
            ``candidate.item_id`` [L_t], ``candidate.sequence_length`` [B],
            ``candidate_timestamp.sequence`` [L_t] (all integer), with C > 0 ``contextual``
            [B, C * Fc] float, and optionally ``query_time`` [B] integer: the anchor of the
            time gaps (default: each user's last candidate timestamp, or last history one
            when the user has no candidates).
        max_uih_len (int | None): an upper bound on history lengths for this call, at most
            the constructor's. Default: the constructor's.
        max_targets (int | None): the same for candidates per user. Default: the
            constructor's.

    Returns:
        torch.Tensor: [L_t, K] logits, candidates in input order.

    Input errors are ``KeyError`` for a missing feature and ``ValueError`` naming the
    feature otherwise: a float or wrongly shaped id, length, action or timestamp tensor,
    a negative length or one above its bound, lengths that do not sum to their rows,
    candidates for another number of users than the history, an item id outside
    ``[0, num_items)`` (see ``validate_inputs``), a call bound above the constructor's.
    A NaN in ``contextual`` makes that user's logits NaN (users never mix) unless
    ``validate_inputs`` rejects it.

    Serving lives above the model, in :class:`tzrec_gr.serving.RankingServer` (``prefill``,
    ``score``, ``extend`` and their pure steps), built on the model's public pieces:
    :meth:`check_history`, :meth:`check_candidates` and :meth:`check_query_time` (the input
    checks of ``forward``), :meth:`embed_features` (item ids to embeddings), ``transducer``
    and :meth:`head` (candidate logits).
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
        *,
        max_uih_len: int = 1024,
        max_targets: int = 128,
        use_time_encoding: bool = True,
        validate_inputs: bool = False,
        embedding_tables: Union[str, TableFactory] = "plain",
        linear_terms: bool = False,
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
        for name, value, low in (("max_uih_len", max_uih_len, 0), ("max_targets", max_targets, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
        e, du = embedding_dim, item_embedding_dim
        kw = {"backend": backend, "device": device}
        self.num_items = num_items
        self.num_tasks = len(task_bitmasks)
        self.max_uih_len = max_uih_len
        self.max_targets = max_targets
        self.use_time_encoding = use_time_encoding
        self.validate_inputs = validate_inputs
        self.register_buffer(
            "_task_bits", torch.tensor(list(task_bitmasks), dtype=torch.int64, device=device)
        )
        self.register_buffer(
            "_task_weights", torch.tensor(weights, dtype=torch.float32, device=device)
        )
        self.item_embeddings = embedding_table(
            embedding_tables, num_items, du, name="item", device=device
        )
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
            contextual_group_name=CONTEXTUAL,
            enable_interleaving=enable_interleaving,
            **kw,
        )
        c = preprocessor.contextual_seq_len()
        self.contextual_seq_len = c
        # the most tokens a user's cache holds: C prefix plus the (interleaved) history
        self.max_cached_len = preprocessor.max_output_len(max_uih_len, 0)
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
                num_time_buckets if use_time_encoding else 0,
                use_time_encoding=use_time_encoding,
                contextual_seq_len=c,
                **kw,
            ),
            output_postprocessor=TimestampLayerNormPostprocessor(e, [3600, 86400], [24, 7], **kw),
            input_dropout_ratio=dropout_ratio,
            backend=backend,
            max_uih_len=max_uih_len,
            max_targets=max_targets,
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
        self.linear_terms = bool(linear_terms)
        #: [user embedding, item embedding] -> K logits added to the head's (linear_terms)
        self.first_order: Optional[Linear] = (
            Linear(e + du, self.num_tasks, **kw) if linear_terms else None
        )

    # -- input checks ----------------------------------------------------------------------

    @staticmethod
    def _get(arg: str, batch: Batch, key: str) -> torch.Tensor:
        if key not in batch:
            raise KeyError(f"{arg} is missing {key!r}; it has: {', '.join(sorted(batch))}")
        return batch[key]

    def check_history(self, arg: str, batch: Batch, max_uih_len: int, contextual: bool) -> int:
        """Check the history features of ``batch`` as ``forward`` does.

        Args:
            arg (str): the argument's name in error messages (``"batch"``, ``"history"``).
            batch (Dict[str, torch.Tensor]): holds the ``uih.*`` features.
            max_uih_len (int): the most events per user.
            contextual (bool): also check ``contextual`` (when the model has C > 0).

        Returns:
            int: B, the number of users.

        Raises:
            KeyError: a missing feature. ValueError: a bad one (named).
        """
        ids = self._get(arg, batch, UIH_ITEM_ID)
        lengths = self._get(arg, batch, UIH_LENGTHS)
        ids_name = f"{arg}[{UIH_ITEM_ID!r}]"
        check_int_tensor(ids_name, ids)
        for key in (UIH_ACTIONS, UIH_TIMESTAMPS):
            check_int_tensor(f"{arg}[{key!r}]", self._get(arg, batch, key))
            check_rows(f"{arg}[{key!r}]", batch[key], ids.shape[0], ids_name)
        check_lengths(
            f"{arg}[{UIH_LENGTHS!r}]",
            lengths,
            max_uih_len,
            "max_uih_len",
            ids.shape[0],
            ids_name,
        )
        check_item_ids(ids_name, ids, self.num_items, self.validate_inputs)
        if contextual and self.contextual_seq_len > 0:
            ctx = self._get(arg, batch, CONTEXTUAL)
            if not isinstance(ctx, torch.Tensor) or not ctx.is_floating_point():
                raise ValueError(
                    f"{arg}[{CONTEXTUAL!r}] must be a float tensor, got "
                    f"{getattr(ctx, 'dtype', type(ctx).__name__)}"
                )
            check_batch(f"{arg}[{CONTEXTUAL!r}]", ctx, lengths.shape[0], UIH_LENGTHS)
            check_finite(f"{arg}[{CONTEXTUAL!r}]", ctx, self.validate_inputs)
        return lengths.shape[0]

    def check_candidates(self, arg: str, batch: Batch, max_targets: int, users: int) -> None:
        """Check the ``candidate.*`` features of ``batch`` (the argument ``arg``) for
        ``users`` users, at most ``max_targets`` each, as ``forward`` does.

        Raises:
            KeyError: a missing feature. ValueError: a bad one (named).
        """
        ids = self._get(arg, batch, CANDIDATE_ITEM_ID)
        lengths = self._get(arg, batch, CANDIDATE_LENGTHS)
        ts = self._get(arg, batch, CANDIDATE_TIMESTAMPS)
        ids_name = f"{arg}[{CANDIDATE_ITEM_ID!r}]"
        lengths_name = f"{arg}[{CANDIDATE_LENGTHS!r}]"
        check_int_tensor(ids_name, ids)
        check_int_tensor(f"{arg}[{CANDIDATE_TIMESTAMPS!r}]", ts)
        check_rows(f"{arg}[{CANDIDATE_TIMESTAMPS!r}]", ts, ids.shape[0], ids_name)
        check_int_tensor(lengths_name, lengths)
        check_batch(lengths_name, lengths, users, "the history")
        check_lengths(lengths_name, lengths, max_targets, "max_targets", ids.shape[0], ids_name)
        check_item_ids(ids_name, ids, self.num_items, self.validate_inputs)

    @staticmethod
    def check_query_time(name: str, query_time: Optional[torch.Tensor], users: int) -> None:
        """``query_time`` (the argument ``name``) is None or a [B = ``users``] integer
        tensor.

        Raises:
            TypeError: not a tensor. ValueError: a wrong dtype, rank or size.
        """
        if query_time is None:
            return
        check_int_tensor(name, query_time)
        check_batch(name, query_time, users, "the history")

    # -- model -----------------------------------------------------------------------------

    def embed_features(self, batch: Batch) -> Tuple[Batch, torch.Tensor]:
        """The transducer's features and the candidates' item embeddings.

        Args:
            batch (Dict[str, torch.Tensor]): features as ``forward`` takes them (unchecked).

        Returns:
            (``batch`` plus ``uih.sequence`` [L_u, Du] and ``candidate.sequence`` [L_t, Du],
            the item embeddings of the ids; the candidates' embeddings [L_t, Du]).
        """
        features = dict(batch)
        features[UIH_SEQUENCE] = self.item_embeddings(batch[UIH_ITEM_ID])
        cand = self.item_embeddings(batch[CANDIDATE_ITEM_ID])
        features[CANDIDATE_SEQUENCE] = cand
        return features, cand

    def head(self, user: torch.Tensor, cand: torch.Tensor) -> torch.Tensor:
        """[L_t, K] logits from the candidates' user embeddings [L_t, E] (the transducer's
        ``candidate_embeddings``) and item embeddings [L_t, Du]."""
        cand = cand.to(user.dtype)
        logits = self.task_head(user * self.item_tower(cand))
        if self.first_order is not None:
            logits = logits + self.first_order(torch.cat([user, cand], dim=-1))
        return logits

    def forward(
        self,
        batch: Batch,
        max_uih_len: Optional[int] = None,
        max_targets: Optional[int] = None,
    ) -> torch.Tensor:
        max_uih_len = check_bound("max_uih_len", max_uih_len, self.max_uih_len)
        max_targets = check_bound("max_targets", max_targets, self.max_targets)
        users = self.check_history("batch", batch, max_uih_len, contextual=True)
        self.check_candidates("batch", batch, max_targets, users)
        query_time = batch.get(QUERY_TIME)
        self.check_query_time(f"batch[{QUERY_TIME!r}]", query_time, users)
        features, cand = self.embed_features(batch)
        out = self.transducer(features, max_uih_len, max_targets, query_time=query_time)
        return self.head(out.candidate_embeddings, cand)

    def loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Weighted sum over tasks of the mean binary cross-entropy
        (:func:`tzrec_gr.losses.multitask_bce_loss`).

        Args:
            logits (torch.Tensor): [L_t, K] from ``forward``.
            labels (torch.Tensor): [L_t] integer label bitmasks.

        Returns:
            torch.Tensor: scalar.
        """
        return multitask_bce_loss(logits, labels, self._task_bits, self._task_weights)


#: the bits of the history action mask the trainer embeds: all 8 (tzrec-bench's ``Action``)
_TRAINED_ACTION_BITS = [1 << bit for bit in range(8)]


def _trainer_kwargs(settings: Any, num_items: int, task_bits: Sequence[int]) -> Dict[str, Any]:
    return dict(
        num_items=num_items,
        item_embedding_dim=settings.embedding_dim,
        embedding_dim=settings.embedding_dim,
        task_bitmasks=list(task_bits),
        action_weights=list(_TRAINED_ACTION_BITS),
        max_uih_len=settings.max_seq_len,
        max_targets=settings.num_candidates,
        num_heads=settings.num_heads,
        num_layers=settings.num_layers,
        dropout_ratio=settings.dropout,
        backend=settings.backend,
        linear_terms=getattr(settings, "linear_terms", False),
    )


register_model(
    ModelRecord(
        name="hstu-ranking",
        model_class=HSTURanking,
        task="ranking",
        shardable=True,
        trainer_kwargs=_trainer_kwargs,
        description="HSTU over histories and candidates with a multi-task head",
    )
)
