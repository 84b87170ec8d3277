"""--eval-negatives: the sampled protocol's draw, its metrics, and its place beside the full
ranking in train, evaluate and run-configs."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from tzrec_bench.cli import main
from tzrec_bench.data import SequenceDataset
from tzrec_bench.train.sampled import SampledMetrics, sampled_negatives

SMALL = [
    "--data", "synthetic", "--synthetic-users", "60", "--synthetic-items", "50",
    "--max-seq-len", "12", "--embedding-dim", "16", "--num-layers", "1",
    "--batch-size", "16", "--device", "cpu", "--no-plot", "--no-progress", "--max-steps", "2",
]


def _sequences(rows):
    lengths = [len(r) for r in rows]
    return SequenceDataset(
        name="t", offsets=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
        item_ids=np.concatenate(rows).astype(np.int64),
        timestamps=np.zeros(sum(lengths), dtype=np.int64), num_items=30,
        item_raw_ids=np.arange(30, dtype=np.int64),
        user_raw_ids=np.arange(len(rows), dtype=np.int64),
    )


def test_negatives_avoid_the_whole_sequence_and_do_not_depend_on_the_batch():
    ds = _sequences([np.arange(25), np.array([3, 4]), np.array([7])])
    drawn = sampled_negatives(ds, np.array([0, 1, 2]), 30, 200, seed=0)
    assert drawn.shape == (3, 200)
    assert set(drawn[0].tolist()) == {25, 26, 27, 28, 29}  # only the 5 items never seen
    assert not np.isin(drawn[1], [3, 4]).any() and not np.isin(drawn[2], [7]).any()
    # row 1's draw is the same alone, in another order, or in another call
    assert np.array_equal(sampled_negatives(ds, np.array([1]), 30, 200, seed=0)[0], drawn[1])
    assert np.array_equal(sampled_negatives(ds, np.array([2, 1]), 30, 200, seed=0)[1],
                          drawn[1])
    assert not np.array_equal(sampled_negatives(ds, np.array([1]), 30, 200, seed=1)[0],
                              drawn[1])
    # uniform over the unseen items: each of the 28 appears about 200 * 50 / 28 times
    many = np.concatenate([sampled_negatives(ds, np.array([1]), 30, 200, seed=s)[0]
                           for s in range(50)])
    counts = np.bincount(many, minlength=30)
    assert counts[[3, 4]].sum() == 0
    unseen = np.delete(counts, [3, 4])
    assert unseen.min() > 0.6 * unseen.mean() and unseen.max() < 1.4 * unseen.mean()
    with pytest.raises(ValueError, match="interacted with every item"):
        sampled_negatives(_sequences([np.arange(30)]), np.array([0]), 30, 5, seed=0)


@pytest.mark.parametrize("negatives", [100, 9, 20])
def test_a_constant_scorer_gets_the_expected_sampled_hit_rate(negatives):
    metrics = SampledMetrics(torch.device("cpu"))
    metrics.update(torch.zeros(7), torch.zeros(7, negatives))
    result = metrics.compute()
    assert result["sampled_hr@10"] == pytest.approx(min(10 / (negatives + 1), 1.0))
    # a scorer that puts the target first is perfect; last, misses unless N < 10
    metrics = SampledMetrics(torch.device("cpu"))
    metrics.update(torch.ones(3), torch.zeros(3, negatives))
    assert metrics.compute()["sampled_ndcg@10"] == pytest.approx(1.0)


def test_train_and_evaluate_report_both_protocols(tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["train", *SMALL, "--eval-negatives", "20", "--out-dir", str(run)]) == 0
    out = capsys.readouterr().out
    assert "sampled_hr@10" in out and "hr@10" in out
    test = json.loads((run / "metrics.json").read_text())["test"]
    assert {"hr@10", "ndcg@10", "sampled_hr@10", "sampled_ndcg@10", "sampled_mrr"} <= set(test)
    assert test["sampled_hr@10"] >= test["hr@10"]  # 21 candidates against 50 items
    assert main(["evaluate", str(run), "--eval-negatives", "20"]) == 0
    assert f"{test['sampled_hr@10']:.4f}" in capsys.readouterr().out  # the same draw
    with pytest.raises(SystemExit):
        main(["train", *SMALL, "--model", "hstu-ranking", "--eval-negatives", "20",
              "--out-dir", str(tmp_path / "ranking")])
    assert "--eval-negatives: the sampled protocol ranks retrieval targets" in (
        capsys.readouterr().err)


def test_settings_that_the_options_do_not_apply_to_are_refused():
    from tzrec_bench.train.config import ConfigError, TrainConfig

    with pytest.raises(ConfigError, match=r"^--eval-negatives: not with --sharding torchrec"):
        TrainConfig(eval_negatives=100, sharding="torchrec").check()
    with pytest.raises(ConfigError, match=r"^--min-events: the synthetic data set is generated"):
        TrainConfig(min_events=5).check()
    with pytest.raises(ConfigError, match=r"^--columns: ml-100k has its own format"):
        TrainConfig(data="ml-100k", columns="user=u").check()
