"""Next-item retrieval: train on users' histories, rank each held-out item among all items.

Training batches are the leave-one-out training histories, each cut to its last
``max_seq_len`` events; the loss is the model's own sampled softmax over every position
that has a next item, with negatives drawn from a generator seeded by ``(seed, step)`` so
that every rank (and a resumed run) uses the same ones (``--num-negatives`` at least the
catalogue size trains on every item, the full softmax). Evaluation embeds each user's
history before the held-out item and ranks the item against the whole catalogue
(:class:`~tzrec_bench.train.metrics.RetrievalMetrics`), and with ``--eval-negatives N``
also against N items the user never interacted with (:mod:`tzrec_bench.train.sampled`).
"""

from __future__ import annotations

import math
from typing import Any, Dict, Optional, Tuple

import numpy as np
import torch
from torch import nn

from tzrec_bench.data import HeldOut, SequenceDataset, leave_one_out, make_batch, make_eval_batch
from tzrec_bench.data.dataset import segment_index
from tzrec_bench.train.config import TrainConfig
from tzrec_bench.train.distributed import DistContext, shard
from tzrec_bench.train.metrics import RetrievalMetrics, ScoreBuffers
from tzrec_bench.train.report import evaluation_progress
from tzrec_bench.train.sampled import NEGATIVES_SEED, SampledMetrics, sampled_negatives
from tzrec_bench.train.task import (
    Batch,
    amp_dtype,
    autocast,
    chunks,
    eval_rows,
    eval_shard,
    held_out_users,
    staged,
)
from tzrec_bench.train.tasks import RETRIEVAL_KS
from tzrec_ops.jagged import to_device


def step_negatives(seed: int, step: int, num_items: int, count: int) -> torch.Tensor:
    """The negatives of ``step``, the same for every rank: ``count`` item ids drawn uniformly
    (fewer than the catalogue; at least as many is the full softmax, which the models take
    over their whole table)."""
    rng = np.random.default_rng([seed, step])
    return torch.from_numpy(rng.integers(0, num_items, size=count, dtype=np.int64))


def seen_pairs(
    history: SequenceDataset, rows: np.ndarray, targets: Optional[np.ndarray] = None
) -> Tuple[torch.Tensor, torch.Tensor]:
    """(row position, item id) of every event in each row's whole history (int64 each);
    with ``targets`` ([len(rows)] item ids), the pairs of each row's own target are left
    out (on the host, so that no device read picks them out)."""
    lengths = history.lengths[rows]
    events = segment_index(history.offsets[rows], lengths)
    user = np.repeat(np.arange(len(rows)), lengths)
    item = history.item_ids[events].astype(np.int64)
    if targets is not None:
        other = item != targets[user]
        user, item = user[other], item[other]
    return torch.from_numpy(user), torch.from_numpy(item)


def pad_batch(
    item_ids: torch.Tensor, lengths: torch.Tensor, timestamps: torch.Tensor,
    tokens: int, users: int, max_seq_len: int,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A CPU jagged batch padded to ``tokens`` tokens by ``users`` padding users after its
    own, each at most ``max_seq_len`` long (the first ones full, the rest shorter or
    empty), so that batches of one bucket share every shape. Padding tokens are item 0 at
    time 0; they attend only to their own padding user.

    Returns:
        (item_ids [tokens], lengths [B + users], timestamps [tokens], loss_mask [tokens]
        bool: True on the batch's own tokens).

    Raises:
        ValueError: the padding does not fit (fewer tokens than the batch's, or more than
            ``users`` users of ``max_seq_len`` can hold).
    """
    own = item_ids.shape[0]
    extra = tokens - own
    if extra < 0 or extra > users * max_seq_len:
        raise ValueError(f"tokens={tokens}: a batch of {own} tokens pads to between {own} "
                         f"and {own + users * max_seq_len} with {users} padding users")
    full, rest = divmod(extra, max_seq_len)
    pad_lengths = torch.zeros(users, dtype=lengths.dtype)
    pad_lengths[:full] = max_seq_len
    if rest:
        pad_lengths[full] = rest
    mask = torch.zeros(tokens, dtype=torch.bool)
    mask[:own] = True
    return (
        torch.cat([item_ids, item_ids.new_zeros(extra)]),
        torch.cat([lengths, pad_lengths]),
        torch.cat([timestamps, timestamps.new_zeros(extra)]),
        mask,
    )


#: catalogue rows looked up at once by the evaluation of a sharded table
CATALOGUE_CHUNK = 65536


class RetrievalTask:
    """See the module docstring; the interface is :class:`~tzrec_bench.train.task.Task`."""

    task_bits: tuple = ()

    def __init__(self, dataset: SequenceDataset, config: TrainConfig, ctx: DistContext) -> None:
        self.config = config
        self.ctx = ctx
        self.num_items = dataset.num_items
        self.dataset = dataset
        self.split = leave_one_out(dataset)
        self._negatives: Dict[str, np.ndarray] = {}  # per split: drawn once, reused
        lengths = self.split.train.lengths
        self.train_rows = np.flatnonzero(lengths >= 2)  # one event has no next item
        self._kept = np.minimum(lengths, config.max_seq_len)
        self._amp = amp_dtype(config, ctx.device)

    def loss_terms(self, rows: np.ndarray) -> int:
        return int(np.maximum(self._kept[rows] - 1, 0).sum())

    def tokens(self, rows: np.ndarray, step: int) -> int:
        return int(self._kept[rows].sum())

    def batch(self, rows: np.ndarray, step: int,
              padded: Optional[Tuple[int, int]] = None) -> Batch:
        """The device inputs of ``rows`` at ``step``; with ``padded = (tokens, users)``,
        padded to exactly that many tokens and padding users (:func:`pad_batch`)."""
        cpu = make_batch(self.split.train, rows, self.config.max_seq_len)
        item_ids, lengths, timestamps = cpu.item_ids, cpu.lengths, cpu.timestamps
        mask = None
        if padded is not None:
            item_ids, lengths, timestamps, mask = pad_batch(
                item_ids, lengths, timestamps, *padded, self.config.max_seq_len
            )
        device = self.ctx.device
        batch = {
            "item_ids": staged(item_ids, device),
            "lengths": staged(lengths, device, index=True),
            "timestamps": staged(timestamps, device),
        }
        negatives = self._step_negatives(step)
        if negatives is not None:
            batch["negatives"] = negatives
        if mask is not None:
            batch["loss_mask"] = staged(mask, device)
        return batch

    def _step_negatives(self, step: int) -> Optional[torch.Tensor]:
        """:func:`step_negatives` on the device; None for the full softmax, which the
        models compute over their whole table (:func:`tzrec_gr.losses.full_softmax_loss`)."""
        if self.config.num_negatives >= self.num_items:
            return None
        return staged(step_negatives(self.config.seed, step, self.num_items,
                                     self.config.num_negatives), self.ctx.device)

    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        # Every batch is given the same max_seq_len, not its own longest history: HSTU's
        # attention scales by it, and a fixed value makes a user's output the same in any
        # batch, on any rank and in evaluation.
        mask = batch.get("loss_mask")
        return model.loss(
            batch["item_ids"], batch["lengths"], batch["timestamps"], self.config.max_seq_len,
            negatives=batch.get("negatives"), **({} if mask is None else {"loss_mask": mask}),
        )

    @torch.no_grad()
    def evaluate(self, model: nn.Module, split: str, max_users: Optional[int]) -> Dict[str, float]:
        held = getattr(self.split, split)
        rows = eval_rows(len(held), max_users, self.config.seed)
        if self.config.sharding == "torchrec":
            return self._evaluate_sharded(model, split, held, rows)
        rows = shard(rows, self.ctx)
        device = self.ctx.device
        metrics = RetrievalMetrics(RETRIEVAL_KS, device=device)
        sampled = SampledMetrics(device) if self.config.eval_negatives else None
        negatives = self._sampled_negatives(split, held) if sampled is not None else None
        # the count baselines score the catalogue themselves; embedding models by dot product
        score_catalogue = getattr(model, "catalogue_scores", None)
        items = None
        if score_catalogue is None:
            with autocast(device, self._amp):
                items = model.item_embedding(torch.arange(self.num_items, device=device))
            # in the dtype that autocast multiplies in, so the scores are those of a plain
            # ``user @ items.T`` under it
            items = items.float().to(self._amp or torch.float32)
        buffers = ScoreBuffers(min(len(rows), self.config.eval_batch_size), self.num_items,
                               torch.float32 if items is None else items.dtype, device)
        bar = evaluation_progress(self.ctx.is_main and self.config.progress, split, len(rows))
        for chunk in chunks(rows, self.config.eval_batch_size):
            cpu = make_eval_batch(held, chunk, self.config.max_seq_len)
            with autocast(device, self._amp):
                if items is None:
                    scores = score_catalogue(*self._history(cpu)).float()
                else:
                    user = model.user_embedding(*self._history(cpu)).float()
            if items is not None:
                scores = buffers.dot(user, items)
            targets = cpu.targets.to(device)
            if sampled is not None:
                drawn = torch.from_numpy(negatives[chunk]).to(device)
                sampled.update(scores.gather(1, targets.unsqueeze(1)).squeeze(1),
                               scores.gather(1, drawn))
            seen = None
            if self.config.exclude_seen:
                seen = tuple(t.to(device) for t in
                             seen_pairs(held.history, chunk, held.targets[chunk]))
            metrics.update_scores(scores, targets, seen=seen, work=buffers.work_for(scores))
            bar.update(len(chunk))
        bar.close()
        return {**metrics.compute(), **(sampled.compute() if sampled is not None else {})}

    def _sampled_negatives(self, split: str, held: HeldOut) -> np.ndarray:
        """[len(held), N] the split's drawn negatives (every row's, drawn once)."""
        if split not in self._negatives:
            self._negatives[split] = sampled_negatives(
                self.dataset, held.rows, self.num_items, self.config.eval_negatives,
                NEGATIVES_SEED,
            )
        return self._negatives[split]

    def _history(self, cpu: Any) -> Tuple[Any, ...]:
        device = self.ctx.device
        return (
            cpu.item_ids.to(device), to_device(cpu.lengths, device),
            cpu.timestamps.to(device), self.config.max_seq_len,
        )

    def _evaluate_sharded(
        self, model: nn.Module, split: str, held: HeldOut, rows: np.ndarray
    ) -> Dict[str, float]:
        """The ranks of a sharded table's evaluation: the catalogue is read in chunks of
        :data:`CATALOGUE_CHUNK` items (each a lookup that every rank makes together), never
        whole, and each user's target is compared with every chunk (the progress bar
        counts the users embedded, before the comparisons).

        The target's own score is computed once from its row and its comparison with itself
        in its chunk is taken back out, so a target never outranks or ties itself.
        """
        device = self.ctx.device
        rows, own = eval_shard(rows, self.ctx, lockstep=True)
        users, targets, target_scores = [], [], []
        bar = evaluation_progress(self.ctx.is_main and self.config.progress, split, len(rows))
        with autocast(device, self._amp):
            for chunk in chunks(rows, self.config.eval_batch_size):
                cpu = make_eval_batch(held, chunk, self.config.max_seq_len)
                user = model.user_embedding(*self._history(cpu)).float()
                target = cpu.targets.to(device)
                users.append(user)
                targets.append(target)
                target_scores.append((user * model.item_embedding(target).float()).sum(-1))
                bar.update(len(chunk))
            bar.close()
            users_, targets_ = torch.cat(users)[:own], torch.cat(targets)[:own]
            target_score = torch.cat(target_scores)[:own].unsqueeze(1)
            seen = None
            if self.config.exclude_seen:
                seen = tuple(t.to(device) for t in seen_pairs(held.history, rows[:own]))
            higher = torch.zeros(own, dtype=torch.int64, device=device)
            ties = torch.zeros_like(higher)
            finite = torch.isfinite(target_score).squeeze(1)
            user_index = torch.arange(own, device=device)
            for start in range(0, self.num_items, CATALOGUE_CHUNK):
                stop = min(start + CATALOGUE_CHUNK, self.num_items)
                items = model.item_embedding(torch.arange(start, stop, device=device)).float()
                scores = users_ @ items.t()
                finite &= torch.isfinite(scores).all(dim=1)
                if seen is not None:
                    user, item = seen
                    inside = (item >= start) & (item < stop) & (item != targets_[user])
                    scores[user[inside], item[inside] - start] = -math.inf
                higher += (scores > target_score).sum(dim=1)
                ties += (scores == target_score).sum(dim=1)
                inside = (targets_ >= start) & (targets_ < stop)
                itself = scores[user_index, (targets_ - start).clamp(0, stop - start - 1)]
                higher -= (inside & (itself > target_score.squeeze(1))).long()
                ties -= (inside & (itself == target_score.squeeze(1))).long()
        metrics = RetrievalMetrics(RETRIEVAL_KS, device=device)
        metrics.update_ranks(higher, ties, (~finite).sum())
        return metrics.compute()

    def describe(self) -> str:
        train = self.split.train
        return (
            f"{train.num_users} users, {self.num_items} items, {train.num_events} training "
            f"events, {held_out_users(len(self.split.valid), self.config)}"
        )
