"""The trainer's seams: the fitted path (no optimizer), the replicated strategy, the one
validation function and the one payload that checkpoint.pt and best.pt are built from."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tzrec_bench.train import checkpoint, strategies, validation
from tzrec_bench.train.config import ConfigError, TrainConfig
from tzrec_bench.train.distributed import DistContext
from tzrec_bench.train.loop import Trainer, evaluate, train
from tzrec_bench.train.strategies import Replicated, TrainStep

TINY = dict(
    data="synthetic", synthetic_users=48, synthetic_items=120, max_seq_len=16,
    embedding_dim=16, num_layers=1, num_heads=2, num_negatives=16, num_candidates=4,
    batch_size=16, lr=1e-2, eval_batch_size=64, log_every=1, progress=False, plot=False,
)
CPU = torch.device("cpu")


def _config(tmp_path: Path, **overrides) -> TrainConfig:
    return TrainConfig(**{**TINY, "out_dir": str(tmp_path / "run"), **overrides})


def _same(a, b) -> bool:
    """Equal values, tensors compared element by element, containers recursively."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    return a == b


@pytest.mark.parametrize("model", ["most-popular", "popularity-ranking"])
def test_a_fitted_baseline_builds_no_optimizer_and_its_checkpoint_evaluates(
    tmp_path, monkeypatch, model
):
    def refused(*args, **kwargs):
        raise AssertionError("a fitted baseline built an optimizer or a schedule")

    monkeypatch.setattr(torch.optim, "AdamW", refused)
    monkeypatch.setattr(torch.optim.lr_scheduler, "LambdaLR", refused)
    result = train(_config(tmp_path, model=model))
    monkeypatch.undo()
    run = tmp_path / "run"
    saved = checkpoint.load(run / checkpoint.CHECKPOINT)  # every key --resume reads
    assert saved["optimizer"] == {} and saved["scheduler"] == {}
    assert saved["step"] == 0 and result.steps == 0 and result.best_step == 0
    best = checkpoint.load(run / checkpoint.BEST)
    assert set(best["model"]) == set(saved["model"])
    assert evaluate(run / checkpoint.CHECKPOINT) == result.test
    assert evaluate(run) == result.test


def test_checkpoint_and_best_share_one_description(tmp_path):
    train(_config(tmp_path, max_steps=2, eval_every=2))
    run = tmp_path / "run"
    latest = checkpoint.load(run / checkpoint.CHECKPOINT)
    best = checkpoint.load(run / checkpoint.BEST)
    for key in ("config", "model_config", "vocabulary", "run_id"):
        assert key in latest and _same(latest[key], best[key]), key
    assert set(best) == {"format", "config", "model_config", "vocabulary", "run_id", "step",
                         "metrics", "model"}
    assert set(latest) == {"format", "config", "model_config", "vocabulary", "run_id", "step",
                           "world_size", "model", "optimizer", "scheduler", "early_stopping",
                           "history", "rng"}


def test_the_replicated_strategy_on_one_process(tmp_path):
    trainer = Trainer(_config(tmp_path, max_steps=1), DistContext(0, 0, 1, CPU), Replicated)
    strategy = trainer.strategy
    assert isinstance(strategy.module, TrainStep)  # one process: no DDP wrapper
    assert strategy.module.model is trainer.model
    params = list(trainer.model.parameters())
    assert [id(p) for p in strategy.clipped] == [id(p) for p in params]
    assert strategy.scheduled is strategy.optimizer is trainer.scheduler.optimizer
    assert strategy.averaged_over == 1 and strategy.header_lines() == ()
    assert set(strategy.states()) == {"model", "optimizer"}


class _FakeTables:
    """Stands in for torchrec's ShardedTables (not installed here): plain tables, one
    AdamW, and each "folder of shards" one torch.save file."""

    def __init__(self, step_module, config, ctx) -> None:
        self.module = step_module
        self.dense_parameters = list(step_module.parameters())
        self.dense_optimizer = torch.optim.AdamW(self.dense_parameters, lr=config.lr,
                                                 weight_decay=config.weight_decay)
        self.optimizer = self.dense_optimizer

    def describe(self):
        return ["item table (fake)"]

    def save(self, folder: Path, with_optimizer: bool) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        state = {"model": self.module.state_dict()}
        if with_optimizer:
            state["optimizer"] = self.optimizer.state_dict()
        torch.save(state, folder / "shards.pt")

    def load(self, folder: Path, with_optimizer: bool) -> None:
        state = torch.load(folder / "shards.pt", weights_only=True)
        self.module.load_state_dict(state["model"])
        if with_optimizer:
            self.optimizer.load_state_dict(state["optimizer"])


def _consolidate(folder: Path):
    saved = torch.load(folder / "shards.pt", weights_only=True)["model"]
    return {k[len("model."):]: v for k, v in saved.items() if k.startswith("model.")}


def test_the_sharded_strategy_saves_shards_resumes_and_gathers_best(
    tmp_path, monkeypatch, capsys
):
    """The Sharded strategy's files and resume, with torchrec faked: checkpoint.pt names
    its folder of shards and holds no model; the best weights are kept as shards and
    gathered into best.pt at the end; a resumed run continues exactly."""
    monkeypatch.setattr(strategies, "ShardedTables", _FakeTables)
    monkeypatch.setattr(strategies, "consolidate", _consolidate)
    monkeypatch.setattr(strategies.Sharded, "embedding_tables", "plain")
    monkeypatch.setattr(validation, "require_torchrec", lambda feature: None)
    options = dict(sharding="torchrec", eval_every=2, dropout=0.0)
    whole = train(_config(tmp_path, max_steps=4, out_dir=str(tmp_path / "whole"), **options))
    assert "tables sharded by torchrec (auto)" in capsys.readouterr().out
    run = tmp_path / "whole"
    latest = checkpoint.load(run / checkpoint.CHECKPOINT)
    assert latest[checkpoint.SHARDED] == {"folder": strategies.CHECKPOINT_SHARDS}
    assert "model" not in latest and "optimizer" not in latest
    best = checkpoint.load(run / checkpoint.BEST)
    assert best["step"] == whole.best_step and best["metrics"] == whole.valid
    assert _same(best["model"], _consolidate(run / strategies.BEST_SHARDS))

    half = str(tmp_path / "half")
    train(_config(tmp_path, max_steps=2, out_dir=half, **options))
    resumed = train(_config(tmp_path, max_steps=4, out_dir=half, resume=True, **options))
    assert [r["loss"] for r in resumed.history["train"]] == [
        r["loss"] for r in whole.history["train"]]
    assert resumed.test == whole.test


def test_validate_checks_the_batch_size_once_the_data_is_known(tmp_path):
    config = _config(tmp_path, batch_size=64)
    validation.validate(config, CPU)  # no data yet: nothing to compare the batch with
    with pytest.raises(ConfigError, match=r"--batch-size: must be between the number of "
                                          r"processes \(1\) and the training users \(48\)"):
        validation.validate(config, CPU, validation.DataSize(120, 48, 1))
    with pytest.raises(ConfigError, match=r"processes \(2\).*got 1"):
        validation.validate(_config(tmp_path, batch_size=1), CPU,
                            validation.DataSize(120, 48, 2))
    # a fitted baseline reads every training event at once
    validation.validate(_config(tmp_path, model="item-knn", batch_size=64), CPU,
                        validation.DataSize(120, 48, 1))
    # the other checks run too: TrainConfig.check first
    with pytest.raises(ConfigError, match=r"--num-heads: must divide"):
        validation.validate(_config(tmp_path, num_heads=3), CPU)
