"""Evaluation metrics: full-catalogue retrieval (HR@K, NDCG@K, MRR) and per-task AUC.

Legend: B = users in a batch, I = catalogue size, E = embedding width.

Retrieval follows the quality protocol: each user's held-out target is ranked against every
item of the catalogue, never against sampled candidates.
"""

from __future__ import annotations

import math
from typing import Dict, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist
from torch import nn

__all__ = [
    "NonFiniteError", "RetrievalMetrics", "ScoreBuffers", "TaskAUC", "non_finite_rows",
    "target_ranks",
]


class NonFiniteError(FloatingPointError):
    """A loss or a score is NaN or infinite: the run diverged, and no metric is reported."""


def count_dtype(num_items: int) -> torch.dtype:
    """The dtype that the item comparisons of :func:`target_ranks` are counted in: float32
    sums 0/1 values exactly while every partial sum is below 2**24, float64 beyond. A float
    sum needs no cast, where the sum of a bool mask first copies it into int64 ([B, I] x 8
    bytes, the largest temporary of a full-catalogue ranking)."""
    return torch.float32 if num_items < 2**24 else torch.float64


def target_ranks(
    scores: torch.Tensor, targets: torch.Tensor, work: Optional[torch.Tensor] = None
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Where each user's target falls among all items: items scoring above it, and its ties.

    A target's rank is not defined by the scores alone when other items score exactly the
    same: :class:`RetrievalMetrics` breaks such ties at random and reports the expected
    metric over that draw, so a tie counts neither for nor against the target on average
    (a constant scorer ranks every target in the middle, with HR@K = K / I).

    Args:
        scores (torch.Tensor): [B, I] scores of every item for each user, higher is better.
        targets (torch.Tensor): [B] target item ids in ``[0, I)``.
        work (torch.Tensor | None): [B, I] buffer of :func:`count_dtype` that the
            comparisons are written to (e.g. :attr:`ScoreBuffers.work`); None allocates one.

    Returns:
        (higher [B], ties [B]) int64: items scoring strictly above the target, and items
        other than the target scoring exactly the same.
    """
    if scores.dim() != 2:
        raise ValueError(f"scores must be [B, I], got {tuple(scores.shape)}")
    if targets.shape != scores.shape[:1]:
        raise ValueError(f"targets must be [{scores.shape[0]}], got {tuple(targets.shape)}")
    if work is None:
        work = torch.empty(scores.shape, dtype=count_dtype(scores.shape[1]),
                           device=scores.device)
    elif work.shape != scores.shape:
        raise ValueError(f"work must be {tuple(scores.shape)}, got {tuple(work.shape)}")
    # the target's score is read from the same matrix, so it compares equal to itself
    target_score = scores.gather(1, targets.unsqueeze(1))
    higher = torch.gt(scores, target_score, out=work).sum(dim=1).long()
    ties = torch.eq(scores, target_score, out=work).sum(dim=1).long() - 1
    return higher, ties


def non_finite_rows(scores: torch.Tensor) -> torch.Tensor:
    """[] int64 on the scores' device: the rows of [B, I] ``scores`` holding a NaN or an
    infinite value. A row's minimum and maximum are finite exactly when all of it is (both
    propagate NaN), and reading them allocates [B], where ``isfinite`` would allocate
    [B, I]."""
    low, high = torch.aminmax(scores, dim=1)
    return (~(torch.isfinite(low) & torch.isfinite(high))).sum()


class ScoreBuffers:
    """The [B, I] tensors of a full-catalogue evaluation, allocated once and reused by every
    batch: the scores, and the comparisons that :func:`target_ranks` counts.

    A fresh [B, I] tensor per batch is costly on the CPU: at 256 users x 80k items each is
    tens of MB, which glibc maps afresh for every allocation and unmaps on free, so every
    page faults in again on each batch (most of an evaluation's time went to the kernel).

    Args:
        rows (int): the most users of a batch.
        num_items (int): the catalogue's size I.
        dtype (torch.dtype): the scores' dtype.
        device (torch.device | None): where the buffers live.
    """

    def __init__(self, rows: int, num_items: int, dtype: torch.dtype,
                 device: Optional[torch.device] = None) -> None:
        self.scores = torch.empty((rows, num_items), dtype=dtype, device=device)
        self.work = torch.empty((rows, num_items), dtype=count_dtype(num_items), device=device)

    def dot(self, user: torch.Tensor, items: torch.Tensor) -> torch.Tensor:
        """[B, I] ``user @ items.T`` ([B, E] and [I, E], both cast to the scores' dtype),
        written into the buffer: a view valid until the next call."""
        out = self.scores[: user.shape[0]]
        dtype = out.dtype
        return torch.mm(user.to(dtype), items.to(dtype).t(), out=out)

    def work_for(self, scores: torch.Tensor) -> torch.Tensor:
        """The comparison buffer for [B, I] ``scores`` (of this catalogue, B at most rows)."""
        return self.work[: scores.shape[0]]


class RetrievalMetrics:
    """Streaming HR@K, NDCG@K and MRR over the full catalogue.

    For a target at 0-based rank r: HR@K = [r < K], NDCG@K = [r < K] / log2(r + 2) (one
    relevant item, so the ideal DCG is 1) and MRR = 1 / (r + 1); each is averaged over users.
    When ``t`` other items tie with the target's score after ``h`` items score above it,
    its rank is taken uniform on ``h .. h + t`` (ties broken at random) and each metric is
    its exact expectation over that draw.

    Scores must be finite: a batch with a NaN or infinite score is counted, and
    :meth:`compute` raises :class:`NonFiniteError` instead of returning metrics (a diverged
    model's NaN scores compare false with everything and would otherwise rank every
    target first). The count is kept on the device, so :meth:`update` never waits for it.

    Only per-metric sums and two counts are kept, as one float64 tensor, so memory does
    not grow with the evaluation set and a distributed evaluation needs a single all-reduce.
    This is why the ranks are computed here rather than with torchmetrics' retrieval
    metrics: those keep every prediction and target until ``compute`` (users x items floats
    for a full-catalogue ranking, e.g. 6k users x 3.7k items on ML-1M and 138k x 27k on
    ML-20M), while a rank needs only the comparison of each score with the target's.

    Args:
        ks (Sequence[int]): cut-offs K. Default: (10, 50, 200).
        chunk_size (int): users scored at once by :meth:`update`, so memory peaks at
            ``chunk_size x I`` scores and as many comparisons (:class:`ScoreBuffers`).
            Default: 1024.
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
        if chunk_size <= 0:
            raise ValueError(f"chunk_size must be > 0, got {chunk_size}")
        self.ks = tuple(ks)
        self.chunk_size = chunk_size
        # gains[n] = sum of 1 / log2(r + 2) for r < n: the DCG of ranks below n
        ranks = torch.arange(max(self.ks), dtype=torch.float64, device=device)
        self._gains = torch.cat([ranks.new_zeros(1), torch.cumsum(1 / torch.log2(ranks + 2), 0)])
        # layout: HR@K for each K, NDCG@K for each K, reciprocal rank, users, non-finite users
        self._sums = torch.zeros(2 * len(self.ks) + 3, dtype=torch.float64, device=device)

    def reset(self) -> None:
        self._sums.zero_()

    @torch.no_grad()
    def update(self, user: torch.Tensor, items: torch.Tensor, targets: torch.Tensor) -> None:
        """Adds a batch of users by embedding: item scores are ``user @ items.T``.

        Args:
            user (torch.Tensor): [B, E] user embeddings.
            items (torch.Tensor): [I, E] embeddings of the whole catalogue.
            targets (torch.Tensor): [B] target item ids in ``[0, I)``.
        """
        if user.dim() != 2 or items.dim() != 2 or user.shape[1] != items.shape[1]:
            raise ValueError(
                f"user [B, E] and items [I, E] must share E; got {tuple(user.shape)} and "
                f"{tuple(items.shape)}"
            )
        buffers = ScoreBuffers(min(self.chunk_size, user.shape[0]), items.shape[0],
                               torch.result_type(user, items), user.device)
        for start in range(0, user.shape[0], self.chunk_size):
            stop = start + self.chunk_size
            scores = buffers.dot(user[start:stop], items)
            self.update_scores(scores, targets[start:stop], work=buffers.work_for(scores))

    @torch.no_grad()
    def update_scores(
        self,
        scores: torch.Tensor,
        targets: torch.Tensor,
        excluded: Optional[torch.Tensor] = None,
        *,
        seen: Optional[Tuple[torch.Tensor, torch.Tensor]] = None,
        work: Optional[torch.Tensor] = None,
    ) -> None:
        """Adds a batch of users by their scores of every item.

        Args:
            scores (torch.Tensor): [B, I] item scores, higher is better.
            targets (torch.Tensor): [B] target item ids in ``[0, I)``.
            excluded (torch.Tensor | None): [B, I] bool, items left out of a user's ranking
                (e.g. the items already in its history); a target is never left out.
            seen ((torch.Tensor, torch.Tensor) | None): items left out as (row [P], item
                [P]) int64 pairs instead of a mask: they are set to -inf in ``scores`` in
                place, so the caller leaves out the pairs of the targets themselves.
            work (torch.Tensor | None): [B, I] comparison buffer for :func:`target_ranks`
                (see :class:`ScoreBuffers`); None allocates one.
        """
        non_finite = non_finite_rows(scores)
        if excluded is not None:
            keep = torch.zeros_like(excluded).scatter_(1, targets.unsqueeze(1), True)
            scores = scores.masked_fill(excluded & ~keep, -math.inf)
        if seen is not None:
            scores[seen] = -math.inf
        higher, ties = target_ranks(scores, targets, work)
        self.update_ranks(higher, ties, non_finite)

    @torch.no_grad()
    def update_ranks(
        self,
        higher: torch.Tensor,
        ties: Optional[torch.Tensor] = None,
        non_finite: Union[int, torch.Tensor] = 0,
    ) -> None:
        """Adds users by the items scoring above their targets ([B] integers) and the items
        tied with them ([B], default none); ``non_finite`` of them had a non-finite score."""
        h = higher.to(device=self._sums.device, dtype=torch.float64)
        t = torch.zeros_like(h) if ties is None else ties.to(h.device, torch.float64)
        last = h + t  # the rank is uniform on h .. last: t + 1 equally likely places
        places = t + 1
        hits = torch.stack([(k - h).clamp(0, None).minimum(places) / places for k in self.ks])
        gains = torch.stack([self._dcg_below(last + 1, k) - self._dcg_below(h, k)
                             for k in self.ks]) / places
        # the mean of 1 / (r + 1) over r = h .. last, through the harmonic numbers' digamma
        reciprocal = (torch.special.digamma(last + 2) - torch.special.digamma(h + 1)) / places
        self._sums += torch.cat(
            [
                hits.sum(dim=1),
                gains.sum(dim=1),
                reciprocal.sum().reshape(1),
                h.new_tensor([float(h.shape[0])]),
                torch.as_tensor(non_finite, dtype=torch.float64, device=h.device).reshape(1),
            ]
        )

    def _dcg_below(self, n: torch.Tensor, k: int) -> torch.Tensor:
        """Sum of 1 / log2(r + 2) over ranks r < min(n, k)."""
        return self._gains[n.clamp(max=k).to(torch.int64)]

    def compute(self) -> Dict[str, float]:
        """Means over every user seen, on every process when torch.distributed is initialized.

        Under torch.distributed this is a collective: every rank must call it. The local
        sums are left unchanged, so ``compute`` can be called again.

        Returns:
            Dict[str, float]: ``hr@K`` and ``ndcg@K`` for each K, ``mrr``, and ``count`` (the
            number of users); metrics are NaN when no user was seen.

        Raises:
            NonFiniteError: some user had a NaN or infinite score.
        """
        sums = self._sums.clone()
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(sums, op=dist.ReduceOp.SUM)
        values = sums.tolist()
        count, non_finite = values[-2], values[-1]
        if non_finite:
            raise NonFiniteError(
                f"{int(non_finite)} of {int(count)} evaluated users have NaN or infinite item "
                "scores: the model diverged (lower --lr, or keep --clip-grad-norm on)"
            )
        mean = [v / count if count > 0 else math.nan for v in values[:-2]]
        num_k = len(self.ks)
        result = {f"hr@{k}": mean[i] for i, k in enumerate(self.ks)}
        result.update({f"ndcg@{k}": mean[num_k + i] for i, k in enumerate(self.ks)})
        result["mrr"] = mean[-1]
        result["count"] = count
        return result


class TaskAUC(nn.Module):
    """ROC AUC per ranking task: one ``torchmetrics`` ``BinaryAUROC`` for each.

    Scores may be logits or probabilities (AUC depends only on their order). Under
    torch.distributed, torchmetrics gathers the states across processes in ``compute``. As
    in :class:`RetrievalMetrics`, a NaN or infinite score is counted on the device and
    :meth:`compute` raises :class:`NonFiniteError` rather than report an AUC.

    Args:
        tasks (Sequence[str]): task names, e.g. ("click", "like").
        thresholds (int | None): None keeps every score for the exact AUC; an int bins
            scores into that many thresholds for constant memory. Default: None.
    """

    def __init__(self, tasks: Sequence[str], thresholds: Optional[int] = None) -> None:
        super().__init__()
        if not tasks or len(set(tasks)) != len(tasks):
            raise ValueError(f"tasks must be non-empty and distinct, got {tuple(tasks)}")
        # imported here: torchmetrics takes ~1 s to import, and the CLI imports this module
        # for NonFiniteError alone
        from torchmetrics.classification import BinaryAUROC

        self.aucs = nn.ModuleDict({t: BinaryAUROC(thresholds=thresholds) for t in tasks})
        self.register_buffer("_non_finite", torch.zeros((), dtype=torch.float64))

    def update(self, scores: Dict[str, torch.Tensor], labels: Dict[str, torch.Tensor]) -> None:
        """Adds a batch: ``scores[task]`` and ``labels[task]`` ([B], labels in {0, 1})."""
        for task, auc in self.aucs.items():
            score = scores[task].detach()
            self._non_finite += (~torch.isfinite(score)).sum()
            auc.update(score, labels[task].to(torch.int64))

    def compute(self) -> Dict[str, float]:
        """AUC of each task over every sample seen (a collective under torch.distributed).

        Raises:
            NonFiniteError: some score was NaN or infinite.
        """
        non_finite = self._non_finite.clone()
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(non_finite, op=dist.ReduceOp.SUM)
        if non_finite.item():
            raise NonFiniteError(
                f"{int(non_finite.item())} ranking scores are NaN or infinite: the model "
                "diverged (lower --lr, or keep --clip-grad-norm on)"
            )
        return {task: float(auc.compute()) for task, auc in self.aucs.items()}

    def reset(self) -> None:
        self._non_finite.zero_()
        for auc in self.aucs.values():
            auc.reset()
