"""``tzrec-bench predict`` and ``show`` at the edges of a user's own data: ids with spaces,
commas and quotes, rows that cannot be answered, items the model does not know, the input
formats training reads, the seen-items default, users by raw id.

What is checked against what: one tiny run trained on a CSV log of string ids in
``tmp_path`` (``--min-events 2``, so one rare item is left out of the model); each output is
compared with the same command's output on a plain JSONL input of the same histories, or
with the histories read from the log by hand.
"""

from __future__ import annotations

import argparse
import csv
import gzip
import inspect
import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch

from tzrec_bench.cli import main
from tzrec_bench.train.config import TrainConfig
from tzrec_bench.train.loop import train
from tzrec_gr.checkpoint import BEST
from tzrec_gr.file_formats import FORMATS, LOG_ONLY
from tzrec_gr.serving import ServingSession
from tzrec_gr.serving.files import (
    PredictError,
    add_predict_arguments,
    input_format,
    predict_records,
)
from tzrec_gr.vocabulary import VOCABULARY_KEY, IdVocabularies, Vocabulary

ODD = ['a, "quoted" one', "comma,item", "two  spaces", "title 1"]
ITEMS = ODD + [f"title {i}" for i in range(2, 14)]
RARE = "rare item"  # one event in the log: --min-events 2 leaves it out of the model


def _log_rows():
    gen = torch.Generator().manual_seed(0)
    rows = []
    for u in range(10):
        for t in range(8):
            item = ITEMS[int(torch.randint(0, len(ITEMS), (1,), generator=gen))]
            rows.append([f"user {u}", item, 10 * t])
    rows.append(["user 0", RARE, 1000])
    return rows


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("edges")
    log = root / "log.csv"
    with open(log, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["user_id", "item_id", "timestamp"])
        writer.writerows(_log_rows())
    train(TrainConfig(model="hstu-retrieval", data=str(log), cache_dir=str(root / "cache"),
                      min_events=2, max_steps=2, max_seq_len=8, embedding_dim=16,
                      num_layers=1, num_heads=2, num_negatives=8, batch_size=4,
                      eval_batch_size=16, progress=False, plot=False,
                      out_dir=str(root / "run")))
    return root


def _histories(users=("user 0", "user 1", "user 2")):
    """The users' histories as read from the log by hand (rare item included)."""
    rows = sorted(_log_rows(), key=lambda r: r[2])
    return [{"user_id": u, "item_ids": [r[1] for r in rows if r[0] == u],
             "timestamps": [r[2] for r in rows if r[0] == u]} for u in users]


def _jsonl(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _read_csv(path: Path):
    with open(path, newline="") as f:
        return [{"user_id": r["user_id"], "item_ids": json.loads(r["item_ids"]),
                 "scores": json.loads(r["scores"])} for r in csv.DictReader(f)]


def _predict(run, *options):
    return main(["predict", str(run / "run"), "--no-progress", *map(str, options)])


def test_csv_output_round_trips_ids_with_spaces_commas_and_quotes(run, tmp_path, capsys):
    rows = [{**h, "item_ids": h["item_ids"][:-1], "timestamps": h["timestamps"][:-1]}
            if h["user_id"] == "user 0" else h for h in _histories()]
    source = _jsonl(tmp_path / "u.jsonl", rows)
    assert _predict(run, "--input", source, "--output", tmp_path / "top.csv", "--k", "15",
                    "--include-seen") == 0
    assert _predict(run, "--input", source, "--output", tmp_path / "top.parquet", "--k", "15",
                    "--include-seen") == 0
    capsys.readouterr()
    got = _read_csv(tmp_path / "top.csv")
    want = pq.read_table(tmp_path / "top.parquet").to_pylist()
    assert [r["item_ids"] for r in got] == [r["item_ids"] for r in want]
    assert set(ODD) <= set(got[0]["item_ids"])  # 15 of 16 items: the odd ids come back whole
    for g, w in zip(got, want):
        assert g["scores"] == pytest.approx(w["scores"], abs=1e-6)
    # and a CSV whose lists are JSON lists reads back as an input
    back = tmp_path / "back.csv"
    with open(back, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["user_id", "item_ids", "timestamps"])
        for r in rows:
            writer.writerow([r["user_id"], json.dumps(r["item_ids"]), json.dumps(r["timestamps"])])
    assert _predict(run, "--input", back, "--output", tmp_path / "again.csv", "--k", "15",
                    "--include-seen") == 0
    assert _read_csv(tmp_path / "again.csv") == got


def test_no_row_answered_exits_1_with_the_counts_and_writes_nothing(run, tmp_path, capsys):
    rows = [{"user_id": "x", "item_ids": [RARE], "timestamps": [1]},
            {"user_id": "y", "item_ids": [], "timestamps": []}]
    out = tmp_path / "top.csv"
    assert _predict(run, "--input", _jsonl(tmp_path / "u.jsonl", rows), "--output", out) == 1
    err = capsys.readouterr().err.splitlines()
    assert err[-1].endswith("u.jsonl: no row could be answered (2 rows read: 0 answered, 2 "
                            "skipped); nothing written")
    assert "skipped row 1: no item of item_ids is known to the model" in err[0]
    assert not out.exists() and not list(tmp_path.glob(".top.csv*"))
    # the counts are on the last line of a run that answered someone too
    rows.append(_histories()[1])
    assert _predict(run, "--input", _jsonl(tmp_path / "u.jsonl", rows), "--output", out) == 0
    assert "3 rows read: 1 answered, 2 skipped" in capsys.readouterr().out.splitlines()[-1]


def test_unknown_items_are_dropped_and_counted_or_skip_the_user(run, tmp_path, capsys):
    """user 0's last event is the rare item the model never saw: by default it is dropped
    (the top-K are those of the history without it), with skip-user the row is skipped."""
    full = _histories()
    source = _jsonl(tmp_path / "u.jsonl", full)
    assert _predict(run, "--input", source, "--output", tmp_path / "dropped.csv") == 0
    out = capsys.readouterr().out
    assert ("3 rows read: 3 answered, 0 skipped; 1 unknown items dropped from 1 histories "
            "(--unknown-items skip-user to skip those users)") in out
    without = [{**full[0], "item_ids": full[0]["item_ids"][:-1],
                "timestamps": full[0]["timestamps"][:-1]}, *full[1:]]
    assert _predict(run, "--input", _jsonl(tmp_path / "w.jsonl", without), "--output",
                    tmp_path / "without.csv") == 0
    assert _read_csv(tmp_path / "dropped.csv") == _read_csv(tmp_path / "without.csv")
    capsys.readouterr()
    assert _predict(run, "--input", source, "--output", tmp_path / "skip.csv",
                    "--unknown-items", "skip-user") == 0
    captured = capsys.readouterr()
    assert (f"skipped row 1: unknown item id {RARE!r} in item_ids (position 8)" in captured.err)
    assert [r["user_id"] for r in _read_csv(tmp_path / "skip.csv")] == ["user 1", "user 2"]


def _write_as(path: Path, rows):
    """``rows`` as training's formats hold them: by the name's suffixes."""
    text_name = path.name[:-3] if path.name.endswith(".gz") else path.name
    if text_name.endswith((".json", ".jsonl")):
        text = "".join(json.dumps(r) + "\n" for r in rows)
    else:
        delimiter = "\t" if text_name.endswith(".tsv") else ","
        lines = [delimiter.join(["user_id", "item_ids", "timestamps"])]
        lines += [delimiter.join([r["user_id"], json.dumps(r["item_ids"]).replace('"', '""')
                                  .join('""'), " ".join(map(str, r["timestamps"]))])
                  for r in rows]
        text = "\n".join(lines) + "\n"
    if path.name.endswith(".gz"):
        path.write_bytes(gzip.compress(text.encode()))
    else:  # every text file with a byte-order mark, as some editors write them
        path.write_text(text, encoding="utf-8-sig")
    return path


@pytest.mark.parametrize("name", ["u.csv", "u.tsv", "u.json", "u.jsonl.gz", "u.csv.gz"])
def test_inputs_in_the_formats_training_reads(run, tmp_path, capsys, name):
    rows = _histories()
    assert _predict(run, "--input", _jsonl(tmp_path / "plain.jsonl", rows), "--output",
                    tmp_path / "want.csv") == 0
    code = _predict(run, "--input", _write_as(tmp_path / name, rows), "--output",
                    tmp_path / "got.csv")
    assert code == 0, capsys.readouterr().err
    assert _read_csv(tmp_path / "got.csv") == _read_csv(tmp_path / "want.csv")


def test_every_format_of_training_but_text_is_an_input_format():
    """One suffix table for both readers: predict reads each format training reads, plain or
    .gz, except ``user item`` text and ``.seq`` user lines (event logs only) and gzipped
    Parquet."""
    for suffix, fmt in FORMATS.items():
        if fmt in LOG_ONLY:
            with pytest.raises(PredictError,
                               match=rf"^--input must end with one of .*users\{suffix}"):
                input_format(f"users{suffix}")
            continue
        assert input_format(f"users{suffix.upper()}") == fmt, suffix
        if fmt == "parquet":
            with pytest.raises(PredictError, match="Parquet compresses its own columns"):
                input_format(f"users{suffix}.gz")
        else:
            assert input_format(f"users{suffix}.gz") == fmt, suffix


def test_seen_items_are_excluded_by_default_in_python_and_cli(run, tmp_path, capsys):
    assert inspect.signature(predict_records).parameters["exclude_seen"].default is True
    assert inspect.signature(ServingSession.recommend).parameters["exclude_seen"].default is True
    parser = argparse.ArgumentParser()
    add_predict_arguments(parser)
    base = ["--input", "u.csv", "--output", "o.csv"]
    assert parser.parse_args(base).exclude_seen is True
    assert parser.parse_args([*base, "--exclude-seen"]).exclude_seen is True
    assert parser.parse_args([*base, "--include-seen"]).exclude_seen is False
    assert parser.parse_args([*base, "--no-exclude-seen"]).exclude_seen is False
    rows = _histories()
    source = _jsonl(tmp_path / "u.jsonl", rows)
    assert _predict(run, "--input", source, "--output", tmp_path / "top.csv") == 0
    assert "; seen items excluded (--include-seen to rank them too)" in capsys.readouterr().out
    for row, got in zip(rows, _read_csv(tmp_path / "top.csv")):
        assert got["item_ids"] and not set(row["item_ids"]) & set(got["item_ids"])


def test_predict_by_user_id_reads_the_histories_from_the_run_log(run, tmp_path, capsys):
    wanted = ["user 2", "nobody", "user 0"]
    assert _predict(run, "--users", ",".join(wanted), "--output", tmp_path / "ids.csv") == 0
    captured = capsys.readouterr()
    assert "1 of 3 users are not in" in captured.err and "'nobody'" in captured.err
    assert "users: 2 of 3 found in" in captured.out and "after --min-events 2" in captured.out
    # the same users with their histories given by hand (the rare item is not in the log
    # the model was trained on: --min-events 2 read it out)
    by_hand = [{**h, "item_ids": [i for i in h["item_ids"] if i != RARE],
                "timestamps": [t for i, t in zip(h["item_ids"], h["timestamps"]) if i != RARE]}
               for h in _histories(("user 2", "user 0"))]
    assert _predict(run, "--input", _jsonl(tmp_path / "u.jsonl", by_hand), "--output",
                    tmp_path / "file.csv") == 0
    assert _read_csv(tmp_path / "ids.csv") == _read_csv(tmp_path / "file.csv")
    (tmp_path / "ids.txt").write_text("user 2\n\nnobody\nuser 0\n")
    assert _predict(run, "--users-file", tmp_path / "ids.txt", "--output",
                    tmp_path / "file2.csv", "--data", run / "log.csv") == 0
    assert _read_csv(tmp_path / "file2.csv") == _read_csv(tmp_path / "file.csv")
    capsys.readouterr()
    assert _predict(run, "--users", "nobody,none", "--output", tmp_path / "no.csv") == 1
    err = capsys.readouterr().err
    assert "no user could be answered (2 ids, none in" in err and not (tmp_path / "no.csv").exists()
    for options, message in [
        (["--users", "user 0", "--input", tmp_path / "u.jsonl"], "two sources of users"),
        (["--users", " , "], "--users: no user id given"),
        ([], "give the users: --input FILE, --users ID,... or --users-file FILE"),
        (["--input", tmp_path / "u.jsonl", "--data", "x.csv"], "--data applies with --users"),
    ]:
        assert _predict(run, *options, "--output", tmp_path / "x.csv") == 2, options
        assert message in capsys.readouterr().err, options
    assert _predict(run, "--users", "user 0", "--data", tmp_path / "none.csv", "--output",
                    tmp_path / "x.csv") == 1
    assert f"--data: no event log at {tmp_path / 'none.csv'}" in capsys.readouterr().err


def test_show_a_user_history_and_the_item_vocabulary(run, capsys):
    assert main(["show", str(run / "run"), "--user", "user 0"]) == 0
    captured = capsys.readouterr()
    history = _histories(("user 0",))[0]
    kept = [(t, i) for t, i in zip(history["timestamps"], history["item_ids"]) if i != RARE]
    assert captured.out.splitlines() == [f"{t}\t{i}" for t, i in kept]
    assert "user 'user 0': 8 events in" in captured.err
    assert main(["show", str(run / "run"), "--user", "user 0", "--data",
                 str(run / "log.csv")]) == 0  # the same log, named
    assert capsys.readouterr().out.splitlines() == [f"{t}\t{i}" for t, i in kept]
    assert main(["show", str(run / "run"), "--user", "nobody"]) == 1
    assert "user 'nobody' is not in" in capsys.readouterr().err
    assert main(["show", str(run / "run"), "--items"]) == 0
    captured = capsys.readouterr()
    assert captured.out.splitlines() == [f"{r}\t{i}" for r, i in enumerate(sorted(ITEMS))]
    assert f"{len(ITEMS)} str item ids of" in captured.err


def test_predict_loads_through_load_model_and_its_catalogue_check(run, tmp_path, capsys):
    """A checkpoint whose vocabulary does not match its catalogue is refused as
    tzrec_gr.checkpoint.load_model refuses it (exit 2, naming the file)."""
    payload = torch.load(run / "run" / BEST, weights_only=True)
    vocab = IdVocabularies(Vocabulary(["user 0"]), Vocabulary(ITEMS[:-1]), "", "log")
    bad = tmp_path / "bad.pt"
    torch.save({**payload, VOCABULARY_KEY: vocab.state()}, bad)
    rows = _jsonl(tmp_path / "u.jsonl", _histories())
    assert main(["predict", str(bad), "--input", str(rows), "--output",
                 str(tmp_path / "o.csv")]) == 2
    err = capsys.readouterr().err
    assert f"{bad}: its item vocabulary has {len(ITEMS) - 1} ids but the model {len(ITEMS)} " \
           "items; the file is inconsistent" in err
