"""The models' training objectives, as functions any model with the same outputs can use.

Legend: B = batch, L = total history tokens of a jagged batch, E = embedding width,
N = negatives, L_t = total candidates, K = tasks.

- :func:`sampled_softmax_loss`: next-item retrieval (``HSTURetrieval.loss``); a baseline
  trained with it is compared with HSTU under the same objective. Negatives that cover the
  whole catalogue make it the full softmax.
- :func:`full_softmax_loss`: the same loss with every item as a negative, computed as one
  log-softmax over the catalogue (what the models use when N is at least the catalogue).
- :func:`multitask_bce_loss`: multi-task ranking on label bitmasks (``HSTURanking.loss``).
"""

from __future__ import annotations

from typing import Callable, Optional, Tuple

import torch
from torch.nn import functional as F

from tzrec_ops.jagged import offsets_from_lengths, row_positions

__all__ = [
    "full_softmax_loss",
    "multitask_bce_loss",
    "next_item_targets",
    "sampled_softmax_loss",
]


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
    sample, pos = row_positions(offsets_from_lengths(lengths), total)
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
    loss_mask: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Mean next-item sampled-softmax loss over the tokens that have a next item.

    For token p with next item t and shared negatives n_1..n_N::

        loss_p = -log( exp(<u_p, e_t> / T) / (exp(<u_p, e_t> / T) + sum_j exp(<u_p, e_nj> / T)) )

    A negative equal to t is an accidental positive and is left out of p's sum (so
    negatives listing every item give the full softmax). With L2-normalized embeddings the
    dot products are cosines. Logits are reduced in float32 (float64 ones in float64).

    Args:
        user (torch.Tensor): [L, E] user embedding after each history token.
        item_ids (torch.Tensor): [L] jagged item ids the embeddings were computed from.
        lengths (torch.Tensor): [B] sequence lengths.
        item_embedding_fn (Callable): ids [...] -> [..., E] item embeddings.
        negatives (torch.Tensor): [N] negative item ids shared by every token.
        temperature (float): T.
        loss_mask (torch.Tensor | None): [L] bool, the tokens whose terms count (a padded
            batch's real tokens: padding users are then left out of the sum and the count,
            so the loss is that of the batch without them); None: every token.

    Returns:
        torch.Tensor: scalar; 0 when no token has a next item.
    """
    next_ids, has_next = next_item_targets(item_ids, lengths)
    pos_logit = (user * item_embedding_fn(next_ids).to(user.dtype)).sum(-1) / temperature
    neg_logit = user @ item_embedding_fn(negatives).to(user.dtype).t() / temperature
    neg_logit = neg_logit.masked_fill(
        negatives.unsqueeze(0) == next_ids.unsqueeze(1), float("-inf")
    )
    logits = torch.cat([pos_logit.unsqueeze(1), neg_logit], dim=1)
    logits = logits.to(_reduced_in(logits.dtype))
    per_token = torch.logsumexp(logits, dim=1) - logits[:, 0]
    return _mean_over_targets(per_token, has_next, loss_mask)


def full_softmax_loss(
    user: torch.Tensor,
    item_ids: torch.Tensor,
    lengths: torch.Tensor,
    catalogue: torch.Tensor,
    temperature: float,
    loss_mask: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """:func:`sampled_softmax_loss` with every item as a negative (the full softmax):
    ``loss_p = -log softmax(<u_p, e_i> / T over all items i)[next item of p]``.

    One log-softmax over the catalogue, reduced as :func:`sampled_softmax_loss` reduces
    (read from the logits' own dtype, as autocast leaves them): the same loss without
    looking the negatives up or masking the accidental positive, and with fewer passes
    over the [L, N] logits.

    Args:
        user (torch.Tensor): [L, E] user embedding after each history token.
        item_ids (torch.Tensor): [L] jagged item ids the embeddings were computed from.
        lengths (torch.Tensor): [B] sequence lengths.
        catalogue (torch.Tensor): [N, E] every item's embedding, row i for item i.
        temperature (float): T.
        loss_mask (torch.Tensor | None): [L] bool, the tokens whose terms count; None:
            every token (see :func:`sampled_softmax_loss`).

    Returns:
        torch.Tensor: scalar; 0 when no token has a next item.

    Raises:
        ValueError: ``catalogue`` is not [N, E] with ``user``'s width E.
    """
    if catalogue.dim() != 2 or catalogue.shape[1] != user.shape[-1]:
        raise ValueError(f"catalogue must be [N, E] with user's E = {user.shape[-1]}, got "
                         f"{tuple(catalogue.shape)}")
    next_ids, has_next = next_item_targets(item_ids, lengths)
    logits = (user / temperature) @ catalogue.to(user.dtype).t()
    log_p = torch.log_softmax(logits, dim=1, dtype=_reduced_in(logits.dtype))
    per_token = -log_p.gather(1, next_ids.unsqueeze(1)).squeeze(1)
    return _mean_over_targets(per_token, has_next, loss_mask)


def _reduced_in(dtype: torch.dtype) -> torch.dtype:
    """The dtype logits are reduced in: float32, or float64 for float64 ones."""
    return torch.promote_types(dtype, torch.float32)


def _mean_over_targets(
    per_token: torch.Tensor, has_next: torch.Tensor, loss_mask: Optional[torch.Tensor]
) -> torch.Tensor:
    """The mean of ``per_token`` over the tokens that have a next item (and that
    ``loss_mask`` keeps); 0 when there are none."""
    if loss_mask is not None:
        has_next = has_next & loss_mask
    weight = has_next.to(per_token.dtype)
    return (per_token * weight).sum() / weight.sum().clamp(min=1.0)


def multitask_bce_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    task_bits: torch.Tensor,
    task_weights: torch.Tensor,
) -> torch.Tensor:
    """Weighted sum over tasks of the mean binary cross-entropy on label bitmasks.

    Candidate i is positive for task k when ``labels[i] & task_bits[k] != 0``. The
    cross-entropy is computed in float32.

    Args:
        logits (torch.Tensor): [L_t, K] one logit per candidate and task.
        labels (torch.Tensor): [L_t] integer label bitmasks.
        task_bits (torch.Tensor): [K] int64 label bit (mask) of each task.
        task_weights (torch.Tensor): [K] float32 weight of each task's mean.

    Returns:
        torch.Tensor: scalar.

    Raises:
        ValueError: ``labels`` is not [L_t].
    """
    if labels.shape != logits.shape[:1]:
        raise ValueError(
            f"labels must be [L_t] = [{logits.shape[0]}] bitmasks, got {tuple(labels.shape)}"
        )
    targets = torch.bitwise_and(labels.to(torch.int64).unsqueeze(1), task_bits) > 0
    per_task = F.binary_cross_entropy_with_logits(
        logits.float(), targets.float(), reduction="none"
    ).mean(dim=0)
    return (per_task * task_weights).sum()
