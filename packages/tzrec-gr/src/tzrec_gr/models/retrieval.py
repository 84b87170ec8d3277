"""HSTU retrieval: next-item prediction over user histories with a sampled softmax.

Legend: B = batch, L = total history tokens, E = embedding width, N = negatives,
T = candidates per user.
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Sequence, Union

import torch
from torch import nn

from tzrec_gr._backend import BackendArg
from tzrec_gr.embeddings import TableFactory, embedding_table
from tzrec_gr.features import (
    UIH_LENGTHS,
    UIH_SEQUENCE,
    UIH_TIMESTAMPS,
)
from tzrec_gr.hstu_transducer import HSTUTransducer
from tzrec_gr.item_attributes import item_attribute_table
from tzrec_gr.losses import full_softmax_loss, sampled_softmax_loss
from tzrec_gr.models.inputs import (
    check_bound,
    check_int_tensor,
    check_item_ids,
    check_lengths,
    check_rows,
)
from tzrec_gr.models.registry import ModelRecord, register_model
from tzrec_gr.positional_encoder import HSTUPositionalEncoder
from tzrec_gr.postprocessors import L2NormPostprocessor
from tzrec_gr.preprocessors import UIHPreprocessor
from tzrec_gr.stu import STULayer, STUStack
from tzrec_ops.jagged import mirror, offsets_from_lengths

__all__ = ["HSTURetrieval", "next_item_loss"]


class HSTURetrieval(nn.Module):
    """Causal HSTU over item-id histories; token p is trained to predict item p + 1.

    The loss is a sampled softmax (HSTU paper, retrieval): for each position with a next
    item, logits are ``cos(user_p, item_next) / temperature`` against N shared negatives
    drawn uniformly from the catalogue (a negative equal to the positive is masked out).
    User and item embeddings are L2-normalized. Positions count forward from each history's
    start; timestamps are carried but not encoded.

    Args:
        num_items (int): catalogue size; ids are in ``[0, num_items)``.
        embedding_dim (int): E (item table and STU width).
        num_heads (int): H. Default: 2.
        attention_dim (int): A per head. Default: E // H.
        hidden_dim (int): V per head. Default: E // H.
        num_layers (int): STU layers. Default: 2.
        num_position_buckets (int): position table rows. Default: 512.
        num_negatives (int): N. Default: 128.
        temperature (float): softmax temperature. Default: 0.05.
        dropout_ratio (float): input and STU output dropout. Default: 0.2.
        backend (str | Backend | None): ops backend. Default: None.
        device (torch.device | None): parameter device. Default: None.
        max_seq_len (int): the longest history the model takes (keyword only). Attention
            divides by it, so a user's embeddings depend neither on a call's
            ``max_seq_len`` nor on the other users of the batch, and serving gives what
            ``forward`` gives. Default: 512.
        validate_inputs (bool): also check item ids that are on a GPU (one device read per
            call; ids on the CPU are always checked). Keyword only. Default: False.
        input_projection (bool): map the item embeddings through the preprocessor's
            ``Linear(E -> E)`` before the positional encoder. False feeds the item table's
            rows to it unchanged, so a history token enters the stack as the very vector
            its item is scored with (input and output embeddings tied, as in SASRec) and
            the residual path carries the last item to the user embedding, which helps
            most on short histories. Keyword only. Default: True.
        embedding_tables (str | TableFactory): the item table's implementation
            (:func:`tzrec_gr.embeddings.embedding_table`): ``"plain"``, an ``nn.Embedding``;
            ``"torchrec"``, a torchrec ``EmbeddingCollection`` that
            ``DistributedModelParallel`` can shard (needs ``tzrec-gr[torchrec]``); or a
            factory that builds the table. The same weights give the same outputs. Keyword
            only. Default: ``"plain"``.
        num_attributes (int): rows of an item-attribute table (categories, brands, ...);
            each item's row is its id row plus the mean of its attributes' rows
            (:class:`tzrec_gr.item_attributes.ItemAttributeEmbedding`, the child
            ``item_attributes``, whose ``set_links`` gives each item its attributes).
            0: no attributes. Keyword only. Default: 0.
        num_attribute_links (int): the (item, attribute) pairs that table links (> 0 with
            ``num_attributes``). Keyword only. Default: 0.

    Call Args:
        item_ids (torch.Tensor): [L] integer history item ids.
        lengths (torch.Tensor): [B] integer history lengths, in ``[0, max_seq_len]``.
        timestamps (torch.Tensor): [L] integer timestamps.
        max_seq_len (int | None): an upper bound on ``lengths`` for this call, at most the
            constructor's. Default: the constructor's.

    Returns:
        torch.Tensor: [L, E] L2-normalized user embedding after each history token.

    Input errors are ``ValueError`` naming the argument: a float or non-1-D tensor, a
    negative length or one above ``max_seq_len``, lengths that do not sum to
    ``item_ids.shape[0]``, an item id outside ``[0, num_items)`` (see ``validate_inputs``),
    a call bound above the constructor's. Every input is an integer, so no NaN can enter.

    Serving lives above the model, in :class:`tzrec_gr.serving.RetrievalServer`
    (``prefill``, ``extend``, ``score`` and their pure steps), built on the model's public
    pieces: :meth:`check_history` (the input check of ``forward``), :meth:`embed_features`,
    ``transducer``, :meth:`last_rows` and :meth:`item_embedding`.
    """

    def __init__(
        self,
        num_items: int,
        embedding_dim: int,
        num_heads: int = 2,
        attention_dim: Optional[int] = None,
        hidden_dim: Optional[int] = None,
        num_layers: int = 2,
        num_position_buckets: int = 512,
        num_negatives: int = 128,
        temperature: float = 0.05,
        dropout_ratio: float = 0.2,
        backend: BackendArg = None,
        device: Optional[torch.device] = None,
        *,
        max_seq_len: int = 512,
        validate_inputs: bool = False,
        input_projection: bool = True,
        embedding_tables: Union[str, TableFactory] = "plain",
        num_attributes: int = 0,
        num_attribute_links: int = 0,
    ) -> None:
        super().__init__()
        if num_items <= 1:
            raise ValueError(f"num_items must be > 1, got {num_items}")
        if num_negatives <= 0:
            raise ValueError(f"num_negatives must be > 0, got {num_negatives}")
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        if num_layers <= 0:
            raise ValueError(f"num_layers must be > 0, got {num_layers}")
        if isinstance(max_seq_len, bool) or not isinstance(max_seq_len, int) or max_seq_len <= 0:
            raise ValueError(f"max_seq_len must be an int > 0, got {max_seq_len!r}")
        self.num_items = num_items
        self.embedding_dim = embedding_dim
        self.num_negatives = num_negatives
        self.temperature = temperature
        self.max_seq_len = max_seq_len
        # the most tokens a user's cache holds (one per event)
        self.max_cached_len = max_seq_len
        self.validate_inputs = validate_inputs
        self.input_projection = input_projection
        self.item_embeddings = embedding_table(
            embedding_tables, num_items, embedding_dim, name="item", device=device
        )
        nn.init.normal_(self.item_embeddings.weight, std=0.02)
        self.item_attributes = item_attribute_table(
            num_items, num_attributes, num_attribute_links, embedding_dim, device
        )
        layers = [
            STULayer(
                embedding_dim,
                num_heads,
                hidden_dim or embedding_dim // num_heads,
                attention_dim or embedding_dim // num_heads,
                output_dropout_ratio=dropout_ratio,
                target_aware=False,
                backend=backend,
                device=device,
            )
            for _ in range(num_layers)
        ]
        preprocessor = UIHPreprocessor(embedding_dim, embedding_dim, backend=backend, device=device)
        if not input_projection:
            # the preprocessor's only use of the rows is this map (no actions, no prefix)
            preprocessor.projection = nn.Identity()
        self.transducer = HSTUTransducer(
            preprocessor,
            STUStack(layers),
            positional_encoder=HSTUPositionalEncoder(
                embedding_dim, num_position_buckets, backend=backend, device=device
            ),
            output_postprocessor=L2NormPostprocessor(),
            input_dropout_ratio=dropout_ratio,
            return_full_embeddings=True,
            backend=backend,
            max_uih_len=max_seq_len,
        )

    def item_rows(self, item_ids: torch.Tensor) -> torch.Tensor:
        """[...] ids -> [..., E] the items' rows (id row plus attribute row), unnormalized:
        what a history token feeds the stack."""
        rows = self.item_embeddings(item_ids)
        if self.item_attributes is None:
            return rows
        return rows + self.item_attributes()[item_ids].to(rows.dtype)

    def item_embedding(self, item_ids: torch.Tensor) -> torch.Tensor:
        """[...] ids -> [..., E] L2-normalized item embeddings."""
        return _unit_rows(self.item_rows(item_ids))

    def catalogue_embedding(self) -> torch.Tensor:
        """[N, E] every item's L2-normalized embedding, row i for item i. A plain table is
        read whole (its gradient then needs no scatter); another is looked up."""
        table = self.item_embeddings
        if not isinstance(table, nn.Embedding):
            return self.item_embedding(torch.arange(self.num_items, device=table.weight.device))
        if self.item_attributes is None:
            return _unit_rows(table.weight)
        return _unit_rows(table.weight + self.item_attributes())

    def check_history(
        self,
        item_ids: torch.Tensor,
        lengths: torch.Tensor,
        timestamps: torch.Tensor,
        max_seq_len: int,
    ) -> None:
        """Check a history (or new events) with at most ``max_seq_len`` events per user, as
        ``forward`` does (errors name ``item_ids``, ``lengths``, ``timestamps``).

        Raises:
            TypeError: an argument is not a tensor. ValueError: a bad one (named).
        """
        check_int_tensor("item_ids", item_ids)
        check_int_tensor("timestamps", timestamps)
        check_rows("timestamps", timestamps, item_ids.shape[0], "item_ids")
        check_lengths("lengths", lengths, max_seq_len, "max_seq_len", item_ids.shape[0], "item_ids")
        check_item_ids("item_ids", item_ids, self.num_items, self.validate_inputs)

    def embed_features(
        self, item_ids: torch.Tensor, lengths: torch.Tensor, timestamps: torch.Tensor
    ) -> Dict[str, torch.Tensor]:
        """The transducer's features of a history (unchecked): ``uih.sequence`` [L, E]
        (the ids' embeddings), ``uih.sequence_length`` [B], ``uih_timestamp.sequence`` [L]."""
        return {
            UIH_SEQUENCE: self.item_rows(item_ids),
            UIH_LENGTHS: lengths,
            UIH_TIMESTAMPS: timestamps,
        }

    def forward(
        self,
        item_ids: torch.Tensor,
        lengths: torch.Tensor,
        timestamps: torch.Tensor,
        max_seq_len: Optional[int] = None,
    ) -> torch.Tensor:
        max_seq_len = check_bound("max_seq_len", max_seq_len, self.max_seq_len)
        self.check_history(item_ids, lengths, timestamps, max_seq_len)
        features = self.embed_features(item_ids, lengths, timestamps)
        out = self.transducer(features, max_seq_len)
        if out.full_embeddings is None:
            raise RuntimeError("the transducer must return full embeddings")
        return out.full_embeddings

    @staticmethod
    def last_rows(full: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """[B, E] each user's last row of the jagged rows ``full`` [sum_b lengths[b], E]
        (zeros for a user without rows): the user embedding after the newest event."""
        if full.shape[0] == 0:
            return full.new_zeros(lengths.shape[0], full.shape[1])
        last = (mirror(offsets_from_lengths, lengths)[1:] - 1).clamp(min=0)
        return full[last] * (lengths > 0).unsqueeze(1).to(full.dtype)

    def user_embedding(
        self,
        item_ids: torch.Tensor,
        lengths: torch.Tensor,
        timestamps: torch.Tensor,
        max_seq_len: Optional[int] = None,
    ) -> torch.Tensor:
        """[B, E] the embedding after each user's last token (zeros for empty histories)."""
        return self.last_rows(self.forward(item_ids, lengths, timestamps, max_seq_len), lengths)

    def loss(
        self,
        item_ids: torch.Tensor,
        lengths: torch.Tensor,
        timestamps: torch.Tensor,
        max_seq_len: Optional[int] = None,
        negatives: Optional[torch.Tensor] = None,
        loss_mask: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """Mean sampled-softmax loss over positions that have a next item
        (:func:`tzrec_gr.losses.sampled_softmax_loss`).

        Args:
            negatives (torch.Tensor | None): [N] negative ids; None draws N uniformly, or
                with N at least the catalogue takes every item (the full softmax, as
                :func:`tzrec_gr.losses.full_softmax_loss`).
            loss_mask (torch.Tensor | None): [L] bool, the tokens whose terms count (a
                padded batch's real ones); None: every token.

        Returns:
            torch.Tensor: scalar.
        """
        user = self.forward(item_ids, lengths, timestamps, max_seq_len)
        return next_item_loss(self, user, item_ids, lengths, negatives, loss_mask)


def next_item_loss(
    model: nn.Module,
    user: torch.Tensor,
    item_ids: torch.Tensor,
    lengths: torch.Tensor,
    negatives: Optional[torch.Tensor] = None,
    loss_mask: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """A retrieval model's loss of its user embeddings ``user`` [L, E] (one after each
    history token of ``item_ids`` [L], ``lengths`` [B]): the full softmax over
    ``model.catalogue_embedding()`` when no ``negatives`` are given and
    ``model.num_negatives`` is at least ``model.num_items``; else the sampled softmax
    against ``negatives`` (checked and named) or ``num_negatives`` uniform draws.

    ``model`` gives ``num_items``, ``num_negatives``, ``temperature``, ``item_embedding``,
    ``catalogue_embedding`` and optionally ``validate_inputs`` (HSTURetrieval's; SASRec's).
    """
    if negatives is None and model.num_negatives >= model.num_items:
        return full_softmax_loss(
            user, item_ids, lengths, model.catalogue_embedding(), model.temperature, loss_mask
        )
    if negatives is None:
        negatives = torch.randint(0, model.num_items, (model.num_negatives,),
                                  device=item_ids.device)
    else:
        check_int_tensor("negatives", negatives)
        check_item_ids("negatives", negatives, model.num_items,
                       getattr(model, "validate_inputs", False))
    return sampled_softmax_loss(
        user, item_ids, lengths, model.item_embedding, negatives, model.temperature, loss_mask
    )


def _trainer_kwargs(settings: Any, num_items: int, task_bits: Sequence[int]) -> Dict[str, Any]:
    return dict(
        num_items=num_items,
        embedding_dim=settings.embedding_dim,
        max_seq_len=settings.max_seq_len,  # attention scaling fixed to the trained bound
        num_heads=settings.num_heads,
        num_layers=settings.num_layers,
        num_negatives=settings.num_negatives,
        temperature=settings.temperature,
        dropout_ratio=settings.dropout,
        backend=settings.backend,
        # settings made before the option (a namespace without it) keep the projection
        input_projection=getattr(settings, "input_projection", True),
    )


register_model(
    ModelRecord(
        name="hstu-retrieval",
        model_class=HSTURetrieval,
        task="retrieval",
        shardable=True,
        graph_step=True,
        trainer_kwargs=_trainer_kwargs,
        description="causal HSTU over item histories, trained with a sampled softmax",
    )
)


def _unit_rows(rows: torch.Tensor) -> torch.Tensor:
    """``rows`` [..., E] scaled to unit L2 norm (a zero row stays zero)."""
    return rows / torch.linalg.vector_norm(rows, dim=-1, keepdim=True).clamp(min=1e-6)
