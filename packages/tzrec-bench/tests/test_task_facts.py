"""The trainer's facts of each task (:mod:`tzrec_bench.train.tasks`), looked up from a
model's record, and the model record's ``shardable`` as ``--sharding torchrec`` reads it."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from tzrec_bench.train import validation
from tzrec_bench.train.config import ConfigError, TrainConfig, metric_names, model_choices
from tzrec_bench.train.ranking import RankingTask
from tzrec_bench.train.retrieval import RetrievalTask
from tzrec_bench.train.tasks import RANKING, RETRIEVAL, facts_of_task, task_facts
from tzrec_gr.models.registry import TASKS, get_model

CPU = torch.device("cpu")


def test_every_task_of_the_registry_has_its_facts():
    assert [facts_of_task(task).name for task in TASKS] == list(TASKS)
    with pytest.raises(ValueError, match=r"^unknown task 'classification'; expected one of "
                       r"retrieval, ranking$"):
        facts_of_task("classification")


def test_a_models_facts_are_those_of_its_records_task():
    for name in model_choices():
        assert task_facts(name) is facts_of_task(get_model(name).task)
        assert TrainConfig(model=name).facts is task_facts(name)
    assert task_facts("sasrec") is RETRIEVAL and task_facts("popularity-ranking") is RANKING


def test_each_task_names_its_trainer_class():
    assert RETRIEVAL.trainer_class() is RetrievalTask
    assert RANKING.trainer_class() is RankingTask


def test_metrics_and_key_metrics():
    assert metric_names("retrieval") == ["hr@10", "hr@50", "hr@200", "ndcg@10", "ndcg@50",
                                         "ndcg@200", "mrr"]
    assert metric_names("ranking") == ["auc", "auc_click", "auc_like", "auc_long_view"]
    assert TrainConfig(model="hstu-retrieval").key_metric == "ndcg@10"
    assert TrainConfig(model="hstu-ranking").key_metric == "auc"
    assert TrainConfig(model="hstu-ranking", metric="auc_like").key_metric == "auc_like"


def test_what_applies_to_each_task():
    assert RETRIEVAL.excludes_seen and RETRIEVAL.eval_negatives and RETRIEVAL.catalogue_softmax
    assert not (RANKING.excludes_seen or RANKING.eval_negatives or RANKING.catalogue_softmax)
    with pytest.raises(ConfigError, match=r"^--eval-negatives: the sampled protocol ranks "
                       r"retrieval targets; hstu-ranking is a ranking model$"):
        TrainConfig(model="hstu-ranking", eval_negatives=10).check()
    TrainConfig(model="sasrec", eval_negatives=10).check()


def test_the_curves_shown():
    reported = {"hr@10": 0.1, "ndcg@10": 0.2, "mrr": 0.3, "count": 5}
    assert RETRIEVAL.plot_metrics("ndcg@10", reported) == ["ndcg@10", "hr@10"]
    assert RETRIEVAL.plot_metrics("hr@10", reported) == ["hr@10"]
    reported = {"auc": 0.6, "auc_click": 0.7, "count": 5}
    assert RANKING.plot_metrics("auc_click", reported) == ["auc", "auc_click"]


def test_the_task_facts_import_without_the_trainers():
    code = ("import sys, tzrec_bench.train.config, tzrec_bench.train.tasks; "
            "print(sorted(m for m in ('tzrec_bench.train.retrieval', "
            "'tzrec_bench.train.ranking') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "[]"


# -- --sharding torchrec asks the model's record ------------------------------------------------


def test_sharding_needs_a_shardable_record_and_names_those_that_are():
    assert [name for name in model_choices() if get_model(name).shardable] == [
        "hstu-retrieval", "hstu-ranking"]
    with pytest.raises(ConfigError, match=r"^--sharding: torchrec shards tzrec-gr's item "
                       r"tables: --model must be one of hstu-retrieval, hstu-ranking, got "
                       r"'sasrec'$"):
        validation.validate(TrainConfig(model="sasrec", sharding="torchrec"), CPU)


def test_only_a_softmax_over_the_catalogue_must_sample_when_sharded(monkeypatch):
    monkeypatch.setattr(validation, "require_torchrec", lambda what: None)
    data = validation.DataSize(num_items=100, train_users=500, world_size=1)
    with pytest.raises(ConfigError, match=r"^--num-negatives: 128 >= the 100 items"):
        validation.validate(TrainConfig(model="hstu-retrieval", sharding="torchrec"), CPU, data)
    validation.validate(TrainConfig(model="hstu-ranking", sharding="torchrec"), CPU, data)


def test_the_backend_line_asks_the_models_record_not_its_name():
    from tzrec_bench.train.run import backend_name

    assert backend_name(TrainConfig(model="sasrec")) == "plain PyTorch (no tzrec-ops)"
    assert backend_name(TrainConfig(model="item-knn")) == "counts (no tzrec-ops)"
    assert backend_name(TrainConfig(model="hstu-retrieval", backend="pytorch")) == (
        "ops backend pytorch"
    )
