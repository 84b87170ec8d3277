"""Simple baselines: known answers on tiny data, back-off, state_dict round trips, and better
than chance on the synthetic data set."""

from __future__ import annotations

import io
import math
from typing import List, Optional, Sequence

import numpy as np
import pytest
import torch

from tzrec_bench.baselines.simple import ItemKNN, ItemTransitions, MostPopular, PopularityRanking
from tzrec_bench.data import Action, SequenceDataset, leave_one_out, load_dataset

LIKE, LONG_VIEW, CLICK = int(Action.LIKE), int(Action.LONG_VIEW), int(Action.CLICK)


def _dataset(
    rows: Sequence[Sequence[int]], num_items: int, actions: Optional[Sequence[int]] = None
) -> SequenceDataset:
    items = np.array([item for row in rows for item in row], dtype=np.int64)
    return SequenceDataset(
        name="tiny",
        offsets=np.concatenate([[0], np.cumsum([len(row) for row in rows])]).astype(np.int64),
        item_ids=items,
        timestamps=np.arange(len(items), dtype=np.int64),
        num_items=num_items,
        item_raw_ids=np.arange(num_items, dtype=np.int64),
        user_raw_ids=np.arange(len(rows), dtype=np.int64),
        actions=None if actions is None else np.array(actions, dtype=np.int64),
    )


def _scores(model, histories: List[List[int]], max_seq_len: Optional[int] = None):
    items = torch.tensor([i for h in histories for i in h], dtype=torch.int64)
    lengths = torch.tensor([len(h) for h in histories], dtype=torch.int64)
    timestamps = torch.arange(items.shape[0], dtype=torch.int64)
    scores = model.catalogue_scores(items, lengths, timestamps, max_seq_len)
    assert scores.dtype == torch.float32
    assert scores.shape == (len(histories), model.num_items)
    assert torch.isfinite(scores).all()
    return scores


def _reloaded(model, fresh):
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    buffer.seek(0)
    fresh.load_state_dict(torch.load(buffer))
    return fresh


# popularity 3 2 4 2 1 2; transitions 0->1 (2), 0->2 (1), 3->4 (1), 3->5 (1)
TRANSITION_ROWS = [[0, 1], [0, 1], [0, 2], [2], [2], [2], [3, 4], [3, 5], [5]]


def test_most_popular_scores_event_counts_for_every_user():
    model = MostPopular(6).fit(_dataset(TRANSITION_ROWS, 6))
    scores = _scores(model, [[0], [], [3, 4, 5]])
    assert scores.tolist() == [[3.0, 2.0, 4.0, 2.0, 1.0, 2.0]] * 3


def test_transition_count_beats_popularity():
    model = ItemTransitions(6).fit(_dataset(TRANSITION_ROWS, 6))
    # from 0: item 1 (count 2) above item 2 (count 1, the most popular item); the rest by
    # popularity: 0 (3) > 3 = 5 (2) > 4 (1). Scores are dense ranks, 0 the lowest.
    # from 3: 5 and 4 both count 1, so popularity puts 5 first
    scores = _scores(model, [[0], [4, 0], [3]])
    assert scores.tolist() == [[2, 4, 3, 1, 0, 1], [2, 4, 3, 1, 0, 1], [1, 0, 2, 0, 3, 4]]


def test_transitions_back_off_to_popularity():
    model = ItemTransitions(6).fit(_dataset(TRANSITION_ROWS, 6))
    # 1 was never followed; an empty history has no last item: both rank by popularity
    scores = _scores(model, [[0, 1], []])
    assert scores.tolist() == [[2, 1, 3, 1, 0, 1]] * 2


def test_transitions_store_sparse_counts():
    model = ItemTransitions(6).fit(_dataset(TRANSITION_ROWS, 6))
    assert model.indptr.tolist() == [0, 2, 2, 2, 4, 4, 4]
    assert model.indices.tolist() == [1, 2, 4, 5]
    assert model.values.tolist() == [2.0, 1.0, 1.0, 1.0]


def test_knn_window_counts_pairs_up_to_window_positions_apart():
    rows = [[0, 5, 6, 7, 8, 1, 2]]  # 1 is 5 positions after 0, 2 is 6
    model = ItemKNN(9, window=5).fit(_dataset(rows, 9))
    row = slice(int(model.indptr[0]), int(model.indptr[1]))
    assert model.indices[row].tolist() == [1, 5, 6, 7, 8]
    assert model.values[row].tolist() == [1.0] * 5  # C = 1, n = 1 for every item
    scores = _scores(model, [[0]])[0]
    assert scores[1] > scores[2]  # same popularity: only the window separates them
    wider = ItemKNN(9, window=6).fit(_dataset(rows, 9))
    assert wider.indices[int(wider.indptr[0]) : int(wider.indptr[1])].tolist() == [1, 2, 5, 6, 7, 8]


# sim(0, 2) = 1; sim(1, 3) = sim(1, 5) = 1 / sqrt(2); popularity 1 2 1 1 3 1
RECENCY_ROWS = [[0, 2], [1, 3], [1, 5], [4], [4], [4]]


@pytest.mark.parametrize(
    "kwargs, history, max_seq_len, expected",
    [
        # 2: 0.8 * 1 above 3 = 5: 1 * 0.707 (tied: same popularity); the rest by popularity
        (dict(), [0, 1], None, [0, 1, 4, 3, 2, 3]),
        # decay 0.6 puts 3 and 5 (0.707) above 2 (0.6)
        (dict(decay=0.6), [0, 1], None, [0, 1, 3, 4, 2, 4]),
        # 0 most recent: 2 (1.0) above 3 and 5 (0.8 * 0.707)
        (dict(), [1, 0], None, [0, 1, 4, 3, 2, 3]),
        # only the last item counts: 2 falls back to popularity
        (dict(recent=1), [0, 1], None, [0, 1, 0, 3, 2, 3]),
        (dict(), [0, 1], 1, [0, 1, 0, 3, 2, 3]),
        # empty history: popularity
        (dict(), [], None, [0, 1, 0, 0, 2, 0]),
    ],
)
def test_knn_recency_weighting(kwargs, history, max_seq_len, expected):
    model = ItemKNN(6, **kwargs).fit(_dataset(RECENCY_ROWS, 6))
    assert _scores(model, [history], max_seq_len)[0].tolist() == expected


def test_knn_values_and_exact_back_off():
    # n = 34 1 901 1 4; sim(0, 1) = sim(0, 3) = 1/sqrt(34) = 2/sqrt(34 * 4) = sim(0, 4), and
    # sim(0, 2) = 30/sqrt(34 * 901), 0.06% lower. The rule is lexicographic: popularity only
    # orders equal similarities (4 above 1 and 3), never a lower one above a higher one (2,
    # 900 times as popular, stays below 1 and 3; an additive eps = 1e-3 would lift it).
    rows = [[0, 2]] * 30 + [[0, 1], [0, 3], [0, 4], [0, 4], [4], [4], [2] * 871]
    model = ItemKNN(5).fit(_dataset(rows, 5))
    row = slice(int(model.indptr[0]), int(model.indptr[1]))
    assert model.indices[row].tolist() == [1, 2, 3, 4]
    expected = [1 / math.sqrt(34), 30 / math.sqrt(34 * 901), 1 / math.sqrt(34), 1 / math.sqrt(34)]
    assert model.values[row].tolist() == pytest.approx(expected, rel=1e-6)
    assert _scores(model, [[0]])[0].tolist() == [0, 2, 1, 2, 3]


def _synthetic_split():
    return leave_one_out(load_dataset("synthetic", seed=0, num_users=200))


@pytest.mark.parametrize("build", [MostPopular, ItemTransitions, lambda n: ItemKNN(n, 3, 4, 0.5)])
def test_state_dict_round_trip_restores_scores(build):
    split = _synthetic_split()
    num_items = split.train.num_items
    model = build(num_items).fit(split.train)
    history = split.valid.history
    args = (
        torch.from_numpy(history.item_ids),
        torch.from_numpy(history.lengths),
        torch.from_numpy(history.timestamps),
    )
    fresh = _reloaded(model, build(num_items))
    # also into a module fitted on other data, whose sparse buffers have another size
    refitted = _reloaded(model, build(num_items).fit(history))
    expected = model.catalogue_scores(*args)
    assert torch.isfinite(expected).all()
    for other in (fresh, refitted):
        for name, buffer in model.state_dict().items():
            assert torch.equal(other.state_dict()[name], buffer), name
        assert torch.equal(other.catalogue_scores(*args), expected)


def test_transitions_and_knn_rank_validation_targets_better_than_chance():
    split = _synthetic_split()
    num_items = split.train.num_items
    history = split.valid.history
    targets = torch.from_numpy(split.valid.targets)
    for model in (ItemTransitions(num_items), ItemKNN(num_items)):
        scores = model.fit(split.train).catalogue_scores(
            torch.from_numpy(history.item_ids),
            torch.from_numpy(history.lengths),
            torch.from_numpy(history.timestamps),
        )
        target = scores.gather(1, targets.unsqueeze(1))
        # 0-based rank with ties counted half, as a random tie break would on average
        ranks = (scores > target).sum(1) + 0.5 * ((scores == target).sum(1) - 1)
        assert ranks.mean() < num_items / 4, type(model).__name__


# LIKE on 3 of 5 events (g = 0.6), LONG_VIEW on 1 (g = 0.2); item 3 has no events
RANKING_ROWS = [[0, 0, 1], [1, 2]]
RANKING_ACTIONS = [LIKE | CLICK, LIKE | CLICK, CLICK, LIKE | LONG_VIEW | CLICK, CLICK]


def _logit(p: float) -> float:
    return math.log(p / (1 - p))


def _ranking_features(history_actions: List[int]):
    """User 0: history 0 1 2 with ``history_actions``, candidates 0 and 3; user 1:
    empty history, candidate 2."""
    return {
        "uih.item_id": torch.tensor([0, 1, 2]),
        "uih.sequence_length": torch.tensor([3, 0]),
        "uih_action.sequence": torch.tensor(history_actions),
        "uih_timestamp.sequence": torch.tensor([1, 2, 3]),
        "candidate.item_id": torch.tensor([0, 3, 2]),
        "candidate.sequence_length": torch.tensor([2, 1]),
        "candidate_timestamp.sequence": torch.tensor([4, 5, 6]),
    }


def test_popularity_ranking_smoothed_rates():
    model = PopularityRanking(4, [LIKE, LONG_VIEW], prior_strength=2.0)
    model.fit(_dataset(RANKING_ROWS, 4, RANKING_ACTIONS))
    assert model.global_rates.tolist() == pytest.approx([0.6, 0.2], rel=1e-6)
    # (hits + 2 g) / (events + 2); no events: the global rate
    expected = [[0.8, 0.1], [0.55, 0.35], [0.4, 0.4 / 3], [0.6, 0.2]]
    assert model.item_rates.numpy() == pytest.approx(np.array(expected), rel=1e-6)


def test_popularity_ranking_logits_combine_item_and_user_rates():
    model = PopularityRanking(4, [LIKE, LONG_VIEW], prior_strength=2.0)
    model.fit(_dataset(RANKING_ROWS, 4, RANKING_ACTIONS))
    features = _ranking_features([LIKE, LIKE | LONG_VIEW, CLICK])
    item = [[0.8, 0.1], [0.6, 0.2], [0.4, 0.4 / 3]]
    g = [0.6, 0.2]
    for max_seq_len, user in [(2, [0.55, 0.35]), (3, [3.2 / 5, 1.4 / 5])]:
        logits = model(features, max_seq_len, num_candidates=2)
        assert logits.shape == (3, 2) and logits.dtype == torch.float32
        users = [user, user, g]  # the empty history gets the global rate
        expected = [
            [_logit(item[c][t]) + _logit(users[c][t]) - _logit(g[t]) for t in range(2)]
            for c in range(3)
        ]
        assert logits.numpy() == pytest.approx(np.array(expected), rel=1e-5)


def test_popularity_ranking_constant_bit_gives_finite_logits_and_round_trips():
    train = _dataset(RANKING_ROWS, 4, RANKING_ACTIONS)
    model = PopularityRanking(4, [LIKE, int(Action.FOLLOW), CLICK]).fit(train)
    features = _ranking_features([LIKE, LIKE | LONG_VIEW, CLICK])
    logits = model(features, 3, 2)
    assert torch.isfinite(logits).all()
    fresh = _reloaded(model, PopularityRanking(4, [LIKE, int(Action.FOLLOW), CLICK]))
    assert torch.equal(fresh(features, 3, 2), logits)


def test_invalid_arguments():
    with pytest.raises(ValueError, match="num_items"):
        MostPopular(0)
    with pytest.raises(ValueError, match="window"):
        ItemKNN(5, window=0)
    with pytest.raises(ValueError, match="decay"):
        ItemKNN(5, decay=0.0)
    with pytest.raises(ValueError, match="built for 7 items"):
        ItemTransitions(7).fit(_dataset(TRANSITION_ROWS, 6))
    with pytest.raises(ValueError, match="action"):
        PopularityRanking(6, [LIKE]).fit(_dataset(TRANSITION_ROWS, 6))
    with pytest.raises(ValueError, match="task_bitmasks"):
        PopularityRanking(6, [])
