"""The training progress bar: the expected run, with the step guard only as a cap.

While early stopping can still end the run the bar has no total, no fill and no ETA: it
shows the steps so far, the cap as text and the validations without gain. Once the run's
length is fixed (patience 0, or too few validations left for early stopping to end it
before the cap) it is the usual ``n/total`` bar with an ETA.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import List

import pytest

from tzrec_bench.train.config import TrainConfig
from tzrec_bench.train.loop import train
from tzrec_bench.train.report import open_ended_progress

TINY = dict(
    data="synthetic", synthetic_users=48, synthetic_items=120, max_seq_len=16,
    embedding_dim=16, num_layers=1, num_heads=2, num_negatives=16, batch_size=16, lr=1e-2,
    eval_batch_size=64, log_every=1, plot=False, progress=True,
)


def _frames(tmp_path: Path, capsys, **settings) -> List[str]:
    """Every frame the bar drew (on stderr) during a tiny run with ``settings``."""
    capsys.readouterr()
    train(TrainConfig(**{**TINY, "out_dir": str(tmp_path / "run"), **settings}))
    err = capsys.readouterr().err
    return [frame.strip() for frame in re.split(r"[\r\n]", err) if frame.strip()]


@pytest.mark.parametrize(
    ("step", "total", "eval_every", "patience", "bad", "open_ended"),
    [
        (0, 3000, 3, 5, 0, True),  # the demo: 200 epochs of 15 steps as a guard
        (0, 100, 10, 0, 0, False),  # patience 0 never stops
        (0, 12, 3, 5, 0, False),  # validations at steps 3, 6, 9: too few to stop before 12
        (0, 12, 3, 3, 0, True),  # three without gain stop the run at step 9
        (3, 12, 3, 3, 0, False),  # two validations left before 12, three needed
        (3, 12, 3, 3, 1, True),  # two left, two needed
        (0, 4, 10, 1, 0, False),  # no validation before the last step
    ],
)
def test_the_bar_is_open_ended_while_early_stopping_can_end_the_run(
    step, total, eval_every, patience, bad, open_ended
):
    layout = open_ended_progress(step, total, eval_every, patience, bad)
    assert (layout is not None) == open_ended
    if open_ended:
        assert f"steps of at most {total} " in layout
        assert f"{bad}/{patience} validations without gain" in layout
        assert "{remaining}" not in layout and "{total_fmt}" not in layout  # no ETA


def test_an_early_stopped_run_shows_no_total_and_the_cap_as_text(tmp_path, capsys):
    """min_delta 1 makes every validation after the first one without gain: patience 1 ends
    the run at step 4 of a guard of 60."""
    frames = _frames(tmp_path, capsys, max_steps=60, eval_every=2, patience=1, min_delta=1.0)
    bar = [f for f in frames if f.startswith("hstu-retrieval: ")]
    assert bar[0].startswith("hstu-retrieval: 0 steps of at most 60 (early stopping: 0/1 ")
    assert bar[-1].startswith("hstu-retrieval: 4 steps of at most 60 (early stopping: 1/1 ")
    assert not any("/60" in frame or "%|" in frame for frame in bar)


def test_the_bar_gets_its_total_once_early_stopping_cannot_end_the_run(tmp_path, capsys):
    """6 steps, validation every 2, patience 2: open-ended until the validation at step 2
    (a gain), after which one validation is left before step 6 and two would be needed."""
    frames = _frames(tmp_path, capsys, max_steps=6, eval_every=2, patience=2, min_delta=1.0)
    bar = [f for f in frames if f.startswith("hstu-retrieval: ")]
    assert bar[0].startswith("hstu-retrieval: 0 steps of at most 6 (early stopping: 0/2 ")
    assert "2/6 [" in next(f for f in bar if "%|" in f)
    assert "6/6 [" in bar[-1] and "<00:00" in bar[-1]


def test_a_run_of_fixed_length_shows_the_exact_total_and_an_eta(tmp_path, capsys):
    bar = [f for f in _frames(tmp_path, capsys, max_steps=4, patience=0)
           if f.startswith("hstu-retrieval: ")]
    assert "0/4 [" in bar[0] and "4/4 [" in bar[-1]
    assert not any("at most" in frame for frame in bar)
