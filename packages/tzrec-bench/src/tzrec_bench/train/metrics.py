"""Evaluation metrics: full-catalogue retrieval (HR@K, NDCG@K, MRR) and per-task AUC.

Legend: B = users in a batch, I = catalogue size, E = embedding width.

Retrieval follows the quality protocol: each user's held-out target is ranked against every
item of the catalogue, never against sampled candidates.
"""

from __future__ import annotations

import math
from typing import Dict, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torchmetrics.classification import BinaryAUROC

__all__ = ["RetrievalMetrics", "TaskAUC", "target_ranks"]


def target_ranks(
    user: torch.Tensor, items: torch.Tensor, targets: torch.Tensor, chunk_size: int = 1024
) -> torch.Tensor:
    """0-based rank of each user's target among all items, by dot-product score.

    The rank is the number of items scoring strictly higher than the target. Ties are
    resolved in the target's favour: an item scoring exactly the target's score does not push
    it down. With learned float embeddings exact ties are rare, but degenerate users (e.g. a
    zero embedding, where every item scores 0) get rank 0, so evaluate only users with a
    history.

    Users are scored ``chunk_size`` at a time, so memory peaks at ``chunk_size x I`` scores.

    Args:
        user (torch.Tensor): [B, E] user embeddings.
        items (torch.Tensor): [I, E] embeddings of the whole catalogue.
        targets (torch.Tensor): [B] target item ids in ``[0, I)``.
        chunk_size (int): users scored at once. Default: 1024.

    Returns:
        torch.Tensor: [B] int64 ranks in ``[0, I)``.
    """
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be > 0, got {chunk_size}")
    if user.dim() != 2 or items.dim() != 2 or user.shape[1] != items.shape[1]:
        raise ValueError(
            f"user [B, E] and items [I, E] must share E; got {tuple(user.shape)} and "
            f"{tuple(items.shape)}"
        )
    if targets.shape != user.shape[:1]:
        raise ValueError(f"targets must be [{user.shape[0]}], got {tuple(targets.shape)}")
    ranks = []
    for start in range(0, user.shape[0], chunk_size):
        scores = user[start : start + chunk_size] @ items.t()
        # the target's score is read from the same matrix, not recomputed as a separate dot
        # product, so that it compares bit-for-bit with itself and never counts as higher
        target_score = scores.gather(1, targets[start : start + chunk_size].unsqueeze(1))
        ranks.append((scores > target_score).sum(dim=1))
    if not ranks:
        return torch.zeros(0, dtype=torch.int64, device=user.device)
    return torch.cat(ranks)


class RetrievalMetrics:
    """Streaming HR@K, NDCG@K and MRR over the full catalogue.

    For a target at 0-based rank r: HR@K = [r < K], NDCG@K = [r < K] / log2(r + 2) (one
    relevant item, so the ideal DCG is 1) and MRR = 1 / (r + 1); each is averaged over users.

    Only per-metric sums and a user count are kept, as one float64 tensor, so memory does
    not grow with the evaluation set and a distributed evaluation needs a single all-reduce.
    This is why the ranks are computed here rather than with torchmetrics' retrieval
    metrics: those keep every prediction and target until ``compute`` (users x items floats
    for a full-catalogue ranking, e.g. 6k users x 3.7k items on ML-1M and 138k x 27k on
    ML-20M), while a rank needs only the comparison of each score with the target's.

    Args:
        ks (Sequence[int]): cut-offs K. Default: (10, 50, 200).
        chunk_size (int): users scored at once (see :func:`target_ranks`). Default: 1024.
        device (torch.device | None): where the sums live; under NCCL, the rank's GPU.
            Default: CPU.
    """

    def __init__(
        self,
        ks: Sequence[int] = (10, 50, 200),
        chunk_size: int = 1024,
        device: Optional[torch.device] = None,
    ) -> None:
        if not ks or any(k <= 0 for k in ks):
            raise ValueError(f"ks must be non-empty and positive, got {tuple(ks)}")
        self.ks = tuple(ks)
        self.chunk_size = chunk_size
        # layout: HR@K for each K, NDCG@K for each K, reciprocal rank, user count
        self._sums = torch.zeros(2 * len(self.ks) + 2, dtype=torch.float64, device=device)

    def reset(self) -> None:
        self._sums.zero_()

    @torch.no_grad()
    def update(self, user: torch.Tensor, items: torch.Tensor, targets: torch.Tensor) -> None:
        """Adds a batch of users; arguments as in :func:`target_ranks`."""
        ranks = target_ranks(user, items, targets, self.chunk_size)
        self.update_ranks(ranks)

    @torch.no_grad()
    def update_ranks(self, ranks: torch.Tensor) -> None:
        """Adds users by their targets' 0-based ranks ([B] integers)."""
        ranks = ranks.to(device=self._sums.device, dtype=torch.float64)
        hits = torch.stack([ranks < k for k in self.ks]).to(torch.float64)  # [K, B]
        gains = hits / torch.log2(ranks + 2.0)
        self._sums += torch.cat(
            [
                hits.sum(dim=1),
                gains.sum(dim=1),
                (1.0 / (ranks + 1.0)).sum().reshape(1),
                ranks.new_tensor([float(ranks.shape[0])]),
            ]
        )

    def compute(self) -> Dict[str, float]:
        """Means over every user seen, on every process when torch.distributed is initialized.

        Under torch.distributed this is a collective: every rank must call it. The local
        sums are left unchanged, so ``compute`` can be called again.

        Returns:
            Dict[str, float]: ``hr@K`` and ``ndcg@K`` for each K, ``mrr``, and ``count`` (the
            number of users); metrics are NaN when no user was seen.
        """
        sums = self._sums.clone()
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(sums, op=dist.ReduceOp.SUM)
        values = sums.tolist()
        count = values[-1]
        mean = [v / count if count > 0 else math.nan for v in values[:-1]]
        num_k = len(self.ks)
        result = {f"hr@{k}": mean[i] for i, k in enumerate(self.ks)}
        result.update({f"ndcg@{k}": mean[num_k + i] for i, k in enumerate(self.ks)})
        result["mrr"] = mean[-1]
        result["count"] = count
        return result


class TaskAUC(nn.Module):
    """ROC AUC per ranking task: one ``torchmetrics`` ``BinaryAUROC`` for each.

    Scores may be logits or probabilities (AUC depends only on their order). Under
    torch.distributed, torchmetrics gathers the states across processes in ``compute``.

    Args:
        tasks (Sequence[str]): task names, e.g. ("click", "like").
        thresholds (int | None): None keeps every score for the exact AUC; an int bins
            scores into that many thresholds for constant memory. Default: None.
    """

    def __init__(self, tasks: Sequence[str], thresholds: Optional[int] = None) -> None:
        super().__init__()
        if not tasks or len(set(tasks)) != len(tasks):
            raise ValueError(f"tasks must be non-empty and distinct, got {tuple(tasks)}")
        self.aucs = nn.ModuleDict({t: BinaryAUROC(thresholds=thresholds) for t in tasks})

    def update(self, scores: Dict[str, torch.Tensor], labels: Dict[str, torch.Tensor]) -> None:
        """Adds a batch: ``scores[task]`` and ``labels[task]`` ([B], labels in {0, 1})."""
        for task, auc in self.aucs.items():
            auc.update(scores[task].detach(), labels[task].to(torch.int64))

    def compute(self) -> Dict[str, float]:
        """AUC of each task over every sample seen."""
        return {task: float(auc.compute()) for task, auc in self.aucs.items()}

    def reset(self) -> None:
        for auc in self.aucs.values():
            auc.reset()
