"""HSTU retrieval: next-item prediction over user histories with a sampled softmax.

Legend: B = batch, L = total history tokens, E = embedding width, N = negatives.
"""

from __future__ import annotations

from typing import Dict, Optional

import torch
from torch import nn

from tzrec_gr._backend import BackendArg
from tzrec_gr._jagged import lengths_to_offsets, row_positions
from tzrec_gr.hstu_transducer import HSTUTransducer
from tzrec_gr.positional_encoder import HSTUPositionalEncoder
from tzrec_gr.postprocessors import L2NormPostprocessor
from tzrec_gr.preprocessors import UIHPreprocessor
from tzrec_gr.stu import STULayer, STUStack

__all__ = ["HSTURetrieval"]


class HSTURetrieval(nn.Module):
    """Causal HSTU over item-id histories; token p is trained to predict item p + 1.

    The loss is a sampled softmax (HSTU paper, retrieval): for each position with a next
    item, logits are ``cos(user_p, item_next) / temperature`` against N shared negatives
    drawn uniformly from the catalogue (a negative equal to the positive is masked out).
    User and item embeddings are L2-normalized.

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

    Call Args:
        item_ids (torch.Tensor): [L] int64 history item ids.
        lengths (torch.Tensor): [B] history lengths.
        timestamps (torch.Tensor): [L] int64.
        max_seq_len (int): upper bound on ``lengths``.

    Returns:
        torch.Tensor: [L, E] L2-normalized user embedding after each history token.
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
        self.num_items = num_items
        self.embedding_dim = embedding_dim
        self.num_negatives = num_negatives
        self.temperature = temperature
        self.item_embeddings = nn.Embedding(num_items, embedding_dim, device=device)
        nn.init.normal_(self.item_embeddings.weight, std=0.02)
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
        self.transducer = HSTUTransducer(
            UIHPreprocessor(embedding_dim, embedding_dim, backend=backend, device=device),
            STUStack(layers),
            positional_encoder=HSTUPositionalEncoder(
                embedding_dim, num_position_buckets, backend=backend, device=device
            ),
            output_postprocessor=L2NormPostprocessor(),
            input_dropout_ratio=dropout_ratio,
            return_full_embeddings=True,
            backend=backend,
        )

    def item_embedding(self, item_ids: torch.Tensor) -> torch.Tensor:
        """[...] ids -> [..., E] L2-normalized item embeddings."""
        emb = self.item_embeddings(item_ids)
        return emb / torch.linalg.vector_norm(emb, dim=-1, keepdim=True).clamp(min=1e-6)

    def _features(self, item_ids, lengths, timestamps) -> Dict[str, torch.Tensor]:
        if item_ids.dim() != 1 or timestamps.shape != item_ids.shape:
            raise ValueError(
                f"item_ids and timestamps must both be [L]; got {tuple(item_ids.shape)} and "
                f"{tuple(timestamps.shape)}"
            )
        return {
            "uih.sequence": self.item_embeddings(item_ids),
            "uih.sequence_length": lengths,
            "uih_timestamp.sequence": timestamps,
        }

    def forward(
        self,
        item_ids: torch.Tensor,
        lengths: torch.Tensor,
        timestamps: torch.Tensor,
        max_seq_len: int,
    ) -> torch.Tensor:
        out = self.transducer(self._features(item_ids, lengths, timestamps), max_seq_len)
        if out.full_embeddings is None:
            raise RuntimeError("the transducer must return full embeddings")
        return out.full_embeddings

    def user_embedding(
        self,
        item_ids: torch.Tensor,
        lengths: torch.Tensor,
        timestamps: torch.Tensor,
        max_seq_len: int,
    ) -> torch.Tensor:
        """[B, E] the embedding after each user's last token (zeros for empty histories)."""
        full = self.forward(item_ids, lengths, timestamps, max_seq_len)
        offsets = lengths_to_offsets(lengths)
        last = (offsets[1:] - 1).clamp(min=0)
        if full.shape[0] == 0:
            return full.new_zeros(lengths.shape[0], self.embedding_dim)
        return full[last] * (lengths > 0).unsqueeze(1).to(full.dtype)

    def loss(
        self,
        item_ids: torch.Tensor,
        lengths: torch.Tensor,
        timestamps: torch.Tensor,
        max_seq_len: int,
        negatives: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """Mean sampled-softmax loss over positions that have a next item.

        Args:
            negatives (torch.Tensor | None): [N] negative ids; None draws N uniformly.

        Returns:
            torch.Tensor: scalar.
        """
        user = self.forward(item_ids, lengths, timestamps, max_seq_len)
        total = item_ids.shape[0]
        offsets = lengths_to_offsets(lengths)
        sample, pos = row_positions(offsets, total)
        has_next = pos < (lengths.to(torch.int64)[sample] - 1)
        next_ids = item_ids[
            (torch.arange(total, device=item_ids.device) + 1).clamp(max=max(total - 1, 0))
        ]
        if negatives is None:
            negatives = torch.randint(
                0, self.num_items, (self.num_negatives,), device=item_ids.device
            )
        pos_logit = (user * self.item_embedding(next_ids).to(user.dtype)).sum(-1) / self.temperature
        neg_logit = user @ self.item_embedding(negatives).to(user.dtype).t() / self.temperature
        neg_logit = neg_logit.masked_fill(
            negatives.unsqueeze(0) == next_ids.unsqueeze(1), float("-inf")
        )
        logits = torch.cat([pos_logit.unsqueeze(1), neg_logit], dim=1).float()
        per_row = torch.logsumexp(logits, dim=1) - logits[:, 0]
        weight = has_next.to(per_row.dtype)
        return (per_row * weight).sum() / weight.sum().clamp(min=1.0)
