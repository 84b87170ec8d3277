"""``one-layer-hstu``: a one-layer HSTU encoder with a learned projection as its user head.

Legend: B = users, L = total history tokens, E = embedding width, N = negatives.

The whole model is this module: the class, built from tzrec-gr's public parts (an item
table, an :class:`~tzrec_gr.HSTUTransducer` of one STU layer, the sampled-softmax loss), and
its :class:`~tzrec_gr.models.registry.ModelRecord` at the bottom, which tzrec-gr imports
through the ``tzrec_gr.models`` entry point of this distribution. The record says how a
trainer's settings build the model (``tzrec-bench train --model one-layer-hstu``) and which
server serves it (:mod:`tzrec_gr_model_example.serving`).
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Sequence

import torch
from torch import nn

from tzrec_gr import (
    HSTUPositionalEncoder,
    HSTUTransducer,
    STULayer,
    STUStack,
    UIHPreprocessor,
)
from tzrec_gr.features import UIH_LENGTHS, UIH_SEQUENCE, UIH_TIMESTAMPS
from tzrec_gr.losses import sampled_softmax_loss
from tzrec_gr.models.inputs import (
    check_int_tensor,
    check_item_ids,
    check_lengths,
    check_rows,
)
from tzrec_gr.models.registry import ModelRecord, register_model
from tzrec_gr.postprocessors import OutputPostprocessor
from tzrec_ops.jagged import mirror, offsets_from_lengths

__all__ = ["MODEL_NAME", "OneLayerHSTU", "ProjectionHead"]

MODEL_NAME = "one-layer-hstu"


def _normalized(x: torch.Tensor) -> torch.Tensor:
    return x / torch.linalg.vector_norm(x, dim=-1, keepdim=True).clamp(min=1e-6)


class ProjectionHead(OutputPostprocessor):
    """The user head: a learned linear map of each output row, then L2 normalization
    (timestamps are ignored). Row-wise, so a row depends only on its own token's output
    and serving's cached rows stay exact."""

    def __init__(self, embedding_dim: int, device: Optional[torch.device] = None) -> None:
        super().__init__()
        self.proj = nn.Linear(embedding_dim, embedding_dim, bias=False, device=device)
        nn.init.eye_(self.proj.weight)  # starts as the plain L2-normalized output

    def forward(self, seq_embeddings: torch.Tensor, seq_timestamps: Any = None) -> torch.Tensor:
        return _normalized(self.proj(seq_embeddings))


class OneLayerHSTU(nn.Module):
    """Next-item retrieval: one causal STU layer over the history's item embeddings, a
    learned projection as the user head, cosine scores against L2-normalized items, trained
    with a sampled softmax over ``num_negatives`` uniform negatives.

    Args:
        num_items (int): catalogue size; ids are in ``[0, num_items)``.
        embedding_dim (int): E.
        num_heads (int): attention heads. Default: 2.
        num_negatives (int): N. Default: 64.
        temperature (float): softmax temperature. Default: 0.05.
        dropout_ratio (float): input and layer output dropout. Default: 0.0.
        backend (str | None): tzrec-ops backend. Default: None (automatic).
        device (torch.device | None): parameter device. Default: None.
        max_seq_len (int): the longest history (keyword only); attention divides by it, so
            a user's embedding does not depend on the batch. Default: 64.
        validate_inputs (bool): also check item ids on a GPU (keyword only). Default: False.

    Call Args:
        item_ids, lengths, timestamps (torch.Tensor): [L], [B], [L] integer histories.
        max_seq_len (int | None): a bound on ``lengths`` for this call, at most the
            constructor's. Default: the constructor's.

    Returns:
        torch.Tensor: [L, E] the L2-normalized user embedding after each history token.
    """

    def __init__(
        self,
        num_items: int,
        embedding_dim: int,
        num_heads: int = 2,
        num_negatives: int = 64,
        temperature: float = 0.05,
        dropout_ratio: float = 0.0,
        backend: Optional[str] = None,
        device: Optional[torch.device] = None,
        *,
        max_seq_len: int = 64,
        validate_inputs: bool = False,
    ) -> None:
        super().__init__()
        if num_items <= 1:
            raise ValueError(f"num_items must be > 1, got {num_items}")
        if num_negatives <= 0:
            raise ValueError(f"num_negatives must be > 0, got {num_negatives}")
        self.num_items = num_items
        self.embedding_dim = embedding_dim
        self.num_negatives = num_negatives
        self.temperature = temperature
        self.max_seq_len = max_seq_len
        self.max_cached_len = max_seq_len  # what serving caches per user: one token an event
        self.validate_inputs = validate_inputs
        self.item_embeddings = nn.Embedding(num_items, embedding_dim, device=device)
        nn.init.normal_(self.item_embeddings.weight, std=0.02)
        head_dim = embedding_dim // num_heads
        layer = STULayer(embedding_dim, num_heads, head_dim, head_dim,
                         output_dropout_ratio=dropout_ratio, target_aware=False,
                         backend=backend, device=device)
        self.transducer = HSTUTransducer(
            UIHPreprocessor(embedding_dim, embedding_dim, backend=backend, device=device),
            STUStack([layer]),
            positional_encoder=HSTUPositionalEncoder(embedding_dim, max_seq_len,
                                                     backend=backend, device=device),
            output_postprocessor=ProjectionHead(embedding_dim, device=device),
            input_dropout_ratio=dropout_ratio,
            return_full_embeddings=True,
            backend=backend,
            max_uih_len=max_seq_len,
        )

    # -- what the trainer and the retrieval server call --------------------------------------

    def item_embedding(self, item_ids: torch.Tensor) -> torch.Tensor:
        """[...] ids -> [..., E] L2-normalized item embeddings."""
        return _normalized(self.item_embeddings(item_ids))

    def check_history(self, item_ids: torch.Tensor, lengths: torch.Tensor,
                      timestamps: torch.Tensor, max_seq_len: int) -> None:
        """Check a history with at most ``max_seq_len`` events per user, with tzrec-gr's
        own input checks (errors name the argument)."""
        check_int_tensor("item_ids", item_ids)
        check_int_tensor("timestamps", timestamps)
        check_rows("timestamps", timestamps, item_ids.shape[0], "item_ids")
        check_lengths("lengths", lengths, max_seq_len, "max_seq_len", item_ids.shape[0], "item_ids")
        check_item_ids("item_ids", item_ids, self.num_items, self.validate_inputs)

    def embed_features(self, item_ids: torch.Tensor, lengths: torch.Tensor,
                       timestamps: torch.Tensor) -> Dict[str, torch.Tensor]:
        """The transducer's features of a history (unchecked)."""
        return {UIH_SEQUENCE: self.item_embeddings(item_ids), UIH_LENGTHS: lengths,
                UIH_TIMESTAMPS: timestamps}

    def forward(self, item_ids: torch.Tensor, lengths: torch.Tensor,
                timestamps: torch.Tensor, max_seq_len: Optional[int] = None) -> torch.Tensor:
        bound = self.max_seq_len if max_seq_len is None else max_seq_len
        if bound > self.max_seq_len:
            raise ValueError(f"max_seq_len must be <= the model's {self.max_seq_len}, got "
                             f"{bound}")
        self.check_history(item_ids, lengths, timestamps, bound)
        out = self.transducer(self.embed_features(item_ids, lengths, timestamps), bound)
        return out.full_embeddings

    @staticmethod
    def last_rows(full: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """[B, E] each user's last row of ``full`` [L, E] (zeros for an empty history)."""
        if full.shape[0] == 0:
            return full.new_zeros(lengths.shape[0], full.shape[1])
        last = (mirror(offsets_from_lengths, lengths)[1:] - 1).clamp(min=0)
        return full[last] * (lengths > 0).unsqueeze(1).to(full.dtype)

    def user_embedding(self, item_ids: torch.Tensor, lengths: torch.Tensor,
                       timestamps: torch.Tensor, max_seq_len: Optional[int] = None
                       ) -> torch.Tensor:
        """[B, E] the embedding after each user's newest event."""
        return self.last_rows(self.forward(item_ids, lengths, timestamps, max_seq_len), lengths)

    def loss(self, item_ids: torch.Tensor, lengths: torch.Tensor, timestamps: torch.Tensor,
             max_seq_len: Optional[int] = None, negatives: Optional[torch.Tensor] = None
             ) -> torch.Tensor:
        """Mean sampled-softmax loss of each position against its next item."""
        user = self.forward(item_ids, lengths, timestamps, max_seq_len)
        if negatives is None:
            negatives = torch.randint(0, self.num_items, (self.num_negatives,),
                                      device=item_ids.device)
        return sampled_softmax_loss(user, item_ids, lengths, self.item_embedding, negatives,
                                    self.temperature)


# -- the registration ---------------------------------------------------------------------


def trainer_kwargs(settings: Any, num_items: int, task_bits: Sequence[int]) -> Dict[str, Any]:
    """The constructor arguments from a trainer's settings (one layer whatever
    ``num_layers`` says; ``task_bits`` are a ranking model's, unused)."""
    return dict(num_items=num_items, embedding_dim=settings.embedding_dim,
                max_seq_len=settings.max_seq_len, num_heads=settings.num_heads,
                num_negatives=settings.num_negatives, temperature=settings.temperature,
                dropout_ratio=settings.dropout, backend=settings.backend)


def server(model: nn.Module) -> Any:
    """The model's serving server. Imported here, not at the top: this module is imported
    while tzrec-gr looks its plugins up, which serving's own import may start."""
    from tzrec_gr_model_example.serving import OneLayerHSTUServer

    return OneLayerHSTUServer(model)


register_model(ModelRecord(
    name=MODEL_NAME,
    model_class=OneLayerHSTU,
    task="retrieval",
    trainer_kwargs=trainer_kwargs,
    description="one HSTU layer with a learned projection head (example plugin)",
    server=server,
))
