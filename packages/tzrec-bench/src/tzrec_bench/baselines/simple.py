"""Simple baselines that every quality table shows beside the neural models.

Legend: B = users in a batch, L = their history events (jagged), I = catalogue size,
C = candidates of a ranking batch, T = ranking tasks, nnz = stored item pairs.

Retrieval models score the whole catalogue with ``catalogue_scores`` (same inputs as the
neural models' ``user_embedding``; higher is better):

- :class:`MostPopular`: the item's number of training events.
- :class:`ItemTransitions`: a first-order Markov chain scored from the user's last item.
- :class:`ItemKNN`: item-to-item co-occurrence similarity, summed over the user's recent items
  with a recency decay.

Ranking: :class:`PopularityRanking`, smoothed per-item and per-user action rates.

Every model is fitted by ``fit(train)`` (vectorized numpy, no loop over events) and keeps its
fitted state in buffers, with no trainable parameters: ``load_state_dict`` restores it into a
freshly built model of the same arguments. Item pairs are stored sparse, as CSR (``indptr``
[I + 1], ``indices`` and ``values`` [nnz]); no I x I matrix is ever built.

**Back-off rule** of :class:`ItemTransitions` and :class:`ItemKNN`: items are ranked by their
primary score (transition count, kNN similarity), then by popularity, exactly
(lexicographically, with no epsilon: popularity only orders items of equal primary score).
float32 cannot hold a primary score and a popularity fraction in one sum without losing one
of the two orders at MovieLens-20M's counts, so the scores are ranks: each item's dense rank
in its user's (primary, popularity) order, in ``[0, I)`` (0 the lowest; items equal in both
keys score the same). An empty history therefore ranks by popularity. Scoring a batch sorts
each user's row, which takes a few transient [B, I] tensors.
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Sequence, Tuple, TypeVar

import numpy as np
import torch
from torch import Tensor, nn

from tzrec_bench.data.dataset import SequenceDataset
from tzrec_gr.features import CANDIDATE_ITEM_ID, CANDIDATE_LENGTHS, UIH_ACTIONS, UIH_LENGTHS
from tzrec_gr.models.registry import ModelRecord, register_model

__all__ = ["ItemKNN", "ItemTransitions", "MostPopular", "PopularityRanking"]

_LOGIT_EPS = 1e-6  # rates are clamped to [eps, 1 - eps] before the logit, so logits are finite


def _check_num_items(num_items: int) -> None:
    if num_items <= 0:
        raise ValueError(f"num_items must be > 0, got {num_items}")


def _check_train(train: SequenceDataset, num_items: int) -> None:
    if train.num_items != num_items:
        raise ValueError(
            f"the model was built for {num_items} items; {train.name} has {train.num_items}"
        )


def _popularity(train: SequenceDataset) -> np.ndarray:
    """[I] int64 training events per item."""
    return np.bincount(train.item_ids, minlength=train.num_items).astype(np.int64)


def _pair_counts(train: SequenceDataset, window: int) -> Tuple[np.ndarray, ...]:
    """How often item b occurs 1 to ``window`` positions after item a in a user's row.

    Returns:
        (first [nnz], second [nnz], counts [nnz]) int64, sorted by (first, second).
    """
    items, num_items = train.item_ids, train.num_items
    user = np.repeat(np.arange(train.num_users), train.lengths)
    keys = []
    for gap in range(1, window + 1):
        same_user = user[:-gap] == user[gap:]
        keys.append(items[:-gap][same_user] * num_items + items[gap:][same_user])
    pairs, counts = np.unique(np.concatenate(keys), return_counts=True)
    first, second = np.divmod(pairs, num_items)
    return first, second, counts.astype(np.int64)


def _segments(starts: Tensor, lengths: Tensor) -> Tensor:
    """The flat positions of ``[starts[i], starts[i] + lengths[i])``, in order."""
    total = int(lengths.sum())
    out_starts = torch.cumsum(lengths, 0) - lengths
    shift = torch.repeat_interleave(starts - out_starts, lengths, output_size=total)
    return shift + torch.arange(total, device=starts.device)


def _recency(lengths: Tensor, total: int) -> Tuple[Tensor, Tensor]:
    """Each jagged event's row and age: 1 for its row's last (most recent) event.

    Returns:
        (rows [L], ages [L]) int64.
    """
    rows = torch.repeat_interleave(
        torch.arange(lengths.shape[0], device=lengths.device), lengths, output_size=total
    )
    ends = torch.cumsum(lengths, 0)
    return rows, ends[rows] - torch.arange(total, device=lengths.device)


def _with_backoff(primary: Tensor, popularity: Tensor) -> Tensor:
    """[B, I] float32 dense rank of each item in its row's (primary, popularity) order.

    Args:
        primary (Tensor): [B, I] primary scores.
        popularity (Tensor): [I] training events per item.
    """
    by_popularity = torch.argsort(popularity, stable=True)
    # a stable sort by primary keeps popularity order among equal primary scores
    key, order = torch.sort(primary[:, by_popularity], dim=1, stable=True)
    items = by_popularity[order]
    tie = popularity[items]
    changes = (key[:, 1:] != key[:, :-1]) | (tie[:, 1:] != tie[:, :-1])
    rank = torch.zeros(items.shape, dtype=torch.float32, device=items.device)
    rank[:, 1:] = torch.cumsum(changes, dim=1)
    return torch.empty_like(rank).scatter_(1, items, rank)


class MostPopular(nn.Module):
    """Scores every item by its number of training events, the same for every user.

    Args:
        num_items (int): catalogue size; ids are in ``[0, num_items)``.
        device (torch.device | None): buffer device. Default: None.

    Buffers:
        popularity: [I] int64 training events per item.
    """

    def __init__(self, num_items: int, device: Optional[torch.device] = None) -> None:
        super().__init__()
        _check_num_items(num_items)
        self.num_items = num_items
        self.register_buffer(
            "popularity", torch.zeros(num_items, dtype=torch.int64, device=device)
        )

    def fit(self, train: SequenceDataset) -> "MostPopular":
        """Counts the events of ``train`` (the training split); returns ``self``."""
        _check_train(train, self.num_items)
        self.popularity = torch.from_numpy(_popularity(train)).to(self.popularity.device)
        return self

    def catalogue_scores(
        self,
        item_ids: Tensor,
        lengths: Tensor,
        timestamps: Tensor,
        max_seq_len: Optional[int] = None,
    ) -> Tensor:
        """[B, I] float32 event counts; only ``lengths`` (for B) is read, the rest is the
        neural models' interface."""
        return self.popularity.to(torch.float32).expand(lengths.shape[0], -1).clone()


_Neighbours = TypeVar("_Neighbours", bound="_ItemNeighbours")


class _ItemNeighbours(nn.Module):
    """Scores items by sparse item-to-item weights from a user's recent items (see
    :class:`ItemKNN`); subclasses define the weights of the co-occurrence counts."""

    _SPARSE_BUFFERS = ("indices", "values")

    def __init__(
        self,
        num_items: int,
        window: int,
        recent: int,
        decay: float,
        device: Optional[torch.device],
    ) -> None:
        super().__init__()
        _check_num_items(num_items)
        if window <= 0 or recent <= 0:
            raise ValueError(f"window and recent must be > 0, got {window} and {recent}")
        if not decay > 0:
            raise ValueError(f"decay must be > 0, got {decay}")
        self.num_items = num_items
        self.window = window
        self.recent = recent
        self.decay = decay
        self.register_buffer(
            "popularity", torch.zeros(num_items, dtype=torch.int64, device=device)
        )
        self.register_buffer(
            "indptr", torch.zeros(num_items + 1, dtype=torch.int64, device=device)
        )
        self.register_buffer("indices", torch.zeros(0, dtype=torch.int64, device=device))
        self.register_buffer("values", torch.zeros(0, dtype=torch.float32, device=device))

    def _pair_weights(
        self, first: np.ndarray, second: np.ndarray, counts: np.ndarray, popularity: np.ndarray
    ) -> np.ndarray:
        """[nnz] weight of each (first -> second) pair from its co-occurrence count."""
        raise NotImplementedError

    def fit(self: _Neighbours, train: SequenceDataset) -> _Neighbours:
        """Counts items and item pairs of ``train`` (the training split); returns ``self``."""
        _check_train(train, self.num_items)
        popularity = _popularity(train)
        first, second, counts = _pair_counts(train, self.window)
        indptr = np.concatenate([[0], np.cumsum(np.bincount(first, minlength=self.num_items))])
        device = self.popularity.device
        self.popularity = torch.from_numpy(popularity).to(device)
        self.indptr = torch.from_numpy(indptr.astype(np.int64)).to(device)
        self.indices = torch.from_numpy(second).to(device)
        weights = self._pair_weights(first, second, counts, popularity)
        self.values = torch.from_numpy(weights.astype(np.float32)).to(device)
        return self

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs) -> None:
        # the sparse buffers take the saved size (a fresh module holds nnz = 0)
        for name in self._SPARSE_BUFFERS:
            saved = state_dict.get(prefix + name)
            if isinstance(saved, Tensor):
                self._buffers[name] = self._buffers[name].new_empty(saved.shape)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def catalogue_scores(
        self,
        item_ids: Tensor,
        lengths: Tensor,
        timestamps: Tensor,
        max_seq_len: Optional[int] = None,
    ) -> Tensor:
        """[B, I] float32 scores of every item for each user (see the class docstring).

        Args:
            item_ids (Tensor): [L] int64 histories back to back, oldest first in each.
            lengths (Tensor): [B] int64 history lengths (0 allowed).
            timestamps (Tensor): [L] (unused; the neural models' interface).
            max_seq_len (int | None): only each history's last ``max_seq_len`` events are
                seen, as by the neural models. Default: None (all).
        """
        if max_seq_len is not None and max_seq_len <= 0:
            raise ValueError(f"max_seq_len must be > 0, got {max_seq_len}")
        device = self.popularity.device
        item_ids, lengths = item_ids.to(device), lengths.to(device)
        horizon = self.recent if max_seq_len is None else min(self.recent, max_seq_len)
        rows, ages = _recency(lengths, item_ids.shape[0])
        primary = torch.zeros(lengths.shape[0], self.num_items, dtype=torch.float64, device=device)
        # one history position at a time, so the gathered pairs stay at B rows of the CSR
        for age in range(1, horizon + 1):
            at_age = ages == age
            starts = self.indptr[item_ids[at_age]]
            counts = self.indptr[item_ids[at_age] + 1] - starts
            pairs = _segments(starts, counts)
            primary.index_put_(
                (torch.repeat_interleave(rows[at_age], counts), self.indices[pairs]),
                self.values[pairs].to(torch.float64) * self.decay ** (age - 1),
                accumulate=True,
            )
        return _with_backoff(primary, self.popularity)


class ItemTransitions(_ItemNeighbours):
    """First-order Markov chain: items ranked by how often they immediately followed the
    user's last history item in the training rows, then by popularity (back-off rule of the
    module docstring); a last item never followed, or an empty history, ranks by popularity.

    Args:
        num_items (int): catalogue size; ids are in ``[0, num_items)``.
        device (torch.device | None): buffer device. Default: None.

    Buffers:
        popularity: [I] int64 training events per item.
        indptr, indices, values: CSR of the counts (float32) of "a immediately followed by b";
            row a, column b.
    """

    def __init__(self, num_items: int, device: Optional[torch.device] = None) -> None:
        super().__init__(num_items, window=1, recent=1, decay=1.0, device=device)

    def _pair_weights(
        self, first: np.ndarray, second: np.ndarray, counts: np.ndarray, popularity: np.ndarray
    ) -> np.ndarray:
        return counts


class ItemKNN(_ItemNeighbours):
    """Item-to-item kNN on co-occurrence within a window of the training rows.

    C(a, b) counts the times b occurs 1 to ``window`` positions after a in a user's row;
    sim(a, b) = C(a, b) / sqrt(n_a n_b), with n the items' event counts (directional: a
    before b). A user's primary score of b is the sum over its last ``recent`` history items
    h_j (j = 1 the most recent) of ``decay ** (j - 1) * sim(h_j, b)``; items are ranked by it,
    then by popularity (back-off rule of the module docstring, exact: popularity never
    outranks any difference of primary scores). An empty history ranks by popularity.

    Args:
        num_items (int): catalogue size; ids are in ``[0, num_items)``.
        window (int): how many positions after an item count as co-occurring. Default: 5.
        recent (int): how many of the user's last items are used. Default: 10.
        decay (float): weight ratio of each history item to the next more recent one.
            Default: 0.8.
        device (torch.device | None): buffer device. Default: None.

    Buffers:
        popularity: [I] int64 training events per item.
        indptr, indices, values: CSR of sim(a, b) (float32); row a, column b.
    """

    def __init__(
        self,
        num_items: int,
        window: int = 5,
        recent: int = 10,
        decay: float = 0.8,
        device: Optional[torch.device] = None,
    ) -> None:
        super().__init__(num_items, window=window, recent=recent, decay=decay, device=device)

    def _pair_weights(
        self, first: np.ndarray, second: np.ndarray, counts: np.ndarray, popularity: np.ndarray
    ) -> np.ndarray:
        return counts / np.sqrt(popularity[first].astype(np.float64) * popularity[second])


class PopularityRanking(nn.Module):
    """Multi-task ranking from smoothed action rates of the candidate item and of the user.

    For each task bit, an item's rate is the share of its training events with the bit set,
    smoothed toward the global rate g with ``prior_strength`` pseudo-events:
    ``(hits + k g) / (events + k)``; the user's rate is the same over its history's action
    bits (the last ``max_seq_len`` events), so an empty history gets g. The logit combines
    the two as independent log-odds deviations from the global rate, with no trained weights:
    ``logit(item rate) + logit(user rate) - logit(g)``. Rates are clamped to
    ``[1e-6, 1 - 1e-6]`` first, so logits are finite.

    Args:
        num_items (int): catalogue size; ids are in ``[0, num_items)``.
        task_bitmasks (Sequence[int]): each task's action bit (mask), T of them.
        prior_strength (float): k, pseudo-events at the global rate. Default: 10.0.
        device (torch.device | None): buffer device. Default: None.

    Buffers:
        item_rates: [I, T] float32 smoothed per-item rates.
        global_rates: [T] float32 share of all training events with each bit.
    """

    def __init__(
        self,
        num_items: int,
        task_bitmasks: Sequence[int],
        prior_strength: float = 10.0,
        device: Optional[torch.device] = None,
    ) -> None:
        super().__init__()
        _check_num_items(num_items)
        if not task_bitmasks or any(int(bits) <= 0 for bits in task_bitmasks):
            raise ValueError(f"task_bitmasks must be positive masks, got {list(task_bitmasks)}")
        if not prior_strength > 0:
            raise ValueError(f"prior_strength must be > 0, got {prior_strength}")
        self.num_items = num_items
        self.task_bitmasks = tuple(int(bits) for bits in task_bitmasks)
        self.prior_strength = prior_strength
        num_tasks = len(self.task_bitmasks)
        self.register_buffer(
            "item_rates", torch.full((num_items, num_tasks), 0.5, device=device)
        )
        self.register_buffer("global_rates", torch.full((num_tasks,), 0.5, device=device))

    def fit(self, train: SequenceDataset) -> "PopularityRanking":
        """Counts the action bits of ``train`` (the training split); returns ``self``."""
        _check_train(train, self.num_items)
        if train.actions is None:
            raise ValueError(f"{train.name} has no action bitmasks to rate")
        if train.num_events == 0:
            raise ValueError(f"{train.name} has no training events")
        hits = (train.actions[:, None] & np.array(self.task_bitmasks)) != 0  # [N, T]
        items, num_items = train.item_ids, self.num_items
        events = np.bincount(items, minlength=num_items)
        item_hits = np.stack(
            [np.bincount(items, weights=task, minlength=num_items) for task in hits.T], axis=1
        )
        global_rates = hits.mean(axis=0)
        k = self.prior_strength
        item_rates = (item_hits + k * global_rates) / (events[:, None] + k)
        device = self.item_rates.device
        self.item_rates = torch.from_numpy(item_rates.astype(np.float32)).to(device)
        self.global_rates = torch.from_numpy(global_rates.astype(np.float32)).to(device)
        return self

    def forward(
        self, features: Dict[str, Tensor], max_seq_len: int, num_candidates: int
    ) -> Tensor:
        """[C, T] float32 logits of each candidate for each task.

        Args:
            features (Dict[str, Tensor]): the ranking task's features; read are
                ``uih.sequence_length`` [B], ``uih_action.sequence`` [L] history action
                bitmasks, ``candidate.item_id`` [C] and ``candidate.sequence_length`` [B].
            max_seq_len (int): only each history's last ``max_seq_len`` events are seen.
            num_candidates (int): the ranking models' interface; the logits do not depend on it.
        """
        if max_seq_len <= 0:
            raise ValueError(f"max_seq_len must be > 0, got {max_seq_len}")
        device = self.item_rates.device
        lengths = features[UIH_LENGTHS].to(device)
        actions = features[UIH_ACTIONS].to(device)
        candidates = features[CANDIDATE_ITEM_ID].to(device)
        candidate_lengths = features[CANDIDATE_LENGTHS].to(device)
        rows, ages = _recency(lengths, actions.shape[0])
        seen = ages <= max_seq_len
        bits = torch.tensor(self.task_bitmasks, device=device)
        hits = (torch.bitwise_and(actions[seen].unsqueeze(1), bits) != 0).to(torch.float64)
        batch = lengths.shape[0]
        user_hits = hits.new_zeros(batch, len(bits)).index_add_(0, rows[seen], hits)
        user_events = torch.bincount(rows[seen], minlength=batch).to(torch.float64)
        k, global_rates = self.prior_strength, self.global_rates.to(torch.float64)
        user_rates = (user_hits + k * global_rates) / (user_events.unsqueeze(1) + k)
        candidate_rows = torch.repeat_interleave(
            torch.arange(batch, device=device), candidate_lengths, output_size=candidates.shape[0]
        )
        logits = (
            torch.logit(self.item_rates[candidates].to(torch.float64), _LOGIT_EPS)
            + torch.logit(user_rates[candidate_rows], _LOGIT_EPS)
            - torch.logit(global_rates, _LOGIT_EPS)
        )
        return logits.to(torch.float32)


def _catalogue_kwargs(settings: Any, num_items: int, task_bits: Sequence[int]) -> Dict[str, Any]:
    """A retrieval baseline is built from the catalogue size alone."""
    return dict(num_items=num_items)


def _ranking_kwargs(settings: Any, num_items: int, task_bits: Sequence[int]) -> Dict[str, Any]:
    return dict(num_items=num_items, task_bitmasks=list(task_bits))


register_model(ModelRecord(
    "most-popular", MostPopular, "retrieval", fitted=True, trainer_kwargs=_catalogue_kwargs,
    description="the items with the most training events"))
register_model(ModelRecord(
    "item-transitions", ItemTransitions, "retrieval", fitted=True,
    trainer_kwargs=_catalogue_kwargs,
    description="first-order Markov chain from the user's last item, backed off to popularity"))
register_model(ModelRecord(
    "item-knn", ItemKNN, "retrieval", fitted=True, trainer_kwargs=_catalogue_kwargs,
    description="co-occurrence similarity to the user's recent items, backed off to popularity"))
register_model(ModelRecord(
    "popularity-ranking", PopularityRanking, "ranking", fitted=True,
    trainer_kwargs=_ranking_kwargs, description="smoothed per-item and per-user action rates"))
