"""``--ema-decay``: the average's arithmetic against a float64 hand computation, training left
untouched, validation, best.pt and the test on the averaged weights, resume, the refusals."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from _torchrun import torchrun_train
from torch import nn

from tzrec_bench.cli import main
from tzrec_bench.train import checkpoint
from tzrec_bench.train.averaging import WeightAverage, decay_at
from tzrec_bench.train.config import ConfigError, TrainConfig
from tzrec_bench.train.loop import evaluate, train

# test_trainer.py's tiny run: about a second per run on two CPU cores
TINY = dict(
    data="synthetic", synthetic_users=48, synthetic_items=120, max_seq_len=16,
    embedding_dim=16, num_layers=1, num_heads=2, num_negatives=16, num_candidates=4,
    batch_size=16, lr=1e-2, eval_batch_size=64, log_every=1, progress=False, plot=False,
)


def _config(out_dir: Path, **overrides) -> TrainConfig:
    return TrainConfig(**{**TINY, "out_dir": str(out_dir), **overrides})


def test_the_decay_warms_up_then_stays():
    assert decay_at(0.999, 0) == pytest.approx(0.1)
    assert decay_at(0.999, 8) == pytest.approx(0.5)
    assert decay_at(0.999, 8990) == pytest.approx(8991 / 9000)
    assert decay_at(0.999, 9000) == 0.999
    assert decay_at(0.5, 100) == 0.5


def test_the_average_is_the_hand_computed_one_in_float64():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4)).double()
    average = WeightAverage(model, 0.8)
    expected = {n: p.detach().clone() for n, p in model.named_parameters()}
    for step in range(12):  # the warm-up (0.1 ... 0.7) and the decay itself (0.8)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p))
        average.update(step)
        d = min(0.8, (1 + step) / (10 + step))
        for name, p in model.named_parameters():
            expected[name] = d * expected[name] + (1 - d) * p.detach()
    # float64: lerp and the hand formula round differently, by a few units of 1e-16
    for name, value in average.state_dict().items():
        assert value.dtype == torch.float64
        torch.testing.assert_close(value, expected[name], rtol=1e-13, atol=1e-14)


def test_applied_swaps_the_weights_in_place_and_back():
    model = nn.Linear(3, 2)
    average = WeightAverage(model, 0.5)
    with torch.no_grad():
        model.weight.add_(1.0)
    average.update(100)  # decay 0.5: half-way
    live = {n: p.detach().clone() for n, p in model.named_parameters()}
    pointers = [p.data_ptr() for p in model.parameters()]
    with average.applied():
        for name, p in model.named_parameters():
            assert torch.equal(p, average.state_dict()[name])
    assert [p.data_ptr() for p in model.parameters()] == pointers
    for name, p in model.named_parameters():
        assert torch.equal(p, live[name])
    assert torch.allclose(average.state_dict()["weight"], live["weight"] - 0.5)


def test_the_trainer_keeps_float32_averages_under_bf16_autocast(tmp_path):
    from tzrec_bench.train.distributed import init_distributed
    from tzrec_bench.train.loop import Trainer
    from tzrec_bench.train.strategies import Replicated

    config = _config(tmp_path / "run", model="hstu-ranking", ema_decay=0.9, amp="bf16")
    trainer = Trainer(config, init_distributed("cpu"), Replicated)
    trainer.train_step(trainer.global_rows(0))
    averages = trainer.average.state_dict()
    assert averages and all(a.dtype == torch.float32 for a in averages.values())


@pytest.mark.parametrize("model", ["hstu-ranking", "hstu-retrieval"])
def test_training_is_the_same_with_or_without_the_average(tmp_path, model):
    # the average reads the weights and draws no random number: the trained weights and
    # losses are those of the run without it, bit for bit; its validation metrics are not
    options = dict(model=model, max_steps=6, eval_every=3, dropout=0.2, warmup_steps=2)
    plain = train(_config(tmp_path / "plain", **options))
    averaged = train(_config(tmp_path / "ema", ema_decay=0.9, **options))
    assert [r["loss"] for r in plain.history["train"]] == \
        [r["loss"] for r in averaged.history["train"]]
    trained = checkpoint.load(tmp_path / "plain" / checkpoint.CHECKPOINT)
    with_average = checkpoint.load(tmp_path / "ema" / checkpoint.CHECKPOINT)
    assert checkpoint.AVERAGE not in trained
    for name, value in trained["model"].items():
        assert torch.equal(value, with_average["model"][name]), name
    assert plain.history["valid"] != averaged.history["valid"]


@pytest.mark.parametrize("model", ["hstu-ranking", "hstu-retrieval"])
def test_validation_best_pt_and_the_test_use_the_averaged_weights(tmp_path, capsys, model):
    run = tmp_path / "run"
    # one validation, at the end: the best weights are the last average
    result = train(_config(run, model=model, max_steps=5, ema_decay=0.7))
    assert "weights averaged (EMA, decay 0.7" in capsys.readouterr().out
    saved = checkpoint.load(run / checkpoint.CHECKPOINT)
    best = checkpoint.load(run / checkpoint.BEST)
    average = saved[checkpoint.AVERAGE]
    for name, value in best["model"].items():
        # parameters: the average (not the trained weights); buffers: the model's own
        assert torch.equal(value, average.get(name, saved["model"][name])), name
    assert any(not torch.equal(average[n], saved["model"][n]) for n in average)
    # best.pt evaluated as any checkpoint: the run's validation and test metrics
    assert evaluate(run, "valid") == pytest.approx(result.valid)
    assert evaluate(run, "test") == pytest.approx(result.test)


def test_resume_with_the_average_continues_exactly(tmp_path, capsys):
    options = dict(dropout=0.2, eval_every=3, warmup_steps=4, ema_decay=0.8)
    whole = train(_config(tmp_path / "whole", max_steps=6, **options))
    train(_config(tmp_path / "halves", max_steps=3, **options))
    resumed = train(_config(tmp_path / "halves", max_steps=6, resume=True, **options))
    assert resumed.history["valid"] == whole.history["valid"]
    assert resumed.test == whole.test
    for name in (checkpoint.CHECKPOINT, checkpoint.BEST):
        a = checkpoint.load(tmp_path / "whole" / name)
        b = checkpoint.load(tmp_path / "halves" / name)
        for key in ("model", checkpoint.AVERAGE) if name == checkpoint.CHECKPOINT else ("model",):
            for param, value in a[key].items():
                assert torch.equal(value, b[key][param]), (name, key, param)
    # another decay is another run
    with pytest.raises(ConfigError, match=r"--ema-decay is 0\.5 here but 0\.8 in the"):
        train(_config(tmp_path / "halves", max_steps=9, resume=True,
                      **{**options, "ema_decay": 0.5}))


@pytest.mark.parametrize("value", [1.0, -0.1, 1.5, math.nan])
def test_a_decay_outside_0_1_is_refused(tmp_path, value):
    with pytest.raises(ConfigError, match=r"^--ema-decay: must be in \[0, 1\)"):
        _config(tmp_path, ema_decay=value).check()


def test_the_average_is_refused_where_there_is_none_to_keep(tmp_path):
    with pytest.raises(ConfigError, match=r"^--ema-decay: most-popular is fitted from counts"):
        _config(tmp_path, model="most-popular", ema_decay=0.9).check()
    with pytest.raises(ConfigError, match=r"^--ema-decay: not supported with --sharding "
                       "torchrec"):
        _config(tmp_path, sharding="torchrec", ema_decay=0.9).check()


def test_the_cli_takes_ema_decay_and_refuses_1(tmp_path, capsys):
    tiny = ["--synthetic-users", "40", "--synthetic-items", "100", "--max-seq-len", "12",
            "--embedding-dim", "16", "--num-layers", "1", "--num-negatives", "16",
            "--batch-size", "16", "--max-steps", "2", "--no-progress", "--no-plot"]
    run = tmp_path / "run"
    assert main(["train", *tiny, "--ema-decay", "0.9", "--out-dir", str(run)]) == 0
    assert checkpoint.load(run / checkpoint.CHECKPOINT)["config"]["ema_decay"] == 0.9
    with pytest.raises(SystemExit) as exc:
        main(["train", *tiny, "--ema-decay", "1", "--out-dir", str(tmp_path / "bad")])
    assert exc.value.code == 2
    assert "--ema-decay: must be in [0, 1), got '1'" in capsys.readouterr().err


def test_a_compiled_step_is_averaged_like_an_eager_one(tmp_path, monkeypatch):
    # aot_eager, as test_train_compile.py: dynamo captures the step, no C++ is compiled
    real = torch.compile
    monkeypatch.setattr(torch, "compile",
                        lambda model, **kw: real(model, **{**kw, "backend": "aot_eager"}))
    torch._dynamo.reset()
    options = dict(max_steps=4, dropout=0.0, ema_decay=0.8, cuda_graphs="off")
    eager = train(_config(tmp_path / "eager", **options))
    compiled = train(_config(tmp_path / "compiled", compile=True, **options))
    torch._dynamo.reset()
    # float32, the same step traced: test_train_compile.py's tolerances
    losses = [torch.tensor([r["loss"] for r in run.history["train"]])
              for run in (compiled, eager)]
    torch.testing.assert_close(*losses, rtol=1e-5, atol=1e-6)
    a = checkpoint.load(tmp_path / "eager" / checkpoint.CHECKPOINT)[checkpoint.AVERAGE]
    b = checkpoint.load(tmp_path / "compiled" / checkpoint.CHECKPOINT)[checkpoint.AVERAGE]
    for name, value in a.items():
        torch.testing.assert_close(b[name], value, rtol=1e-4, atol=1e-5)


def test_two_gloo_processes_average_like_one(tmp_path):
    """Every DDP rank holds the same weights, hence the same average: two processes against
    one, with test_trainer.py's tolerances for the two-process run (float rounding of the
    gradient summed in halves)."""
    options = dict(max_steps=6, eval_every=3, dropout=0.0, ema_decay=0.8)
    train(_config(tmp_path / "one", **options))
    run = torchrun_train(TINY, "--data", "synthetic", "--max-steps", "6", "--eval-every", "3",
                         "--dropout", "0", "--ema-decay", "0.8", "--out-dir",
                         str(tmp_path / "two"), "--no-progress", "--no-plot")
    assert "2 processes" in run.stdout and "weights averaged (EMA, decay 0.8" in run.stdout
    for name in (checkpoint.CHECKPOINT, checkpoint.BEST):
        one = checkpoint.load(tmp_path / "one" / name)
        two = checkpoint.load(tmp_path / "two" / name)
        key = checkpoint.AVERAGE if name == checkpoint.CHECKPOINT else "model"
        for param, value in one[key].items():
            torch.testing.assert_close(two[key][param], value, rtol=1e-4, atol=1e-5)


def test_a_run_config_takes_ema_decay(tmp_path):
    from tzrec_bench.regression.configs import RunConfigError, load_config

    path = tmp_path / "ema.toml"
    path.write_text('[train]\nmodel = "hstu-ranking"\nema_decay = 0.999\n')
    assert load_config(str(path)).train_config().ema_decay == 0.999
    path.write_text('[train]\nmodel = "hstu-ranking"\nema_decay = 1.0\n')
    with pytest.raises(RunConfigError, match=r"ema\.toml: \[train\] --ema-decay: must be in"):
        load_config(str(path))



@pytest.mark.gpu
@pytest.mark.parametrize("model", ["hstu-retrieval", "sasrec"])
def test_on_cuda_the_captured_step_is_averaged_without_a_host_sync(tmp_path, model):
    """Replayed steps update the parameters in place: the average read after each replay is
    the float64 hand computation's (float32 bounds), its update reads nothing back from the
    device, and a validation in between (the average swapped in and out of the tensors the
    graphs hold) leaves the losses those of a captured run without the average, bit for bit."""
    from tzrec_bench.train.distributed import close, init_distributed
    from tzrec_bench.train.loop import Trainer
    from tzrec_bench.train.strategies import Replicated

    runs = []
    for decay in (0.0, 0.8):
        config = _config(tmp_path / str(decay), model=model, ema_decay=decay, dropout=0.0,
                         amp="off", device="cuda", cuda_graphs="on")
        ctx = init_distributed("cuda")
        try:
            trainer = Trainer(config, ctx, Replicated)
            average = trainer.average
            expected = [] if average is None else [p.detach().double() for p in average.params]
            losses = []
            for step in range(8):
                losses.append(float(trainer.train_step(trainer.global_rows(step))))
                trainer.step += 1
                d = min(decay, (1 + step) / (10 + step))
                for e, p, a in zip(expected, average.params if average else [],
                                   average.averages if average else []):
                    e.mul_(d).add_(p.detach().double(), alpha=1 - d)
                    torch.testing.assert_close(a.double(), e, rtol=1e-5, atol=1e-6)
                if step == 4:
                    trainer.validate()
            assert trainer.captured is not None and trainer.captured.graphs
            if average is not None:
                torch.cuda.set_sync_debug_mode("error")
                try:
                    average.update(trainer.step)
                finally:
                    torch.cuda.set_sync_debug_mode(0)
            runs.append(losses)
        finally:
            close(ctx)
    assert runs[0] == runs[1]
