"""The training loop on tiny synthetic runs: learning, reports, resume, early stopping, DDP."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tzrec_bench.train import checkpoint
from tzrec_bench.train.config import ConfigError, TrainConfig
from tzrec_bench.train.loop import evaluate, train

ML_100K = Path(__file__).resolve().parents[3].parent / "shared" / "data" / "ml-100k"

# small enough for about a second per run on two CPU cores
TINY = dict(
    data="synthetic", synthetic_users=48, synthetic_items=120, max_seq_len=16,
    embedding_dim=16, num_layers=1, num_heads=2, num_negatives=16, num_candidates=4,
    batch_size=16, lr=1e-2, eval_batch_size=64, log_every=1, progress=False, plot=False,
)


def _config(tmp_path: Path, **overrides) -> TrainConfig:
    return TrainConfig(**{**TINY, "out_dir": str(tmp_path / "run"), **overrides})


def _state(run_dir: Path) -> dict:
    return checkpoint.load(run_dir / checkpoint.CHECKPOINT)["model"]


@pytest.mark.parametrize("model", ["hstu-retrieval", "sasrec", "hstu-ranking"])
def test_loss_decreases_and_the_metrics_table_is_printed(tmp_path, capsys, model):
    result = train(_config(tmp_path, model=model, max_steps=12, dropout=0.0))
    losses = [r["loss"] for r in result.history["train"]]
    assert len(losses) == 12 and all(map(torch.isfinite, torch.tensor(losses)))
    assert sum(losses[-3:]) < sum(losses[:3])
    out = capsys.readouterr().out
    lines = [line.split() for line in out.splitlines()]
    assert f"tzrec-bench train: {model} on synthetic" in out
    assert ["metric", "valid", "(step", "12)", "test"] in lines
    assert "tokens/s" in out
    key = "ndcg@10" if model != "hstu-ranking" else "auc"
    assert any(cells[:1] == [key] and len(cells) == 3 for cells in lines)
    summary = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert summary["steps"] == 12 and 0.0 <= summary["test"][key] <= 1.0
    assert set(summary["test"]) == set(result.test)


@pytest.mark.parametrize("model", ["hstu-retrieval", "hstu-ranking"])
def test_checkpoints_rebuild_the_model_without_tzrec_bench(tmp_path, model):
    """The checkpoint names the model's class and constructor arguments (``model_config``):
    tzrec-acc rebuilds the trained model from it alone."""
    from tzrec_acc.checkpoint import load_model

    train(_config(tmp_path, model=model, max_steps=2))
    best = checkpoint.load(tmp_path / "run" / checkpoint.BEST)
    assert best["model_config"]["kwargs"]["max_seq_len" if model == "hstu-retrieval"
                                          else "max_uih_len"] == TINY["max_seq_len"]
    rebuilt = load_model(tmp_path / "run" / checkpoint.BEST).state_dict()
    assert rebuilt.keys() == best["model"].keys()
    assert all(torch.equal(rebuilt[k], best["model"][k].cpu()) for k in rebuilt)


def test_the_plot_is_written_or_skipped_with_the_extra_to_install(tmp_path, capsys, monkeypatch):
    pytest.importorskip("matplotlib")
    train(_config(tmp_path, max_steps=2, plot=True))
    png = tmp_path / "run" / "curves.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    train(_config(tmp_path, max_steps=2, plot=True, out_dir=str(tmp_path / "bare")))
    assert "plot skipped: the training-curve plot needs the optional dependency matplotlib" \
        in capsys.readouterr().out
    assert not (tmp_path / "bare" / "curves.png").exists()


def test_resume_continues_exactly_where_the_checkpoint_left_off(tmp_path, capsys):
    # dropout on: the resumed run must restore the RNG, not only weights and optimizer
    options = dict(dropout=0.2, eval_every=3, warmup_steps=4)
    train(_config(tmp_path, max_steps=6, out_dir=str(tmp_path / "whole"), **options))
    half = str(tmp_path / "halves")
    train(_config(tmp_path, max_steps=3, out_dir=half, **options))
    capsys.readouterr()
    resumed = train(_config(tmp_path, max_steps=6, out_dir=half, resume=True, **options))
    assert resumed.steps == 6
    # the throughput lines count the 3 steps this process trained, not the earlier ones
    out = capsys.readouterr().out
    assert "trained 3 steps in" in out
    assert "after the first log window (compiles, warm-up): 2 steps" in out
    whole, halves = _state(tmp_path / "whole"), _state(Path(half))
    for name, value in whole.items():
        assert torch.equal(value, halves[name]), name
    with pytest.raises(ConfigError, match=r"--resume: cannot resume .*--batch-size is 8 here"):
        train(_config(tmp_path, max_steps=6, out_dir=half, resume=True, batch_size=8, **options))


def test_early_stopping_ends_the_run_after_patience_evaluations(tmp_path, capsys):
    # no gain can reach min_delta: the first evaluation is the best, then two more end it
    result = train(_config(tmp_path, max_steps=40, eval_every=2, patience=2, min_delta=1.0))
    assert result.stopped_early and result.steps == 6 and result.best_step == 2
    assert "early stopping at step 6" in capsys.readouterr().out


def test_evaluate_reproduces_the_test_metrics_of_the_best_weights(tmp_path, capsys):
    result = train(_config(tmp_path, max_steps=4, eval_every=2))
    again = evaluate(tmp_path / "run", "test")
    assert again == pytest.approx(result.test)
    assert "test" in capsys.readouterr().out


def test_the_batch_size_must_fit_the_training_users(tmp_path):
    with pytest.raises(ConfigError, match=r"--batch-size: .* training users \(48\); got 64"):
        train(_config(tmp_path, batch_size=64))


def test_two_gloo_processes_train_like_one(tmp_path):
    """``torchrun --nproc-per-node 2`` against one process on the same global batches.

    With dropout off (each rank draws its own masks), both runs see the same global batches
    and the same negatives, and each rank's loss is weighted so that DDP's gradient average
    is the gradient of the global-batch mean. What remains is float rounding: the gradient
    is summed in two halves, and each process has one thread instead of two, so losses and
    weights differ in the last bits (measured: 4e-7 relative in the loss, 3e-7 absolute in
    the weights; the tolerances below are 30 times that or more). A target's rank can
    change only where an item scores within that margin of it, so the metrics came out
    equal; their tolerance leaves room for one changed rank among the 48 users (1 / 48).
    """
    options = dict(max_steps=6, eval_every=3, dropout=0.0)
    one = train(_config(tmp_path, out_dir=str(tmp_path / "one"), **options))
    args = [
        "--data", "synthetic", "--max-steps", "6", "--eval-every", "3", "--dropout", "0",
        "--out-dir", str(tmp_path / "two"), "--no-progress", "--no-plot",
    ]
    for field in ("synthetic_users", "synthetic_items", "max_seq_len", "embedding_dim",
                  "num_layers", "num_heads", "num_negatives", "batch_size", "lr",
                  "eval_batch_size", "log_every"):
        args += ["--" + field.replace("_", "-"), str(TINY[field])]
    run = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
         "2", "-m", "tzrec_bench", "train", *args],
        capture_output=True, text=True, timeout=240,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    assert "2 processes" in run.stdout
    two = json.loads((tmp_path / "two" / "metrics.json").read_text())
    history = json.loads((tmp_path / "two" / "history.json").read_text())
    torch.testing.assert_close(
        torch.tensor([r["loss"] for r in history["train"]]),
        torch.tensor([r["loss"] for r in one.history["train"]]), rtol=1e-4, atol=1e-5,
    )
    for split, metrics in (("valid", one.valid), ("test", one.test)):
        for name, value in metrics.items():
            assert two[split][name] == pytest.approx(value, abs=0.021), (split, name)
    for name, value in _state(tmp_path / "one").items():
        torch.testing.assert_close(_state(tmp_path / "two")[name], value, rtol=1e-4, atol=1e-5)


@pytest.mark.skipif(not ML_100K.is_dir(), reason=f"MovieLens 100K is not at {ML_100K}")
def test_ml_100k_smoke(tmp_path):
    result = train(
        _config(tmp_path, data="ml-100k", data_dir=str(ML_100K), cache_dir=str(tmp_path),
                max_steps=3, batch_size=64, max_seq_len=50, eval_users=200)
    )
    assert result.steps == 3 and result.test["count"] == 943
    assert 0.0 <= result.test["ndcg@10"] <= 1.0


def test_steady_state_throughput_leaves_out_the_first_log_window():
    from tzrec_bench.train.report import steady_state

    first = {"step": 10, "seconds": 50.0, "tokens": 1000, "samples": 10}  # compiles
    later = [
        {"step": 20, "seconds": 1.0, "tokens": 3000, "samples": 30},
        {"step": 30, "seconds": 4.0, "tokens": 3000, "samples": 30},  # a late compile
        {"step": 40, "seconds": 1.0, "tokens": 3000, "samples": 30},
    ]
    line = steady_state([first, *later])
    assert line == (
        "after the first log window (compiles, warm-up): 30 steps, 3.0k tokens/s, "
        "30 samples/s (median of 3 windows; mean 1.5k tokens/s)"
    )
    assert steady_state([first]) is None


def test_placement_names_every_gpu_of_a_run():
    from tzrec_bench.train.distributed import DistContext

    assert DistContext(0, 0, 1, torch.device("cuda", 0)).placement == "cuda:0, 1 process"
    assert DistContext(0, 0, 2, torch.device("cuda", 0)).placement == "cuda:0-1, 2 processes"
    assert DistContext(1, 1, 2, torch.device("cpu")).placement == "cpu, 2 processes"


def test_nccl_group_is_bound_to_the_local_gpu(monkeypatch):
    """Without ``device_id`` NCCL guesses the GPU from the global rank at the first barrier
    (a warning, and a hang where ranks and GPUs do not line up)."""
    from tzrec_bench.train import distributed

    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: calls.append(("set", device)))
    monkeypatch.setattr(distributed.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(distributed.dist, "init_process_group",
                        lambda backend, **kw: calls.append((backend, kw)))
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")
    ctx = distributed.init_distributed("cuda")
    gpu = torch.device("cuda", 1)
    assert ctx.device == gpu and ctx.owns_group
    assert calls == [("set", gpu), ("nccl", {"device_id": gpu})]
