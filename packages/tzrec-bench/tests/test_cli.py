"""The ``tzrec-bench`` command: help, option errors (exit 2), and a train/evaluate round trip."""

from __future__ import annotations

import gzip
import json
import math
import re
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tzrec_bench.cli import build_parser, main
from tzrec_bench.data import Action
from tzrec_bench.train.config import TrainConfig
from tzrec_bench.train.factory import build_model, model_config
from tzrec_gr.checkpoint import write_payload
from tzrec_gr.models.registry import get_model

TINY = [
    "--synthetic-users", "40", "--synthetic-items", "100", "--max-seq-len", "12",
    "--embedding-dim", "16", "--num-layers", "1", "--num-negatives", "16", "--batch-size", "16",
    "--no-progress", "--no-plot",
]


def _exit_code(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    return exc.value.code, capsys.readouterr()


@pytest.mark.parametrize("command", ["train", "evaluate", "ops", "run-configs"])
def test_help_lists_and_explains_every_option(command, capsys):
    code, out = _exit_code([command, "--help"], capsys)
    assert code == 0
    parser = build_parser()[1][command]
    for action in parser._actions:
        for option in action.option_strings:
            assert option in out.out, option
        assert action.help, f"{action.option_strings or action.dest} has no help"


def test_top_level_help_names_the_subcommands(capsys):
    code, out = _exit_code(["--help"], capsys)
    assert code == 0
    assert all(name in out.out for name in ("train", "evaluate", "ops", "run-configs"))
    code, out = _exit_code([], capsys)
    assert code == 2 and "COMMAND" in out.err


@pytest.mark.parametrize(
    "argv, option",
    [
        (["--batch-size", "0"], "--batch-size"),
        (["--lr", "-1"], "--lr"),
        (["--lr", "fast"], "--lr"),
        (["--dropout", "1.5"], "--dropout"),
        (["--max-steps", "x"], "--max-steps"),
        (["--model", "bert"], "--model"),
        (["--data", "ml-10m"], "--data"),
        (["--metric", "recall"], "--metric"),
        (["--num-heads", "3"], "--num-heads"),  # must divide --embedding-dim 64
        (["--metric", "auc"], "--metric"),  # a ranking metric for a retrieval model
        (["--data-dir", "anywhere"], "--data-dir"),  # the synthetic data reads no files
        (["--data", "ml-100k", "--data-dir", "/no/such/folder"], "--data-dir"),
        (["--backend", "no-such-backend"], "--backend"),
    ],
)
def test_a_bad_option_exits_2_naming_it(argv, option, capsys, tmp_path):
    code, out = _exit_code(["train", *argv, "--out-dir", str(tmp_path)], capsys)
    assert code == 2
    assert option in out.err and "error" in out.err
    assert "Traceback" not in out.err


MODELS = ["hstu-retrieval", "sasrec", "hstu-ranking", "most-popular", "item-transitions",
          "item-knn", "popularity-ranking"]


def _model_choices():
    (action,) = [a for a in build_parser()[1]["train"]._actions if "--model" in a.option_strings]
    return action.choices


def test_every_model_choice_is_a_registered_record_that_builds():
    assert _model_choices() == MODELS
    config = dict(embedding_dim=16, max_seq_len=12, num_layers=1, num_negatives=4,
                  num_candidates=3)
    for name in _model_choices():
        record = get_model(name)
        assert record.trainer_kwargs is not None, name
        built = build_model(TrainConfig(model=name, **config), 20, task_bits=(1, 2))
        assert type(built) is record.model_class
        spec = model_config(TrainConfig(model=name, **config), 20, task_bits=(1, 2))
        assert spec["model"] == record.model_class.__name__
        assert (record.fitted, record.task) == (
            name in MODELS[3:], "ranking" if name.endswith("ranking") else "retrieval")


def test_an_unknown_model_is_refused_with_the_choices(capsys, tmp_path):
    code, out = _exit_code(["train", "--model", "bert", "--out-dir", str(tmp_path)], capsys)
    assert code == 2 and "--model: invalid choice: 'bert'" in out.err
    assert all(name in out.err for name in MODELS)


def test_hstu_ranking_is_built_to_embed_every_action_bit():
    kwargs = model_config(TrainConfig(model="hstu-ranking"), 20, (1,))["kwargs"]
    assert kwargs["action_weights"] == [int(a) for a in Action]


def test_evaluate_without_a_checkpoint_exits_2(tmp_path, capsys):
    code, out = _exit_code(["evaluate", str(tmp_path)], capsys)
    assert code == 2 and "no checkpoint at" in out.err


def test_train_then_evaluate(tmp_path, capsys):
    run = str(tmp_path / "run")
    assert main(["train", *TINY, "--max-steps", "3", "--out-dir", run]) == 0
    trained = json.loads((tmp_path / "run" / "metrics.json").read_text())["test"]
    capsys.readouterr()
    assert main(["evaluate", run, "--split", "test"]) == 0
    table = {
        cells[0]: cells[1]
        for cells in (line.split() for line in capsys.readouterr().out.splitlines())
        if len(cells) == 2
    }
    assert float(table["ndcg@10"]) == pytest.approx(trained["ndcg@10"], abs=1e-4)


# the brief's small run: 60 users, 50 items (3 steps of 16 users an epoch), seconds or less
SMALL = [
    "--data", "synthetic", "--synthetic-users", "60", "--synthetic-items", "50",
    "--max-seq-len", "12", "--embedding-dim", "16", "--num-layers", "1", "--num-heads", "2",
    "--batch-size", "16", "--device", "cpu", "--no-plot", "--no-progress",
]


def _table(out: str) -> dict:
    """The metric rows of a one-column metrics table: {name: value}."""
    return {
        cells[0]: float(cells[1])
        for cells in (line.split() for line in out.splitlines())
        if len(cells) == 2 and cells[0] != "metric" and not set(cells[1]) <= {"-"}
    }


def test_a_diverged_run_exits_1_with_one_line_naming_the_step(tmp_path, capsys):
    """lr 1e4 diverges within the 30 steps even with --clip-grad-norm 1.0 (the default):
    clipping bounds the gradient, not AdamW's step of about lr per weight, and the decoupled
    weight decay (1 - lr * 0.01 = -99) blows the weights up (step 2 when written)."""
    argv = ["train", *SMALL, "--lr", "1e4", "--max-steps", "30", "--log-every", "5",
            "--out-dir", str(tmp_path)]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert re.fullmatch(r"tzrec-bench train: error: the training loss is NaN or infinite at "
                        r"step \d+: the run diverged \(--lr 10000\.0\); no metric is reported\. "
                        r"Lower --lr, or keep --clip-grad-norm on\n", err), err
    step = int(re.search(r"at step (\d+)", err).group(1))
    assert 1 <= step <= 30
    assert not (tmp_path / "metrics.json").exists()


def test_a_count_baseline_ignores_a_batch_size_larger_than_the_users(tmp_path):
    # fitted from every training event at once: the trainer's batch-size bound (128 by
    # default, above these 60 users) must not refuse it, or run-configs' floors fail
    at = SMALL.index("--batch-size")
    small = SMALL[:at] + SMALL[at + 2 :]
    assert main(["train", *small, "--model", "most-popular", "--out-dir", str(tmp_path)]) == 0
    assert (tmp_path / "metrics.json").exists()


@pytest.mark.parametrize("model, key", [("item-knn", "ndcg@10"), ("popularity-ranking", "auc")])
def test_a_count_baseline_trains_and_evaluates_like_a_model(tmp_path, capsys, model, key):
    from tzrec_bench.train.loop import evaluate

    run = tmp_path / "run"
    assert main(["train", *SMALL, "--model", model, "--out-dir", str(run)]) == 0
    out = capsys.readouterr().out
    assert f"tzrec-bench train: {model} on synthetic" in out
    assert "fitted from the training events (no gradient steps)" in out
    summary = json.loads((run / "metrics.json").read_text())
    assert summary["steps"] == 0 and summary["best_step"] == 0
    test = summary["test"]
    assert key in test and all(math.isfinite(v) for v in test.values())
    assert 0.0 < test[key] <= 1.0
    assert (run / "best.pt").is_file() and (run / "checkpoint.pt").is_file()
    # evaluate builds a fresh model and loads the fitted counts through load_state_dict
    assert main(["evaluate", str(run)]) == 0
    table = _table(capsys.readouterr().out)
    names = {"users" if name == "count" else name for name in test}
    assert set(table) == names
    for name, value in test.items():
        assert table["users" if name == "count" else name] == pytest.approx(value, abs=1e-4)
    assert evaluate(run) == test  # exactly: the same counts, the same scores
    capsys.readouterr()


def test_ctrl_c_saves_a_checkpoint_and_the_printed_command_resumes_exactly(
    tmp_path, capsys, monkeypatch
):
    """A real SIGINT from inside step 5: the loop's handler only sets a flag, the loop stops
    at the next step boundary, saves checkpoint.pt and the CLI exits 130 with the command
    that resumes; that command ends where an uninterrupted run ends."""
    from tzrec_bench.train import checkpoint
    from tzrec_bench.train.loop import Trainer

    settings = [*SMALL, "--num-negatives", "16", "--dropout", "0", "--max-steps", "8",
                "--eval-every", "3", "--log-every", "2"]
    whole = tmp_path / "whole"
    assert main(["train", *settings, "--out-dir", str(whole)]) == 0
    step = Trainer.train_step

    def interrupted_in_step_5(self, rows):
        loss = step(self, rows)
        if self.step == 4:  # counted after the call: this is the 5th step
            signal.raise_signal(signal.SIGINT)
        return loss

    monkeypatch.setattr(Trainer, "train_step", interrupted_in_step_5)
    halves = tmp_path / "halves"
    argv = ["train", *settings, "--out-dir", str(halves)]
    capsys.readouterr()
    assert main(argv) == 130
    err = capsys.readouterr().err
    saved = halves / "checkpoint.pt"
    assert f"tzrec-bench: interrupted at step 5; checkpoint saved to {saved}\n" in err
    assert err.count("continue with: tzrec-bench ") == 1
    command = shlex.split(err.split("continue with: tzrec-bench ")[1])
    assert command == [*argv, "--resume"]
    assert checkpoint.load(saved)["step"] == 5
    assert not (halves / "metrics.json").exists()
    monkeypatch.undo()
    assert main(command) == 0
    assert "resumed from" in capsys.readouterr().out
    finished = json.loads((halves / "metrics.json").read_text())
    assert finished == json.loads((whole / "metrics.json").read_text())
    assert finished["steps"] == 8


def test_an_interrupt_without_a_checkpoint_exits_130_with_one_line(monkeypatch, capsys):
    from tzrec_bench.train import loop

    # a second Ctrl-C (a plain KeyboardInterrupt), and a run that had diverged when
    # interrupted (no checkpoint to continue from)
    for raised in (KeyboardInterrupt(), loop.Interrupted(3, None)):
        def interrupted(config, raised=raised):
            raise raised

        monkeypatch.setattr(loop, "train", interrupted)
        assert main(["train", *SMALL]) == 130
        assert capsys.readouterr().err == "tzrec-bench: interrupted\n"


def _truncated_checkpoint(path: Path) -> Path:
    """Half of a file saved as the trainer saves its checkpoints."""

    write_payload(path, {"config": {}, "step": 1, "model": {"w": torch.ones(64, 64)}})
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    return path


def test_truncated_checkpoint_exits_2_with_one_line(tmp_path, capsys):
    best = _truncated_checkpoint(tmp_path / "run" / "best.pt")
    assert main(["evaluate", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"tzrec-bench evaluate: error: {best}: cannot be loaded (")
    assert err.count("\n") == 1 and "written by `tzrec-bench train`" in err
    # --resume reads checkpoint.pt from --out-dir
    resume = _truncated_checkpoint(tmp_path / "run" / "checkpoint.pt")
    argv = ["train", *TINY, "--max-steps", "2", "--out-dir", str(tmp_path / "run"), "--resume"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"tzrec-bench train: error: {resume}: cannot be loaded (")
    assert err.count("\n") == 1


def test_truncated_data_file_exits_1_with_one_line(tmp_path, capsys):
    text = "".join(f"{u % 97}\t{u % 89}\t{1 + u % 5}\t{1000 + u}\n" for u in range(3000))
    whole = gzip.compress(text.encode())
    (tmp_path / "u.data.gz").write_bytes(whole[: len(whole) // 2])
    argv = ["train", "--data", "ml-100k", "--data-dir", str(tmp_path), "--cache-dir",
            str(tmp_path / "cache"), "--out-dir", str(tmp_path / "run"), "--no-progress"]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"tzrec-bench train: error: {tmp_path / 'u.data.gz'}: cannot be read as "
                          "gzip (EOFError: ")
    assert err.count("\n") == 1 and "expected 4 tab-separated integers per line" in err


def test_python_dash_m_runs_the_command():
    result = subprocess.run(
        [sys.executable, "-m", "tzrec_bench", "train", "--help"],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: tzrec-bench train")


def _readme_commands():
    readme = Path(__file__).resolve().parents[1] / "README.md"
    blocks = re.findall(r"```bash\n(.*?)```", readme.read_text(), re.S)
    lines = [line for block in blocks for line in block.replace("\\\n", " ").splitlines()]
    return [shlex.split(line.split(" # ")[0])[1:] for line in lines
            if line.startswith("tzrec-bench ")]


def test_readme_commands_parse_and_the_cpu_ops_example_runs(tmp_path, capsys):
    commands = _readme_commands()
    assert {argv[0] for argv in commands} >= {"train", "evaluate", "ops", "run-configs"}
    parser = build_parser()[0]
    for argv in commands:
        parser.parse_args(argv)  # exits 2 on an option the command does not have
    cpu = [argv for argv in commands if argv[0] == "ops" and "cpu" in argv]
    assert len(cpu) == 1
    assert main([*cpu[0], "--csv", str(tmp_path / "ops.csv"), "--no-progress"]) == 0
    assert "hstu_mha" in capsys.readouterr().out
