"""Next-item sampled-softmax loss shared by every retrieval model of the harness.

Legend: B = batch, L = total history tokens of a jagged batch, E = embedding width,
N = negatives.

The maths is the one of ``tzrec_gr.models.HSTURetrieval.loss``, so that a baseline trained
with :func:`sampled_softmax_loss` is compared with HSTU under the same objective.
"""

from __future__ import annotations

from typing import Callable, Tuple

import torch

from tzrec_gr._jagged import lengths_to_offsets, row_positions

__all__ = ["next_item_targets", "sampled_softmax_loss"]


def next_item_targets(
    item_ids: torch.Tensor, lengths: torch.Tensor
) -> Tuple[torch.Tensor, torch.Tensor]:
    """The item each history token is trained to predict: the next one of its sequence.

    Args:
        item_ids (torch.Tensor): [L] jagged item ids.
        lengths (torch.Tensor): [B] sequence lengths.

    Returns:
        (next_ids [L], has_next [L] bool): ``next_ids[p]`` is ``item_ids[p + 1]``; it is
        meaningful only where ``has_next`` (p is not the last token of its sequence).
    """
    total = item_ids.shape[0]
    sample, pos = row_positions(lengths_to_offsets(lengths), total)
    has_next = pos < lengths.to(torch.int64)[sample] - 1
    # the last token of the batch has no successor; clamp keeps the gather in range
    following = (torch.arange(total, device=item_ids.device) + 1).clamp(max=max(total - 1, 0))
    return item_ids[following], has_next


def sampled_softmax_loss(
    user: torch.Tensor,
    item_ids: torch.Tensor,
    lengths: torch.Tensor,
    item_embedding_fn: Callable[[torch.Tensor], torch.Tensor],
    negatives: torch.Tensor,
    temperature: float,
) -> torch.Tensor:
    """Mean next-item sampled-softmax loss over the tokens that have a next item.

    For token p with next item t and shared negatives n_1..n_N::

        loss_p = -log( exp(<u_p, e_t> / T) / (exp(<u_p, e_t> / T) + sum_j exp(<u_p, e_nj> / T)) )

    A negative equal to t is an accidental positive and is left out of p's sum. With
    L2-normalized embeddings the dot products are cosines. Logits are reduced in float32.

    Args:
        user (torch.Tensor): [L, E] user embedding after each history token.
        item_ids (torch.Tensor): [L] jagged item ids the embeddings were computed from.
        lengths (torch.Tensor): [B] sequence lengths.
        item_embedding_fn (Callable): ids [...] -> [..., E] item embeddings.
        negatives (torch.Tensor): [N] negative item ids shared by every token.
        temperature (float): T.

    Returns:
        torch.Tensor: scalar; 0 when no token has a next item.
    """
    next_ids, has_next = next_item_targets(item_ids, lengths)
    pos_logit = (user * item_embedding_fn(next_ids).to(user.dtype)).sum(-1) / temperature
    neg_logit = user @ item_embedding_fn(negatives).to(user.dtype).t() / temperature
    neg_logit = neg_logit.masked_fill(
        negatives.unsqueeze(0) == next_ids.unsqueeze(1), float("-inf")
    )
    logits = torch.cat([pos_logit.unsqueeze(1), neg_logit], dim=1).float()
    per_token = torch.logsumexp(logits, dim=1) - logits[:, 0]
    weight = has_next.to(per_token.dtype)
    return (per_token * weight).sum() / weight.sum().clamp(min=1.0)
