"""Multi-task ranking: score candidate events given the history before them; AUC per task.

Labels are the candidates' action bits. Data sets with ratings and no actions (MovieLens)
get the actions of the synthetic data set's rule: CLICK on every event, LONG_VIEW for a
rating of 4 or more, LIKE for 5, HATE for 1 or less. The tasks are those of ``click``,
``like`` and ``long_view`` whose bit is neither always set nor never set in the data
(on MovieLens and the synthetic set every event is a click, so the tasks are like and
long_view).

- Training: each step, each user's candidates are a window of ``num_candidates``
  consecutive events of its training history (fewer for short histories), placed at a
  random position after at least one event of history; the events before the window, cut
  to the last ``max_seq_len``, are the history with its action bits. The position is drawn
  per (seed, step, user), so every event is a candidate over the epochs, not only each
  user's last few (on MovieLens-100K, about 97k events instead of 7.5k).
- Evaluation: one candidate per user, the held-out event (leave-one-out), after its history.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, Optional, Tuple

import numpy as np
import torch
from torch import nn

from tzrec_bench.data import Action, HeldOut, SequenceDataset, leave_one_out
from tzrec_bench.data.dataset import segment_index
from tzrec_bench.train.config import ConfigError, TrainConfig
from tzrec_bench.train.distributed import DistContext
from tzrec_bench.train.metrics import TaskAUC
from tzrec_bench.train.report import evaluation_progress
from tzrec_bench.train.task import (
    Batch,
    amp_dtype,
    autocast,
    eval_rows,
    eval_shard,
    held_out_users,
    staged,
)
from tzrec_bench.train.tasks import RANKING_TASKS
from tzrec_gr.features import (
    CANDIDATE_ITEM_ID,
    CANDIDATE_LENGTHS,
    CANDIDATE_TIMESTAMPS,
    UIH_ACTIONS,
    UIH_ITEM_ID,
    UIH_LENGTHS,
    UIH_TIMESTAMPS,
)

TASK_BITS = {"click": Action.CLICK, "like": Action.LIKE, "long_view": Action.LONG_VIEW}


def actions_from_ratings(ratings: np.ndarray) -> np.ndarray:
    """[N] action bitmasks from [N] ratings (the rule of the module docstring)."""
    return (
        int(Action.CLICK)
        + (ratings >= 4) * int(Action.LONG_VIEW)
        + (ratings >= 5) * int(Action.LIKE)
        + (ratings <= 1) * int(Action.HATE)
    ).astype(np.int64)


def with_actions(dataset: SequenceDataset) -> SequenceDataset:
    """``dataset`` with action bitmasks, derived from its ratings when it has none."""
    if dataset.actions is not None:
        return dataset
    if dataset.ratings is None:
        raise ConfigError("model", f"hstu-ranking needs ratings or actions; {dataset.name} "
                          "has neither")
    return dataclasses.replace(dataset, actions=actions_from_ratings(dataset.ratings))


def varying_tasks(actions: np.ndarray) -> Dict[str, int]:
    """The tasks whose bit is set on some events and not on others."""
    tasks = {}
    for name in RANKING_TASKS:
        share = np.mean((actions & int(TASK_BITS[name])) != 0) if len(actions) else 0.0
        if 0.0 < share < 1.0:
            tasks[name] = int(TASK_BITS[name])
    if not tasks:
        raise ConfigError("data", f"no feedback of {', '.join(RANKING_TASKS)} varies in the "
                          "data: there is nothing to rank")
    return tasks


def _unit_floats(seed: int, step: int, rows: np.ndarray) -> np.ndarray:
    """One float in [0, 1) per row, a hash of (seed, step, row) (splitmix64's finaliser):
    the same for a row on any rank and in any batch, with no state to carry."""
    with np.errstate(over="ignore"):
        x = (np.uint64(seed) * np.uint64(0x9E3779B97F4A7C15)
             + np.uint64(step) * np.uint64(0xBF58476D1CE4E5B9)
             + rows.astype(np.uint64) * np.uint64(0x94D049BB133111EB))
        x ^= x >> np.uint64(30)
        x *= np.uint64(0xBF58476D1CE4E5B9)
        x ^= x >> np.uint64(27)
        x *= np.uint64(0x94D049BB133111EB)
        x ^= x >> np.uint64(31)
    return (x >> np.uint64(11)).astype(np.float64) / float(1 << 53)


class RankingTask:
    """See the module docstring; the interface is :class:`~tzrec_bench.train.task.Task`."""

    def __init__(self, dataset: SequenceDataset, config: TrainConfig, ctx: DistContext) -> None:
        dataset = with_actions(dataset)
        self.config = config
        self.ctx = ctx
        self.source = dataset
        self.num_items = dataset.num_items
        self.tasks = varying_tasks(dataset.actions)
        self.task_bits = tuple(self.tasks.values())
        metric = config.key_metric
        if metric != "auc" and metric.removeprefix("auc_") not in self.tasks:
            raise ConfigError("metric", f"{dataset.name} has no varying "
                              f"{metric.removeprefix('auc_')} feedback; its tasks are "
                              f"{', '.join(self.tasks)}")
        self.split = leave_one_out(dataset)
        lengths = self.split.train.lengths
        self.train_rows = np.flatnonzero(lengths >= 2)  # a candidate needs a history
        self._candidates = np.clip(lengths - 1, 0, config.num_candidates)
        self._amp = amp_dtype(config, ctx.device)

    def loss_terms(self, rows: np.ndarray) -> int:
        return int(self._candidates[rows].sum())

    def tokens(self, rows: np.ndarray, step: int) -> int:
        return int((self._windows(rows, step)[1] + self._candidates[rows]).sum())

    def _windows(self, rows: np.ndarray, step: int) -> Tuple[np.ndarray, np.ndarray]:
        """(first candidate's offset in the user's row, history length) at ``step``."""
        lengths, candidates = self.split.train.lengths[rows], self._candidates[rows]
        # uniform over [1, length - candidates]: at least one event of history before it
        starts = 1 + (_unit_floats(self.config.seed, step, rows)
                      * (lengths - candidates)).astype(np.int64)
        return starts, np.minimum(starts, self.config.max_seq_len)

    def batch(self, rows: np.ndarray, step: int) -> Batch:
        train = self.split.train
        starts, history = self._windows(rows, step)
        candidates = self._candidates[rows]
        cand_starts = train.offsets[rows] + starts
        return self._features(
            train, cand_starts - history, history,
            train, segment_index(cand_starts, candidates), candidates,
        )

    def _features(
        self,
        history_ds: SequenceDataset,
        history_starts: np.ndarray,
        history_lengths: np.ndarray,
        candidate_ds: SequenceDataset,
        candidate_index: np.ndarray,
        candidate_lengths: np.ndarray,
    ) -> Batch:
        """The model's feature dict and the candidates' label bitmasks, on the device."""
        device = self.ctx.device
        hist = segment_index(history_starts, history_lengths)

        def put(values: np.ndarray, index: bool = False) -> torch.Tensor:
            return staged(torch.from_numpy(values), device, index)

        features = {
            UIH_ITEM_ID: put(history_ds.item_ids[hist]),
            UIH_LENGTHS: put(history_lengths, index=True),
            UIH_ACTIONS: put(history_ds.actions[hist]),
            UIH_TIMESTAMPS: put(history_ds.timestamps[hist]),
            CANDIDATE_ITEM_ID: put(candidate_ds.item_ids[candidate_index]),
            CANDIDATE_LENGTHS: put(candidate_lengths, index=True),
            CANDIDATE_TIMESTAMPS: put(candidate_ds.timestamps[candidate_index]),
        }
        return {"features": features, "labels": put(candidate_ds.actions[candidate_index])}

    def _logits(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        # a fixed max_seq_len, as in retrieval: the attention scale must not depend on the batch
        return model(batch["features"], self.config.max_seq_len, self.config.num_candidates)

    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        return model.loss(self._logits(model, batch), batch["labels"])

    def _held_out_batch(self, held: HeldOut, rows: np.ndarray) -> Batch:
        """History before each user's held-out event, and that event as the one candidate."""
        history = held.history
        lengths = np.minimum(history.lengths[rows], self.config.max_seq_len)
        target = self.source.offsets[held.rows[rows]] + history.lengths[rows]
        return self._features(
            history, history.offsets[rows + 1] - lengths, lengths,
            self.source, target, np.ones(len(rows), dtype=np.int64),
        )

    @torch.no_grad()
    def evaluate(self, model: nn.Module, split: str, max_users: Optional[int]) -> Dict[str, float]:
        held = getattr(self.split, split)
        evaluated = eval_rows(len(held), max_users, self.config.seed)
        rows, own = eval_shard(evaluated, self.ctx, self.config.sharding == "torchrec")
        auc = TaskAUC(list(self.tasks)).to(self.ctx.device)
        bar = evaluation_progress(self.ctx.is_main and self.config.progress, split, own)
        for start in range(0, len(rows), self.config.eval_batch_size):
            chunk = rows[start : start + self.config.eval_batch_size]
            batch = self._held_out_batch(held, chunk)
            with autocast(self.ctx.device, self._amp):
                logits = self._logits(model, batch).float()[: max(own - start, 0)]
            scores, labels = self._per_task(logits, batch["labels"][: len(logits)])
            auc.update(scores, labels)
            bar.update(len(logits))
        bar.close()
        per_task = auc.compute()
        result = {"auc": float(np.mean(list(per_task.values())))}
        result.update({f"auc_{name}": value for name, value in per_task.items()})
        # every rank's rows together, the lockstep's repeats left out: one candidate a user
        result["count"] = float(len(evaluated))
        return result

    def _per_task(
        self, logits: torch.Tensor, labels: torch.Tensor
    ) -> Tuple[Dict[str, torch.Tensor], Dict[str, torch.Tensor]]:
        scores = {name: logits[:, k] for k, name in enumerate(self.tasks)}
        hits = {name: (labels & bit) != 0 for name, bit in self.tasks.items()}
        return scores, hits

    def describe(self) -> str:
        train = self.split.train
        return (
            f"{train.num_users} users, {self.num_items} items, tasks "
            f"{', '.join(self.tasks)}, {held_out_users(len(self.split.valid), self.config)}"
        )
