"""Where the ranking task places each user's candidates during training."""

from __future__ import annotations

import numpy as np
import torch

from tzrec_bench.train.config import TrainConfig
from tzrec_bench.train.distributed import DistContext
from tzrec_bench.train.factory import make_task
from tzrec_bench.train.loop import load_data
from tzrec_gr.features import CANDIDATE_ITEM_ID, CANDIDATE_LENGTHS, UIH_ITEM_ID, UIH_LENGTHS


def _task(tmp_path, **overrides):
    config = TrainConfig(
        model="hstu-ranking", data="synthetic", synthetic_users=40, synthetic_items=60,
        max_seq_len=6, num_candidates=3, device="cpu", out_dir=str(tmp_path / "run"),
        **overrides,
    )
    ctx = DistContext(0, 0, 1, torch.device("cpu"))
    return make_task(config, load_data(config, ctx), ctx)


def _windows(task, rows, step):
    """Each row's (history ids, candidate ids) in the batch of ``step``."""
    features = task.batch(rows, step)["features"]
    hist = torch.split(features[UIH_ITEM_ID], features[UIH_LENGTHS].tolist())
    cand = torch.split(features[CANDIDATE_ITEM_ID], features[CANDIDATE_LENGTHS].tolist())
    return [(h.tolist(), c.tolist()) for h, c in zip(hist, cand)]


def test_candidates_follow_their_history_inside_the_users_row(tmp_path):
    task = _task(tmp_path)
    train = task.split.train
    rows = task.train_rows
    for step in range(5):
        for row, (history, candidates) in zip(rows, _windows(task, rows, step)):
            events = train.item_ids[train.offsets[row] : train.offsets[row + 1]].tolist()
            assert len(candidates) == min(3, len(events) - 1)
            assert 1 <= len(history) <= 6
            # history then candidates: consecutive events of the user's row
            joined = history + candidates
            starts = [s for s in range(len(events) - len(joined) + 1)
                      if events[s : s + len(joined)] == joined]
            assert starts, (row, step)


def test_every_event_after_the_first_is_a_candidate_over_the_steps(tmp_path):
    task = _task(tmp_path)
    train = task.split.train
    lengths = train.lengths[task.train_rows]
    row = int(task.train_rows[np.argmin(np.abs(lengths - 20))])  # 17 places for 3 candidates
    length = int(train.lengths[row])
    assert length > 10
    placed = set()
    for step in range(600):
        starts, _ = task._windows(np.array([row]), step)
        placed.add(int(starts[0]))
    # the first candidate starts anywhere from the second event to the last full window
    assert placed == set(range(1, length - 3 + 1))


def test_a_users_window_depends_on_seed_step_and_user_only(tmp_path):
    task = _task(tmp_path)
    rows = task.train_rows
    alone = [task._windows(np.array([r]), 7)[0][0] for r in rows[:8]]
    together = task._windows(rows[:8], 7)[0]
    assert list(together) == alone  # the same in any batch (and on any rank)
    assert not np.array_equal(task._windows(rows, 8)[0], task._windows(rows, 7)[0])
    other_seed = _task(tmp_path, seed=1)
    assert not np.array_equal(other_seed._windows(rows, 7)[0], task._windows(rows, 7)[0])
