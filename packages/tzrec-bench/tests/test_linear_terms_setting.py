"""``--linear-terms`` (``linear_terms`` of a config): hstu-ranking built, saved and rebuilt
with the head's first-order terms; a model without the option refuses it."""

from __future__ import annotations

import json

import pytest
import torch

from tzrec_bench.cli import main
from tzrec_bench.train import checkpoint
from tzrec_bench.train.config import ConfigError, TrainConfig
from tzrec_bench.train.factory import model_config

TINY = [
    "--model", "hstu-ranking", "--synthetic-users", "24", "--synthetic-items", "60",
    "--max-seq-len", "16", "--embedding-dim", "16", "--num-layers", "1", "--num-candidates",
    "4", "--batch-size", "8", "--no-progress", "--no-plot",
]


def test_the_setting_reaches_the_model_and_defaults_to_off():
    ranking = TrainConfig(model="hstu-ranking")
    assert model_config(ranking, 20, (2, 4))["kwargs"]["linear_terms"] is False
    kwargs = model_config(ranking.replaced(linear_terms=True), 20, (2, 4))["kwargs"]
    assert kwargs["linear_terms"] is True


def test_train_and_evaluate_with_the_terms(tmp_path, capsys):
    run = tmp_path / "run"
    argv = ["train", *TINY, "--linear-terms", "--max-steps", "2", "--out-dir", str(run)]
    assert main(argv) == 0
    saved = json.loads((run / "metrics.json").read_text())["test"]
    best = torch.load(run / checkpoint.BEST, map_location="cpu", weights_only=False)
    assert best["model_config"]["kwargs"]["linear_terms"] is True
    assert "first_order.weight" in best["model"]
    capsys.readouterr()
    # evaluate rebuilds the model from the checkpoint's arguments (a strict state load)
    assert main(["evaluate", str(run), "--split", "test"]) == 0
    assert f"{saved['auc']:.4f}" in capsys.readouterr().out


def test_a_model_without_the_terms_refuses_the_setting(tmp_path, capsys):
    with pytest.raises(ConfigError, match="--linear-terms: hstu-retrieval has no head"):
        TrainConfig(model="hstu-retrieval", linear_terms=True).check()
    with pytest.raises(SystemExit) as exc:
        main(["train", "--model", "sasrec", "--linear-terms", "--out-dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert exc.value.code == 2
    assert "sasrec has no head to add linear terms to" in err and "--linear-terms" in err
