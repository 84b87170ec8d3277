"""The training loop on tiny synthetic runs: learning, reports, resume, early stopping, DDP."""

from __future__ import annotations

import json
import math
import signal
import sys
from pathlib import Path

import pytest
import torch
from _torchrun import torchrun_train

from tzrec_bench.train import checkpoint
from tzrec_bench.train.config import ConfigError, TrainConfig
from tzrec_bench.train.interrupts import deferred_interrupts
from tzrec_bench.train.loop import evaluate, train
from tzrec_bench.train.metrics import NonFiniteError
from tzrec_bench.train.retrieval import RetrievalTask, step_negatives

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


def test_a_nan_loss_stops_the_run_naming_its_step(tmp_path, monkeypatch):
    """The loss is NaN at step 4 alone (its NaN gradients then spoil every later step); the
    check reads the device flag at the next log step, 5, and names step 4, the first."""
    original, calls = RetrievalTask.loss, []

    def loss(self, model, batch):
        calls.append(len(calls) + 1)
        value = original(self, model, batch)
        return value * math.nan if len(calls) == 4 else value

    monkeypatch.setattr(RetrievalTask, "loss", loss)
    with pytest.raises(NonFiniteError, match=r"NaN or infinite at step 4: the run diverged"):
        train(_config(tmp_path, max_steps=12, log_every=5, eval_every=6))
    assert calls == [1, 2, 3, 4, 5]
    assert not (tmp_path / "run" / "metrics.json").exists()


def test_negatives_are_the_whole_catalogue_from_its_size_on(tmp_path):
    drawn = step_negatives(3, 7, 50, 49)
    assert drawn.shape == (49,) and drawn.dtype == torch.int64
    assert 0 <= int(drawn.min()) and int(drawn.max()) < 50
    assert torch.equal(drawn, step_negatives(3, 7, 50, 49))  # the same on every rank
    assert not torch.equal(drawn, step_negatives(3, 8, 50, 49))  # another step, others
    # a run with more negatives than items trains on the full softmax
    from tzrec_bench.train.distributed import DistContext
    from tzrec_bench.train.factory import make_task
    from tzrec_bench.train.loop import load_data

    config = _config(tmp_path, num_negatives=500, max_steps=3, dropout=0.0)
    ctx = DistContext(0, 0, 1, torch.device("cpu"))
    task = make_task(config, load_data(config, ctx), ctx)
    batch = task.batch(task.train_rows[:4], step=2)
    assert task.num_items < 500
    assert "negatives" not in batch  # the model's full softmax, over its whole table
    losses = [r["loss"] for r in train(config).history["train"]]
    assert len(losses) == 3 and all(map(math.isfinite, losses))


def test_excluding_seen_items_only_helps_most_popular(tmp_path):
    """MostPopular's ranking is the same for everyone, so a user's already-seen popular items
    push the target down; with --exclude-seen they are left out (deterministic counts)."""
    small = dict(synthetic_users=60, synthetic_items=50, max_seq_len=12, model="most-popular")
    plain = train(_config(tmp_path, **small, out_dir=str(tmp_path / "plain")))
    unseen = train(_config(tmp_path, **small, exclude_seen=True, out_dir=str(tmp_path / "x")))
    assert plain.steps == unseen.steps == 0  # fitted, not trained
    for metric in ("hr@10", "ndcg@10", "mrr"):
        assert unseen.test[metric] >= plain.test[metric], metric
    assert unseen.test["hr@10"] > plain.test["hr@10"]  # 0.56 against 0.47 when written
    assert unseen.test["count"] == plain.test["count"] == 60


def test_the_plot_marks_the_step_of_the_best_weights(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    figures = []
    save = Figure.savefig

    def savefig(self, *args, **kwargs):
        figures.append(self)
        return save(self, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", savefig)
    from tzrec_bench.train.plot import plot_curves

    history = {
        "train": [{"step": s, "loss": 2.0 / s} for s in range(1, 7)],
        "valid": [{"step": 3, "ndcg@10": 0.3}, {"step": 6, "ndcg@10": 0.2}],
    }
    path = plot_curves(history, ["ndcg@10"], tmp_path / "c.png", "t", best_step=3)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (figure,) = figures
    for ax in figure.axes:  # the loss panel and the validation panel
        marks = [line for line in ax.get_lines() if list(line.get_xdata()) == [3, 3]]
        assert [line.get_label() for line in marks] == ["best weights (step 3)"]
        assert "best weights (step 3)" in [t.get_text() for t in ax.get_legend().get_texts()]
    plot_curves(history, ["ndcg@10"], tmp_path / "d.png", "t")  # no mark, no loss legend
    assert figures[1].axes[0].get_legend() is None


def test_ctrl_c_sets_a_flag_and_a_second_one_raises():
    before = signal.getsignal(signal.SIGINT)
    with deferred_interrupts(True) as interrupted:
        assert interrupted == [False]
        signal.raise_signal(signal.SIGINT)
        assert interrupted == [True]
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)
    assert signal.getsignal(signal.SIGINT) is before
    with deferred_interrupts(False) as interrupted:  # off: Ctrl-C keeps its meaning
        assert signal.getsignal(signal.SIGINT) is before


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
    run = torchrun_train(TINY, "--data", "synthetic", "--max-steps", "6", "--eval-every", "3",
                         "--dropout", "0", "--out-dir", str(tmp_path / "two"),
                         "--no-progress", "--no-plot")
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


@pytest.mark.parametrize(
    "overrides,message",
    [
        ({"sharding": "fsdp"}, r"--sharding: expected one of replicate, torchrec; got 'fsdp'"),
        ({"sharding_type": "column_wise"}, r"--sharding-type: expected one of auto, row_wise, "),
        ({"table_optimizer": "lamb"}, r"--table-optimizer: expected one of rowwise-adagrad"),
        ({"storage_reservation": 1.0}, r"--storage-reservation: must be in \[0, 1\)"),
    ],
)
def test_sharding_settings_out_of_range_name_their_option(tmp_path, overrides, message):
    with pytest.raises(ConfigError, match=message):
        _config(tmp_path, **overrides).check()


def test_sharding_without_torchrec_fails_before_training_naming_the_extra(tmp_path, monkeypatch):
    from tzrec_bench.train import validation

    def missing(feature):
        raise ImportError(f"{feature} needs the optional dependency torchrec, which is not "
                          "installed: pip install 'tzrec-bench[torchrec]'")

    monkeypatch.setattr(validation, "require_torchrec", missing)
    with pytest.raises(ConfigError, match=r"--sharding: --sharding torchrec needs .* "
                                          r"pip install 'tzrec-bench\[torchrec\]'"):
        train(_config(tmp_path, sharding="torchrec"))
    assert not (tmp_path / "run").exists()  # nothing was trained or written


def test_the_report_says_whether_seen_items_were_excluded(tmp_path, capsys):
    """Retrieval ranks each target among the whole catalogue unless --exclude-seen: the
    printed table (train and evaluate) states the rule, and metrics.json records it;
    ranking ranks no catalogue and says nothing of it."""
    from tzrec_bench.train.report import seen_items_rule

    assert TrainConfig().exclude_seen is False
    for exclude in (False, True):
        run = tmp_path / f"exclude-{exclude}"
        train(_config(tmp_path, out_dir=str(run), max_steps=1, exclude_seen=exclude))
        rule = seen_items_rule(exclude)
        assert rule.startswith("seen items: excluded (" if exclude
                               else "seen items: not excluded (")
        lines = capsys.readouterr().out.splitlines()
        assert lines.count(rule) == 1
        assert len(lines[lines.index(rule) - 1].split()) == 3  # under the table's last row
        assert json.loads((run / "metrics.json").read_text())["exclude_seen"] is exclude
        evaluate(run)
        lines = capsys.readouterr().out.splitlines()
        assert lines[-1] == rule and len(lines[-2].split()) == 2
    run = tmp_path / "ranking"
    train(_config(tmp_path, out_dir=str(run), model="hstu-ranking", max_steps=1))
    assert "seen items" not in capsys.readouterr().out
    assert "exclude_seen" not in json.loads((run / "metrics.json").read_text())
