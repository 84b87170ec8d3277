"""The papers' sampled protocol, reported beside the full-catalogue ranking, never instead.

SASRec (Kang & McAuley, ICDM 2018) and the papers after it rank each user's held-out item
against N items drawn uniformly from those the user never interacted with (N = 100 there),
not against the whole catalogue. :func:`sampled_negatives` draws them: for evaluated user
in data set row ``r`` from a generator seeded by ``(NEGATIVES_SEED, r)``, so the draw
depends on neither the model, the run's seed, the batch size nor the number of processes:
every model of a table meets the same negatives. Draws are
independent (an item may be drawn twice, as in SASRec's code); an item of the user's whole
sequence, the held-out ones included, is drawn again. The metrics are those of
:class:`~tzrec_bench.train.metrics.RetrievalMetrics` over the N + 1 candidates, named
``sampled_hr@10``, ``sampled_ndcg@10`` and ``sampled_mrr``: a constant scorer gets
HR@10 = 10 / (N + 1) in expectation (ties are broken at random).
"""

from __future__ import annotations

from typing import Dict

import numpy as np
import torch

from tzrec_bench.data import SequenceDataset
from tzrec_bench.train.metrics import RetrievalMetrics

#: the draw's seed: one for every run, so that every model and seed meets the same negatives
NEGATIVES_SEED = 0
#: cut-offs of the sampled metrics (a few hundred candidates at most: K=10 as the papers)
SAMPLED_KS = (10,)
PREFIX = "sampled_"


def sampled_negatives(sequences: SequenceDataset, rows: np.ndarray, num_items: int,
                      count: int, seed: int) -> np.ndarray:
    """[len(rows), count] int64 items that row ``r`` of ``sequences`` (a user's whole
    sequence) does not hold, row ``r`` drawn from a generator seeded by ``(seed, r)``.

    Raises:
        ValueError: a user who interacted with every item (nothing to draw).
    """
    out = np.empty((len(rows), count), dtype=np.int64)
    for index, row in enumerate(np.asarray(rows, dtype=np.int64).tolist()):
        seen = np.unique(sequences.sequence(row))
        if len(seen) >= num_items:
            raise ValueError(f"user row {row} interacted with every item: no negative to draw")
        rng = np.random.default_rng([seed, row])
        drawn = rng.integers(0, num_items, size=count)
        redraw = np.isin(drawn, seen)
        while redraw.any():
            drawn[redraw] = rng.integers(0, num_items, size=int(redraw.sum()))
            redraw = np.isin(drawn, seen)
        out[index] = drawn
    return out


class SampledMetrics:
    """Streaming sampled HR@10, NDCG@10 and MRR: each target against its drawn negatives."""

    def __init__(self, device: torch.device) -> None:
        self._metrics = RetrievalMetrics(SAMPLED_KS, device=device)

    def update(self, target_scores: torch.Tensor, negative_scores: torch.Tensor) -> None:
        """Adds users: ``target_scores`` [B] and ``negative_scores`` [B, N]."""
        scores = torch.cat([target_scores.unsqueeze(1), negative_scores], dim=1)
        targets = torch.zeros(scores.shape[0], dtype=torch.int64, device=scores.device)
        self._metrics.update_scores(scores, targets)

    def compute(self) -> Dict[str, float]:
        """The metrics, prefixed ``sampled_`` (a collective under torch.distributed)."""
        return {PREFIX + name: value for name, value in self._metrics.compute().items()
                if name != "count"}
