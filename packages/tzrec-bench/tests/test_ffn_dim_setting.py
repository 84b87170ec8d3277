"""``--ffn-dim`` (``ffn_dim`` of a config): hstu-retrieval built, saved and evaluated with a
feed-forward block after each layer's attention; a model without one refuses it."""

from __future__ import annotations

import json

import pytest

from tzrec_bench.cli import main
from tzrec_bench.train.config import TrainConfig
from tzrec_bench.train.factory import model_config

TINY = [
    "--synthetic-users", "40", "--synthetic-items", "100", "--max-seq-len", "12",
    "--embedding-dim", "16", "--num-layers", "1", "--num-negatives", "16", "--batch-size", "16",
    "--no-progress", "--no-plot",
]


def test_the_setting_reaches_the_model_and_defaults_to_none():
    assert model_config(TrainConfig(), 20)["kwargs"]["ffn_dim"] == 0
    assert model_config(TrainConfig(ffn_dim=32), 20)["kwargs"]["ffn_dim"] == 32


def test_train_and_evaluate_with_the_block(tmp_path, capsys):
    run = tmp_path / "run"
    argv = ["train", *TINY, "--ffn-dim", "32", "--max-steps", "2", "--out-dir", str(run)]
    assert main(argv) == 0
    saved = json.loads((run / "metrics.json").read_text())["test"]
    capsys.readouterr()
    # evaluate rebuilds the model from the checkpoint's arguments (a strict state load)
    assert main(["evaluate", str(run), "--split", "test"]) == 0
    assert f"{saved['hr@10']:.4f}" in capsys.readouterr().out


def test_a_model_without_the_block_refuses_the_setting(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["train", *TINY, "--model", "sasrec", "--ffn-dim", "32",
              "--out-dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert exc.value.code == 2
    assert "sasrec has no feed-forward block" in err and "--ffn-dim" in err
