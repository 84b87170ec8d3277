"""SASRec (Kang & McAuley, 2018) with HSTURetrieval's interface and sampled-softmax loss.

Legend: B = batch, L = total history tokens of a jagged batch, N = ``max_seq_len`` (padded
length), E = embedding width.

The quality protocol compares HSTU with SASRec's architecture trained on the same sampled
softmax (not SASRec's original binary cross-entropy), so the loss is
:func:`tzrec_gr.losses.sampled_softmax_loss`.
"""

from __future__ import annotations

import math
from typing import Any, Dict, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from tzrec_gr.item_attributes import item_attribute_table
from tzrec_gr.models.registry import ModelRecord, register_model
from tzrec_gr.models.retrieval import next_item_loss
from tzrec_ops.jagged import mirror, offsets_from_lengths, row_positions

__all__ = ["SASRec"]


class CausalSelfAttention(nn.Module):
    """Multi-head softmax self-attention where token n sees tokens 0..n of its row.

    Call Args:
        x (torch.Tensor): [B, N, E].

    Returns:
        torch.Tensor: [B, N, E].
    """

    def __init__(
        self, embedding_dim: int, num_heads: int, dropout_ratio: float, device=None
    ) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.dropout_ratio = dropout_ratio
        self.qkv = nn.Linear(embedding_dim, 3 * embedding_dim, device=device)
        self.out = nn.Linear(embedding_dim, embedding_dim, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        # [B, N, 3E] -> three [B, H, N, E / H]
        q, k, v = (
            self.qkv(x).view(batch, length, 3, self.num_heads, -1).permute(2, 0, 3, 1, 4).unbind(0)
        )
        attn = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout_ratio if self.training else 0.0, is_causal=True
        )
        return self.out(attn.transpose(1, 2).reshape(batch, length, width))


class SASRecBlock(nn.Module):
    """Pre-LN Transformer block: x + attn(LN(x)), then x + FFN(LN(x)).

    The point-wise FFN keeps SASRec's width (E -> E -> E, ReLU).

    Call Args:
        x (torch.Tensor): [B, N, E].

    Returns:
        torch.Tensor: [B, N, E].
    """

    def __init__(
        self, embedding_dim: int, num_heads: int, dropout_ratio: float, device=None
    ) -> None:
        super().__init__()
        self.attention_norm = nn.LayerNorm(embedding_dim, device=device)
        self.attention = CausalSelfAttention(embedding_dim, num_heads, dropout_ratio, device)
        self.ffn_norm = nn.LayerNorm(embedding_dim, device=device)
        self.ffn = nn.Sequential(
            nn.Linear(embedding_dim, embedding_dim, device=device),
            nn.ReLU(),
            nn.Dropout(dropout_ratio),
            nn.Linear(embedding_dim, embedding_dim, device=device),
        )
        self.dropout = nn.Dropout(dropout_ratio)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.dropout(self.attention(self.attention_norm(x)))
        return x + self.dropout(self.ffn(self.ffn_norm(x)))


class SASRec(nn.Module):
    """Causal softmax self-attention over item-id histories; token p predicts item p + 1.

    Item embeddings (shared by input and output, as in SASRec) scaled by sqrt(E), plus
    learned absolute position embeddings, go through pre-LN Transformer blocks and a final
    LayerNorm; outputs are L2-normalized. Attention runs on a right-padded [B, N, E] batch:
    with a causal mask, real tokens never see the padding after them, so no padding mask is
    needed and a user's outputs do not depend on the rest of the batch.

    Interface and loss match ``tzrec_gr.models.HSTURetrieval``; ``timestamps`` is accepted
    for that reason and unused (SASRec has no time signal).

    Args:
        num_items (int): catalogue size; ids are in ``[0, num_items)``.
        embedding_dim (int): E; must be divisible by ``num_heads``.
        max_seq_len (int): position table size; the largest ``max_seq_len`` a call may pass.
        num_heads (int): attention heads. Default: 1.
        num_layers (int): Transformer blocks. Default: 2.
        dropout_ratio (float): embedding, attention, FFN and residual dropout. Default: 0.2.
        num_negatives (int): N shared negatives of the loss. Default: 128.
        temperature (float): softmax temperature of the loss. Default: 0.05.
        device (torch.device | None): parameter device. Default: None.
        num_attributes (int): rows of an item-attribute table, added to the item rows as in
            ``HSTURetrieval`` (the child ``item_attributes``); 0: none. Default: 0.
        num_attribute_links (int): the (item, attribute) pairs it links. Default: 0.

    Call Args:
        item_ids (torch.Tensor): [L] int64 history item ids.
        lengths (torch.Tensor): [B] history lengths, each at most ``max_seq_len``.
        timestamps (torch.Tensor): [L] int64 (unused).
        max_seq_len (int): upper bound on ``lengths``; the padded length N.

    Returns:
        torch.Tensor: [L, E] L2-normalized user embedding after each history token.
    """

    def __init__(
        self,
        num_items: int,
        embedding_dim: int,
        max_seq_len: int,
        num_heads: int = 1,
        num_layers: int = 2,
        dropout_ratio: float = 0.2,
        num_negatives: int = 128,
        temperature: float = 0.05,
        device: Optional[torch.device] = None,
        num_attributes: int = 0,
        num_attribute_links: int = 0,
    ) -> None:
        super().__init__()
        if num_items <= 1:
            raise ValueError(f"num_items must be > 1, got {num_items}")
        if max_seq_len <= 0:
            raise ValueError(f"max_seq_len must be > 0, got {max_seq_len}")
        if num_heads <= 0 or embedding_dim % num_heads != 0:
            raise ValueError(
                f"embedding_dim ({embedding_dim}) must be divisible by num_heads ({num_heads})"
            )
        if num_layers <= 0:
            raise ValueError(f"num_layers must be > 0, got {num_layers}")
        if num_negatives <= 0:
            raise ValueError(f"num_negatives must be > 0, got {num_negatives}")
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        self.num_items = num_items
        self.embedding_dim = embedding_dim
        self.max_seq_len = max_seq_len
        self.num_negatives = num_negatives
        self.temperature = temperature
        self.item_embeddings = nn.Embedding(num_items, embedding_dim, device=device)
        self.position_embeddings = nn.Embedding(max_seq_len, embedding_dim, device=device)
        nn.init.normal_(self.item_embeddings.weight, std=0.02)
        nn.init.normal_(self.position_embeddings.weight, std=0.02)
        self.item_attributes = item_attribute_table(
            num_items, num_attributes, num_attribute_links, embedding_dim, device
        )
        self.input_dropout = nn.Dropout(dropout_ratio)
        self.blocks = nn.ModuleList(
            SASRecBlock(embedding_dim, num_heads, dropout_ratio, device) for _ in range(num_layers)
        )
        self.output_norm = nn.LayerNorm(embedding_dim, device=device)

    def _catalogue_rows(self) -> torch.Tensor:
        """[N, E] every item's row (id row plus attribute row), unnormalized."""
        rows = self.item_embeddings.weight
        return rows if self.item_attributes is None else rows + self.item_attributes()

    def item_rows(self, item_ids: torch.Tensor) -> torch.Tensor:
        """[...] ids -> [..., E] the items' rows, unnormalized (the input tokens)."""
        if self.item_attributes is None:
            return self.item_embeddings(item_ids)
        return self._catalogue_rows()[item_ids]

    def item_embedding(self, item_ids: torch.Tensor) -> torch.Tensor:
        """[...] ids -> [..., E] L2-normalized item embeddings."""
        return F.normalize(self.item_rows(item_ids), dim=-1, eps=1e-6)

    def catalogue_embedding(self) -> torch.Tensor:
        """[N, E] every item's L2-normalized embedding, row i for item i (the table read
        whole: its gradient then needs no scatter)."""
        return F.normalize(self._catalogue_rows(), dim=-1, eps=1e-6)

    def _padded_index(
        self,
        item_ids: torch.Tensor,
        lengths: torch.Tensor,
        timestamps: torch.Tensor,
        max_seq_len: int,
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """Checks the inputs; returns each token's (row [L], position [L]) in the padded batch."""
        if item_ids.dim() != 1 or timestamps.shape != item_ids.shape:
            raise ValueError(
                f"item_ids and timestamps must both be [L]; got {tuple(item_ids.shape)} and "
                f"{tuple(timestamps.shape)}"
            )
        if lengths.dim() != 1:
            raise ValueError(f"lengths must be [B], got {tuple(lengths.shape)}")
        if not 0 < max_seq_len <= self.max_seq_len:
            raise ValueError(
                f"max_seq_len must be in [1, {self.max_seq_len}] (the position table), "
                f"got {max_seq_len}"
            )
        return row_positions(mirror(offsets_from_lengths, lengths), item_ids.shape[0])

    def forward(
        self,
        item_ids: torch.Tensor,
        lengths: torch.Tensor,
        timestamps: torch.Tensor,
        max_seq_len: int,
    ) -> torch.Tensor:
        row, pos = self._padded_index(item_ids, lengths, timestamps, max_seq_len)
        tokens = self.item_rows(item_ids) * math.sqrt(self.embedding_dim)
        tokens = self.input_dropout(tokens + self.position_embeddings(pos))
        x = tokens.new_zeros(lengths.shape[0], max_seq_len, self.embedding_dim)
        x = x.index_put((row, pos), tokens)
        for block in self.blocks:
            x = block(x)
        return F.normalize(self.output_norm(x[row, pos]), dim=-1, eps=1e-6)

    def user_embedding(
        self,
        item_ids: torch.Tensor,
        lengths: torch.Tensor,
        timestamps: torch.Tensor,
        max_seq_len: int,
    ) -> torch.Tensor:
        """[B, E] the embedding after each user's last token (zeros for empty histories)."""
        full = self.forward(item_ids, lengths, timestamps, max_seq_len)
        if full.shape[0] == 0:
            return full.new_zeros(lengths.shape[0], self.embedding_dim)
        last = (mirror(offsets_from_lengths, lengths)[1:] - 1).clamp(min=0)
        return full[last] * (lengths > 0).unsqueeze(1).to(full.dtype)

    def loss(
        self,
        item_ids: torch.Tensor,
        lengths: torch.Tensor,
        timestamps: torch.Tensor,
        max_seq_len: int,
        negatives: Optional[torch.Tensor] = None,
        loss_mask: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """Mean sampled-softmax loss over positions that have a next item.

        Args:
            negatives (torch.Tensor | None): [N] negative ids; None draws ``num_negatives``
                uniformly from the catalogue, or with ``num_negatives`` at least the
                catalogue takes every item (:func:`tzrec_gr.losses.full_softmax_loss`).
            loss_mask (torch.Tensor | None): [L] bool, the tokens whose terms count (a
                padded batch's real ones); None: every token.

        Returns:
            torch.Tensor: scalar.
        """
        user = self.forward(item_ids, lengths, timestamps, max_seq_len)
        return next_item_loss(self, user, item_ids, lengths, negatives, loss_mask)


def _trainer_kwargs(settings: Any, num_items: int, task_bits: Sequence[int]) -> Dict[str, Any]:
    return dict(
        num_items=num_items,
        embedding_dim=settings.embedding_dim,
        max_seq_len=settings.max_seq_len,
        num_heads=settings.num_heads,
        num_layers=settings.num_layers,
        dropout_ratio=settings.dropout,
        num_negatives=settings.num_negatives,
        temperature=settings.temperature,
    )


register_model(
    ModelRecord(
        name="sasrec",
        model_class=SASRec,
        task="retrieval",
        graph_step=True,
        trainer_kwargs=_trainer_kwargs,
        description="SASRec's causal softmax attention, trained with HSTU's sampled softmax",
    )
)
