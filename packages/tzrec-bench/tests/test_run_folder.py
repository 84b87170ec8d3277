"""A run's folder holds one run: a new run refuses an earlier run's files (or replaces them
with --overwrite), --resume continues its own run from the checkpoint's settings, a
checkpoint of another run is never picked up; strict JSON; data with nothing to evaluate
is refused before training; a changed --columns is named as such."""

from __future__ import annotations

import json
import math
import shutil
import signal
from pathlib import Path
from typing import List

import pytest
import torch

from tzrec_bench.cli import _interrupted_message, main
from tzrec_bench.train import checkpoint
from tzrec_bench.train.config import TrainConfig
from tzrec_bench.train.interrupts import Interrupted
from tzrec_bench.train.run import json_text
from tzrec_bench.train.run_folder import RunFolderError

COLUMNS = "user=uid,item=sku,time=ts"
MODEL = [
    "--max-seq-len", "12", "--embedding-dim", "16", "--num-layers", "1",
    "--num-negatives", "16", "--batch-size", "8", "--device", "cpu", "--no-progress",
    "--no-plot", "--max-steps", "2",
]


def _log(path: Path, users: int, events: int, items: int = 50, offset: int = 0) -> Path:
    """A CSV log of ``users`` x ``events`` events, item ids drawn from ``items``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = ["uid,sku,ts"]
    for user in range(users):
        for event in range(events):
            step = user * events + event
            lines.append(f"u{user},s{(step * 7 + offset) % items},{1_600_000_000 + 60 * step}")
    path.write_text("\n".join(lines) + "\n")
    return path


def _train(data: Path, run: Path, cache: Path, *extra: str) -> int:
    return main(["train", "--data", str(data), "--columns", COLUMNS, "--cache-dir", str(cache),
                 "--out-dir", str(run), *MODEL, *extra])


def _one_line(err: str) -> str:
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err


def _strict(text: str) -> dict:
    def refuse(name: str) -> None:
        raise ValueError(f"not JSON: {name}")

    return json.loads(text, parse_constant=refuse)


def test_a_new_run_refuses_a_folder_holding_an_earlier_run(tmp_path, capsys):
    run, cache = tmp_path / "run", tmp_path / "cache"
    assert _train(_log(tmp_path / "a.csv", 20, 8), run, cache) == 0
    best = (run / "best.pt").read_bytes()
    capsys.readouterr()
    assert _train(_log(tmp_path / "b.csv", 20, 8, items=30), run, cache) == 2
    err = _one_line(capsys.readouterr().err)
    assert err == (
        f"tzrec-bench train: error: --out-dir: {run} holds an earlier run's files "
        "(checkpoint.pt, best.pt, metrics.json, history.json); a new run does not mix with "
        "them: --overwrite replaces them, --resume continues that run, or choose another "
        "--out-dir\n"
    )
    assert (run / "best.pt").read_bytes() == best  # nothing touched
    with pytest.raises(RunFolderError, match="holds an earlier run's files"):  # the Python API
        from tzrec_bench.train.loop import train

        train(TrainConfig(data="synthetic", out_dir=str(run), device="cpu"))


def test_overwrite_removes_the_earlier_run_before_a_run_that_ends_before_validating(
    tmp_path, capsys, monkeypatch
):
    """Ctrl-C in the first step of a new run with --overwrite: the folder holds that run's
    checkpoint.pt alone, so evaluate scores the new model (other items), not the old one."""
    from tzrec_bench.train.loop import Trainer

    run, cache = tmp_path / "run", tmp_path / "cache"
    (run / "notes.txt").parent.mkdir()
    (run / "notes.txt").write_text("mine")
    assert _train(_log(tmp_path / "a.csv", 20, 8), run, cache) == 0
    step = Trainer.train_step

    def interrupted_in_step_1(self, rows):
        loss = step(self, rows)
        signal.raise_signal(signal.SIGINT)
        return loss

    monkeypatch.setattr(Trainer, "train_step", interrupted_in_step_1)
    other = _log(tmp_path / "b.csv", 20, 8, items=30)
    capsys.readouterr()
    assert _train(other, run, cache, "--overwrite") == 130
    captured = capsys.readouterr()
    assert (f"removed the earlier run's checkpoint.pt, best.pt, metrics.json, history.json "
            f"from {run}") in captured.out
    lines = captured.err.splitlines()
    assert lines[0] == (f"tzrec-bench: interrupted at step 1; checkpoint saved to "
                        f"{run / 'checkpoint.pt'}")
    assert "--overwrite" not in lines[1] and lines[1].endswith(" --resume")
    assert sorted(p.name for p in run.iterdir()) == ["checkpoint.pt", "notes.txt"]
    monkeypatch.undo()
    assert main(["evaluate", str(run), "--cache-dir", str(cache)]) == 0
    assert f"{run / 'checkpoint.pt'} (step 1)" in capsys.readouterr().out


def test_the_resume_line_never_repeats_overwrite():
    stop = Interrupted(4, Path("run/checkpoint.pt"))
    message = _interrupted_message(stop, ["train", "--out-dir", "run", "--overwrite"])
    assert message.endswith("\ncontinue with: tzrec-bench train --out-dir run --resume")


def test_resume_takes_the_data_and_settings_from_the_checkpoint(tmp_path, capsys, monkeypatch):
    """Trained from a folder with a relative --data, --min-events and other settings;
    resumed and evaluated from another folder with none of them repeated."""
    _log(tmp_path / "work" / "data" / "log.csv", 20, 8)
    monkeypatch.chdir(tmp_path / "work")
    assert _train(Path("data/log.csv"), Path("run"), tmp_path / "cache",
                  "--min-events", "2", "--eval-every", "1") == 0
    saved = checkpoint.load(tmp_path / "work" / "run" / "checkpoint.pt")["config"]
    assert saved["data"] == str(tmp_path / "work" / "data" / "log.csv")  # absolute
    assert saved["paths_as_typed"]["data"] == "data/log.csv"  # as typed, for messages
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    run = tmp_path / "work" / "run"
    capsys.readouterr()
    # --epochs alone sets the run's length (20 users, batches of 8: 2 steps an epoch);
    # the checkpoint's --max-steps 2 no longer caps it
    assert main(["train", "--out-dir", str(run), "--resume", "--epochs", "2"]) == 0
    out = capsys.readouterr().out
    assert f"resumed from {run / 'checkpoint.pt'} at step 2" in out
    assert "hstu-retrieval on data/log.csv" in out
    resumed = checkpoint.load(run / "checkpoint.pt")
    assert resumed["step"] == 4
    changed = ("max_steps", "epochs", "resume", "out_dir", "paths_as_typed")
    assert {k: v for k, v in resumed["config"].items() if k not in changed} == {
        k: v for k, v in saved.items() if k not in changed}
    assert (resumed["config"]["max_steps"], resumed["config"]["epochs"]) == (None, 2)
    assert resumed["config"]["min_events"] == 2 and resumed["config"]["columns"] == COLUMNS
    assert resumed["config"]["paths_as_typed"] == {"data": "data/log.csv"}
    assert main(["evaluate", str(run)]) == 0
    assert "hstu-retrieval on data/log.csv" in capsys.readouterr().out


@pytest.mark.parametrize("option,message", [
    (["--data", "synthetic"], "--data: synthetic here but "),
    (["--embedding-dim", "32"], "--embedding-dim is 32 here but 16 in the checkpoint"),
    (["--overwrite"], "--overwrite: --resume continues the run in --out-dir and --overwrite "
                      "replaces it"),
])
def test_resume_refuses_options_that_cannot_continue_the_run(tmp_path, capsys, option, message):
    run = tmp_path / "run"
    assert _train(_log(tmp_path / "a.csv", 20, 8), run, tmp_path / "cache") == 0
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        main(["train", "--out-dir", str(run), "--resume", *option])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err.splitlines()[-1]


def test_resume_never_takes_a_best_pt_of_another_run(tmp_path, capsys):
    log, cache = _log(tmp_path / "a.csv", 20, 8), tmp_path / "cache"
    assert _train(log, tmp_path / "one", cache) == 0
    assert _train(log, tmp_path / "two", cache) == 0
    shutil.copy(tmp_path / "one" / "best.pt", tmp_path / "two" / "best.pt")
    capsys.readouterr()
    assert main(["train", "--out-dir", str(tmp_path / "two"), "--resume",
                 "--max-steps", "3"]) == 2
    err = _one_line(capsys.readouterr().err)
    assert err.startswith(f"tzrec-bench train: error: {tmp_path / 'two' / 'best.pt'}: written by "
                          f"another run than {tmp_path / 'two' / 'checkpoint.pt'} (run id ")
    ids = {checkpoint.load(tmp_path / name / "checkpoint.pt")[checkpoint.RUN_ID]
           for name in ("one", "two")}
    assert len(ids) == 2 and all(len(i) == 32 for i in ids)


def test_resume_refuses_run_files_without_a_checkpoint(tmp_path, capsys):
    run = tmp_path / "run"
    assert _train(_log(tmp_path / "a.csv", 20, 8), run, tmp_path / "cache") == 0
    (run / "checkpoint.pt").unlink()
    capsys.readouterr()
    assert main(["train", "--out-dir", str(run), "--resume", "--data", "synthetic",
                 "--device", "cpu"]) == 2
    assert _one_line(capsys.readouterr().err) == (
        f"tzrec-bench train: error: --resume: {run} has no checkpoint.pt to continue from, "
        "only an earlier run's files (best.pt, metrics.json, history.json); --overwrite "
        "replaces them with a new run, or choose another --out-dir\n")


def test_metrics_and_history_are_strict_json(tmp_path, monkeypatch):
    """A metric of no user is NaN in memory and null in the files, never a bare NaN."""
    from tzrec_bench.train.retrieval import RetrievalTask

    evaluate = RetrievalTask.evaluate

    def with_nan(self, model, split, max_users):
        return {**evaluate(self, model, split, max_users), "mrr": math.nan}

    monkeypatch.setattr(RetrievalTask, "evaluate", with_nan)
    run = tmp_path / "run"
    assert _train(_log(tmp_path / "a.csv", 20, 8), run, tmp_path / "cache") == 0
    metrics = _strict((run / "metrics.json").read_text())
    assert metrics["test"]["mrr"] is None and metrics["valid"]["mrr"] is None
    assert metrics["test"]["hr@10"] is not None
    assert _strict((run / "history.json").read_text())["valid"][0]["mrr"] is None
    assert json_text({"a": [math.inf, -math.inf, 1.5]}) == '{"a": [null, null, 1.5]}\n'


@pytest.mark.parametrize("events,counts", [(1, "20 users: 20 with 1 event"),
                                           (2, "20 users: 20 with 2 events")])
def test_a_log_where_no_user_has_3_events_is_refused_before_training(tmp_path, capsys, events,
                                                                     counts):
    run = tmp_path / "run"
    log = _log(tmp_path / "short.csv", 20, events)
    assert _train(log, run, tmp_path / "cache") == 1
    err = _one_line(capsys.readouterr().err)
    assert err == (
        f"tzrec-bench train: error: {log}: nothing to validate or test: the leave-one-out "
        "split holds out each user's last 2 events and needs users with at least 3 events, "
        f"but there is none ({counts})\n")
    assert not run.exists()


def test_a_log_with_no_training_sequence_is_refused_but_a_fitted_baseline_fits(tmp_path,
                                                                             capsys):
    log, cache = _log(tmp_path / "three.csv", 20, 3), tmp_path / "cache"
    assert _train(log, tmp_path / "run", cache) == 1
    err = _one_line(capsys.readouterr().err)
    assert "nothing to train on" in err and "(20 users: 20 with 3 events)" in err
    assert "--batch-size" not in err
    assert _train(log, tmp_path / "floor", cache, "--model", "most-popular") == 0


def test_changing_only_the_columns_says_the_columns_differ(tmp_path, capsys):
    run, cache = tmp_path / "run", tmp_path / "cache"
    assert _train(_log(tmp_path / "a.csv", 20, 8), run, cache) == 0
    capsys.readouterr()
    assert main(["evaluate", str(run), "--columns", "user=uid,item=sku,time=",
                 "--cache-dir", str(cache)]) == 2
    err = _one_line(capsys.readouterr().err)
    assert err.endswith(": the columns differ (--columns user=uid,item=sku,time= here, "
                        f"{COLUMNS} in training)\n")
    assert "events differ" not in err
    # the same mapping spelled otherwise is the same data
    assert main(["evaluate", str(run), "--columns", "item=sku,user=uid,time=ts",
                 "--cache-dir", str(cache)]) == 0


def test_run_configs_replaces_its_own_earlier_runs(tmp_path):
    from tzrec_bench.regression.configs import RunConfig
    from tzrec_bench.regression.harness import run_config

    seen: List[TrainConfig] = []

    def trainer(config: TrainConfig) -> dict:
        seen.append(config)
        return {}

    config = RunConfig("c", tmp_path / "c.toml", "", {"data": "synthetic"})
    run_config(config, 1, {}, trainer, tmp_path)
    assert seen[0].overwrite and not seen[0].resume


def test_a_checkpoint_without_run_ids_still_resumes(tmp_path, capsys):
    """Files written before run ids: neither carries one, and resume goes on."""
    run = tmp_path / "run"
    assert _train(_log(tmp_path / "a.csv", 20, 8), run, tmp_path / "cache") == 0
    for name in ("checkpoint.pt", "best.pt"):
        payload = torch.load(run / name, weights_only=True)
        del payload[checkpoint.RUN_ID]
        torch.save(payload, run / name)
    assert main(["train", "--out-dir", str(run), "--resume", "--max-steps", "3"]) == 0
    assert "resumed from" in capsys.readouterr().out
