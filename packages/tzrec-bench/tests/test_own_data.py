"""A user's own event log end to end through the CLI: train, evaluate, the refusals of data
that is not the checkpoint's (evaluate and --resume), and the vocabularies in checkpoints."""

from __future__ import annotations

import pathlib
from typing import Callable, Dict

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
import pytest
import torch

from tzrec_bench.cli import main
from tzrec_gr.vocabulary import VOCABULARY_KEY, IdVocabularies

MODEL = [
    "--max-seq-len", "12", "--embedding-dim", "16", "--num-layers", "1",
    "--num-negatives", "16", "--batch-size", "16", "--device", "cpu", "--no-progress",
    "--no-plot", "--max-steps", "2",
]


def _log(string_ids: bool, num_items: int = 50, seed: int = 0) -> pa.Table:
    """40 users x 8 events over ``num_items`` items, in time order, with a column to ignore."""
    rng = np.random.default_rng(seed)
    users = np.repeat(np.arange(100, 140), 8)
    items = rng.permutation(np.resize(np.arange(num_items), len(users)))
    times = 1_600_000_000 + np.arange(len(users)) * 60

    def ids(values: np.ndarray, prefix: str) -> pa.Array:
        return pa.array([f"{prefix}{v}" for v in values]) if string_ids else pa.array(values)

    return pa.table({"uid": ids(users, "user-"), "sku": ids(items, "sku-"), "ts": times,
                     "price": rng.random(len(users))})


WRITERS: Dict[str, Callable[[pa.Table, pathlib.Path], pathlib.Path]] = {
    "csv": lambda table, folder: _written(folder / "log.csv",
                                          lambda p: pacsv.write_csv(table, p)),
    "parquet": lambda table, folder: _written(folder / "log", lambda p: (
        p.mkdir(), pq.write_table(table.slice(0, 100), p / "part-0.parquet"),
        pq.write_table(table.slice(100), p / "part-1.parquet"))),
}


def _written(path: pathlib.Path, write: Callable[[pathlib.Path], object]) -> pathlib.Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    write(path)
    return path


def _train(data: pathlib.Path, run: pathlib.Path, cache: pathlib.Path, *extra: str) -> int:
    return main(["train", "--data", str(data), "--columns", "user=uid,item=sku,time=ts",
                 "--cache-dir", str(cache), "--out-dir", str(run), *MODEL, *extra])


@pytest.mark.parametrize("fmt", ["csv", "parquet"])
@pytest.mark.parametrize("string_ids", [True, False], ids=["str-ids", "int-ids"])
def test_train_and_evaluate_on_an_event_log(tmp_path, capsys, fmt, string_ids):
    data = WRITERS[fmt](_log(string_ids), tmp_path / "data")
    assert _train(data, tmp_path / "run", tmp_path / "cache") == 0
    out = capsys.readouterr().out
    assert f"hstu-retrieval on {data}" in out
    payload = torch.load(tmp_path / "run" / "best.pt", weights_only=True)
    vocabularies = IdVocabularies.from_state(payload[VOCABULARY_KEY])
    assert len(vocabularies.items) == 50 and len(vocabularies.users) == 40
    assert vocabularies.items.kind == ("str" if string_ids else "int")
    assert vocabularies.items.raw([0])[0] == ("sku-0" if string_ids else 0)
    assert vocabularies.fingerprint and vocabularies.source == str(data)
    # evaluate reads the checkpoint's data and mapping by default
    assert main(["evaluate", str(tmp_path / "run"), "--cache-dir", str(tmp_path / "cache")]) == 0
    assert "hr@10" in capsys.readouterr().out


@pytest.mark.parametrize("change,message", [
    (lambda t: t.filter(np.isin(np.asarray(t["sku"]), [f"sku-{i}" for i in range(45)])),
     "45 items instead of 50"),
    (lambda t: t.set_column(1, "sku", pa.array([s + "x" for s in t["sku"].to_pylist()])),
     "item ids differ (row 0: 'sku-0x' instead of 'sku-0')"),
    (lambda t: t.slice(0, len(t) - 1), "the events differ (data fingerprint"),
])
def test_evaluate_and_resume_refuse_other_data_in_one_line(tmp_path, capsys, change, message):
    data = WRITERS["csv"](_log(True), tmp_path / "data")
    assert _train(data, tmp_path / "run", tmp_path / "cache") == 0
    other = WRITERS["csv"](change(_log(True)), tmp_path / "other")
    capsys.readouterr()
    assert main(["evaluate", str(tmp_path / "run"), "--data", str(other),
                 "--cache-dir", str(tmp_path / "cache")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert f"is not the data {tmp_path / 'run' / 'best.pt'} was trained on" in err
    assert message in err
    assert _train(other, tmp_path / "run", tmp_path / "cache", "--resume",
                  "--max-steps", "3") == 2
    err = capsys.readouterr().err
    assert err.startswith("tzrec-bench train: error: --resume:") and message in err


def test_a_moved_log_with_the_same_events_resumes(tmp_path, capsys):
    data = WRITERS["csv"](_log(False), tmp_path / "data")
    assert _train(data, tmp_path / "run", tmp_path / "cache") == 0
    moved = WRITERS["csv"](_log(False), tmp_path / "moved")
    assert _train(moved, tmp_path / "run", tmp_path / "cache", "--resume",
                  "--max-steps", "3") == 0
    assert "resumed from" in capsys.readouterr().out


def test_a_named_set_checkpoint_refuses_an_event_log(tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["train", "--data", "synthetic", "--synthetic-users", "40",
                 "--synthetic-items", "50", "--out-dir", str(run), *MODEL]) == 0
    data = WRITERS["csv"](_log(False), tmp_path / "data")
    capsys.readouterr()
    assert main(["evaluate", str(run), "--data", str(data), "--columns",
                 "user=uid,item=sku,time=ts", "--cache-dir", str(tmp_path / "cache")]) == 2
    # the same 50 integer item ids, other users: still not the model's data
    err = capsys.readouterr().err
    assert f"{data} is not the data {run / 'best.pt'} was trained on (synthetic)" in err
    assert "user ids differ (row 0: 100 instead of 0)" in err
    assert "columns differ" not in err  # a named set maps no columns to compare


def test_bad_data_options_exit_2_naming_them(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["train", "--data", str(tmp_path / "missing.csv")])
    assert exc.value.code == 2
    assert "--data: " in capsys.readouterr().err
    data = WRITERS["csv"](_log(True), tmp_path / "data")
    with pytest.raises(SystemExit):
        main(["train", "--data", str(data), "--columns", "who=uid"])
    assert "--columns: 'who=uid' is not KEY=COLUMN" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["train", "--data", "synthetic", "--columns", "user=uid"])
    assert "--columns: synthetic has its own format" in capsys.readouterr().err
    # a column the log does not have: one line naming the file and its columns, exit 1
    assert main(["train", "--data", str(data), "--cache-dir", str(tmp_path / "cache"),
                 *MODEL]) == 1
    err = capsys.readouterr().err
    assert ("no column for user ('user_id'), item ('item_id'); its columns are uid, sku, ts, "
            "price (map them with --columns") in err


def test_parquet_log_with_string_ids_trains_predicts_and_exports_by_raw_ids(tmp_path, capsys):
    """The documented path of a user's own log: train on Parquet with string ids, evaluate,
    predict the top 10 by raw ids (an unknown id is one bad row), export the run folder
    with tzrec-acc, and predict from the package: the same raw ids."""
    from tzrec_acc.cli import main as acc_main

    table = _log(True)
    data = WRITERS["parquet"](table, tmp_path / "data")
    run, cache = tmp_path / "run", tmp_path / "cache"
    assert _train(data, run, cache) == 0
    assert main(["evaluate", str(run), "--cache-dir", str(cache)]) == 0
    histories = [
        {"user_id": "user-100", "item_ids": ["sku-3", "sku-7", "sku-1"], "timestamps": [1, 2, 3]},
        {"user_id": "user-101", "item_ids": ["sku-3", "no-such-sku"], "timestamps": [1, 2]},
        {"user_id": "user-102", "item_ids": ["sku-49"], "timestamps": [5]},
    ]
    users = tmp_path / "users.parquet"
    pq.write_table(pa.Table.from_pylist(histories), users)
    top = tmp_path / "top10.parquet"
    capsys.readouterr()
    assert main(["predict", str(run), "--input", str(users), "--output", str(top), "--k", "10",
                 "--no-progress", "--unknown-items", "skip-user"]) == 0
    captured = capsys.readouterr()
    assert "unknown item id 'no-such-sku'" in captured.err and "skipped row 2" in captured.err
    got = pq.read_table(top).to_pylist()
    assert [r["user_id"] for r in got] == ["user-100", "user-102"]
    catalogue = set(table.column("sku").to_pylist())
    assert all(len(r["item_ids"]) == 10 and set(r["item_ids"]) <= catalogue for r in got)

    package = tmp_path / "model.pt2"
    assert acc_main(["export", "--model", str(run), "--format", "fx", "--backend", "pytorch",
                     "--output", str(package)]) == 0
    from_package = tmp_path / "top10-package.parquet"
    assert acc_main(["predict", str(package), "--input", str(users), "--output",
                     str(from_package), "--k", "10", "--no-progress", "--unknown-items",
                     "skip-user"]) == 0
    assert [r["item_ids"] for r in pq.read_table(from_package).to_pylist()] == [
        r["item_ids"] for r in got]
