"""Raw ids at the serving door: ``predict_file`` with a checkpoint's vocabulary, the
session's ``from_raw`` / ``raw_ids``, out-of-range integers as bad rows, and the seen-items
rule.

What is checked against what: a file of raw ids predicts what the session predicts for the
same users given as the model's rows (mapped by hand through the vocabulary), and writes the
items back as raw ids; MovieLens-like integer ids (1..N, so that most fall inside 0..N-1 too)
are mapped, never read as rows; an unknown raw id and an integer past int64 in any column of
any format (CSV, JSONL, Parquet int64 / uint64 / decimal) are one skipped row, named by its
number, column and value, and the rest of the file is written.
"""

from __future__ import annotations

import csv
import decimal
import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from tzrec_gr.checkpoint import resolve_checkpoint
from tzrec_gr.models import HSTURanking, HSTURetrieval
from tzrec_gr.serving import Candidates, Histories, ServingSession
from tzrec_gr.serving.files import (
    BadRowError,
    PredictError,
    item_vocabulary,
    predict_file,
    session_limits,
)
from tzrec_gr.vocabulary import VOCABULARY_KEY, IdVocabularies, Vocabulary

NUM_ITEMS = 30
ML_LIKE = Vocabulary(np.arange(1, NUM_ITEMS + 1))  # MovieLens: raw id = row + 1
SKUS = Vocabulary([f"sku-{i:02d}" for i in range(NUM_ITEMS)])
RANKING = dict(num_items=NUM_ITEMS, item_embedding_dim=8, embedding_dim=16, task_bitmasks=[1, 2],
               action_weights=[1, 2, 4], dropout_ratio=0.0, max_uih_len=10, max_targets=4,
               backend="pytorch")


def _vocab(items):
    return IdVocabularies(Vocabulary(["u0", "u1", "u2"]), items, "abc123", "test data")


@pytest.fixture(scope="module")
def session():
    torch.manual_seed(0)
    model = HSTURetrieval(NUM_ITEMS, 16, backend="pytorch", max_seq_len=8, dropout_ratio=0.0)
    return ServingSession(model, vocabularies=_vocab(ML_LIKE))


@pytest.fixture(scope="module")
def ranking():
    torch.manual_seed(0)
    return ServingSession(HSTURanking(**RANKING), vocabularies=_vocab(SKUS))


def _write(path, rows):
    if path.suffix == ".parquet":
        pq.write_table(pa.Table.from_pylist(rows), path)
    elif path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    else:
        with open(path, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            for r in rows:
                writer.writerow({k: " ".join(map(str, v)) if isinstance(v, list) else v
                                 for k, v in r.items()})
    return path


def _read(path):
    if path.suffix == ".parquet":
        return pq.read_table(path).to_pylist()
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


ROWS = [  # raw ids 1..30: every one but 30 is also a row of the model
    {"user_id": "u0", "item_ids": [1, 2, 3], "timestamps": [1, 2, 3]},
    {"user_id": "u1", "item_ids": [30, 7], "timestamps": [5, 9]},
    {"user_id": "u2", "item_ids": [12, 11, 10, 9], "timestamps": [1, 1, 2, 3]},
]


@pytest.mark.parametrize("suffix", [".csv", ".jsonl", ".parquet"])
def test_raw_integer_ids_are_mapped_never_read_as_rows(session, tmp_path, suffix):
    source = _write(tmp_path / f"users{suffix}", ROWS)
    out = tmp_path / "top.parquet"
    items = session.vocabularies.items
    summary = predict_file(session, session_limits(session), source, out, k=5, items=items,
                           exclude_seen=False, progress=False)
    assert summary.written == 3 and not summary.skipped
    got = pq.read_table(out).to_pylist()
    rows = [[i - 1 for i in r["item_ids"]] for r in ROWS]  # the rows, mapped by hand
    top = session.recommend(Histories.from_lists(rows), k=5, exclude_seen=False)
    assert [r["item_ids"] for r in got] == [[i + 1 for i in t] for t in top.ids.tolist()]
    assert [r["item_ids"] for r in got] == top.raw_ids(session.vocabularies)
    # the bug of issue 45: the same file read as rows gives other items
    wrong = session.recommend(Histories.from_lists([r["item_ids"][:2] for r in ROWS[:1]]), k=5)
    assert got[0]["item_ids"] != wrong.ids[0].tolist()


def test_string_ids_in_and_out_and_model_ids_behind_the_option(ranking, tmp_path):
    rows = [
        {"user_id": 7, "item_ids": ["sku-03", "sku-01"], "timestamps": [1, 4],
         "actions": [1, 3], "candidates": ["sku-09", "sku-00", "sku-29"]},
        {"user_id": 8, "item_ids": ["sku-05"], "timestamps": [2], "actions": [2],
         "candidates": ["sku-07"]},
    ]
    source = _write(tmp_path / "users.jsonl", rows)
    out = tmp_path / "scores.parquet"
    limits = session_limits(ranking)
    items, line = item_vocabulary(None, ranking.vocabularies, "best.pt")
    assert items is SKUS and line.startswith("item ids: raw (30 str ids of test data")
    predict_file(ranking, limits, source, out, items=items, progress=False)
    got = pq.read_table(out).to_pylist()
    assert [r["candidates"] for r in got] == [r["candidates"] for r in rows]
    h = Histories.from_raw(ranking.vocabularies, [r["item_ids"] for r in rows],
                           [r["timestamps"] for r in rows], actions=[r["actions"] for r in rows])
    probs = ranking.score(h, Candidates.from_raw(ranking.vocabularies,
                                                 [r["candidates"] for r in rows]))
    flat = torch.tensor([[r[t][j] for t in limits.tasks] for r in got
                         for j in range(len(r["candidates"]))])
    torch.testing.assert_close(flat, probs, rtol=1e-5, atol=1e-6)
    # --ids model: the same users as rows give the same scores, written as rows
    as_rows = [{**r, "item_ids": SKUS.rows(r["item_ids"]).tolist(),
                "candidates": SKUS.rows(r["candidates"]).tolist()} for r in rows]
    model_out = tmp_path / "rows.csv"
    items, line = item_vocabulary("model", ranking.vocabularies, "best.pt")
    assert items is None and "--ids model" in line
    predict_file(ranking, limits, _write(tmp_path / "rows.csv.jsonl", as_rows), model_out,
                 items=items, progress=False)
    assert [r["candidates"] for r in _read(model_out)] == ["[9, 0, 29]", "[7]"]


def test_ids_rule_without_a_vocabulary():
    assert item_vocabulary(None, None, "old.pt")[0] is None
    assert item_vocabulary(None, None, "old.pt")[1].startswith("note: old.pt holds no id vocab")
    with pytest.raises(PredictError, match="--ids raw: old.pt holds no id vocabulary"):
        item_vocabulary("raw", None, "old.pt")
    with pytest.raises(PredictError, match="--ids must be"):
        item_vocabulary("rows", None, "old.pt")


def test_an_unknown_raw_id_is_a_bad_row_named_by_row_column_and_id(session, tmp_path):
    rows = [dict(r) for r in ROWS]
    rows[1] = {**rows[1], "item_ids": [30, 0]}  # 0 is a row of the model, not a raw id
    source = _write(tmp_path / "users.csv", rows)
    out = tmp_path / "top.csv"
    log = []
    items = session.vocabularies.items
    summary = predict_file(session, session_limits(session), source, out, items=items,
                           unknown_items="skip-user", progress=False, log=log.append)
    assert [str(b) for b in summary.skipped] == [
        "row 2: unknown item id 0 in item_ids (position 1): not one of the model's 30 raw "
        "item ids (--unknown-items drop leaves it out)"]
    assert [r["user_id"] for r in _read(out)] == ["u0", "u2"]
    with pytest.raises(BadRowError, match=r"row 2: unknown item id 0 in item_ids"):
        predict_file(session, session_limits(session), source, tmp_path / "again.csv",
                     items=items, on_error="fail", unknown_items="skip-user", progress=False)
    assert not (tmp_path / "again.csv").exists()
    with pytest.raises(ValueError, match=r"item_ids of user 1 \(position 1\): unknown raw item "
                                         r"id 0"):
        Histories.from_raw(session.vocabularies, [[1], [2, 0]])
    with pytest.raises(ValueError, match="the checkpoint holds no vocabulary"):
        Histories.from_raw(None, [[1]])


BIG = 99999999999999999999  # past int64 (and uint64)


def _parquet_big(path, column, kind):
    """A Parquet file whose ``column`` of row 2 holds an integer past int64, as ``kind``."""
    good = [[1, 2], [3, 4], [5, 6]]
    values = {"item_ids": [[1, 2], [3, 4], [5, 6]], "timestamps": [list(g) for g in good]}
    if kind == "uint64":
        values[column][1] = [3, 2**64 - 1]
        typ = pa.list_(pa.uint64())
    else:
        values[column] = [[decimal.Decimal(v) for v in r] for r in values[column]]
        values[column][1] = [decimal.Decimal(3), decimal.Decimal(BIG)]
        typ = pa.list_(pa.decimal128(20, 0))
    other = "timestamps" if column == "item_ids" else "item_ids"
    table = pa.table({"user_id": ["u0", "u1", "u2"], column: pa.array(values[column], typ),
                      other: pa.array(values[other], pa.list_(pa.int64()))})
    pq.write_table(table, path)
    return path


@pytest.mark.parametrize("case", ["csv", "jsonl", "jsonl-user", "uint64", "decimal"])
@pytest.mark.parametrize("column", ["timestamps", "item_ids"])
@pytest.mark.parametrize("ids", ["raw", "model"])
def test_an_integer_past_int64_is_a_bad_row_in_every_column_and_format(
    session, tmp_path, case, column, ids
):
    if case in ("uint64", "decimal"):
        source = _parquet_big(tmp_path / "users.parquet", column, case)
    else:
        rows = [{"user_id": f"u{u}", "item_ids": [1, 2], "timestamps": [1, 2]} for u in range(3)]
        if case == "jsonl-user":
            rows[1]["user_id"] = BIG
        else:
            rows[1][column] = [1, BIG]
        source = _write(tmp_path / f"users.{case.split('-')[0]}", rows)
    items = session.vocabularies.items if ids == "raw" else None
    log = []
    summary = predict_file(session, session_limits(session), source, tmp_path / "top.csv",
                           items=items, unknown_items="skip-user", progress=False,
                           log=log.append)
    assert [r["user_id"] for r in _read(tmp_path / "top.csv")] == ["u0", "u2"]
    (problem,) = [str(b) for b in summary.skipped]
    big = 2**64 - 1 if case == "uint64" else BIG
    if case == "jsonl-user":
        assert problem == f"row 2: user_id is {BIG}, outside the 64-bit integer range"
    elif column == "timestamps" or ids == "model":
        assert problem == f"row 2: {column}[1] is {big}, outside the 64-bit integer range"
    else:  # a raw id no vocabulary holds
        assert problem.startswith(f"row 2: unknown item id {big} in item_ids (position 1)")


def test_seen_items_are_excluded_by_default_as_the_session_does(session, tmp_path):
    source = _write(tmp_path / "users.jsonl", ROWS)
    items = session.vocabularies.items
    for exclude, out in ((False, tmp_path / "kept.parquet"), (None, tmp_path / "out.parquet")):
        options = {} if exclude is None else {"exclude_seen": exclude}  # None: the default
        predict_file(session, session_limits(session), source, out, k=30, items=items,
                     progress=False, **options)
    kept, excluded = pq.read_table(tmp_path / "kept.parquet").to_pylist(), pq.read_table(
        tmp_path / "out.parquet").to_pylist()
    for row, k, e in zip(ROWS, kept, excluded):
        assert set(row["item_ids"]) <= set(k["item_ids"]) and len(k["item_ids"]) == 30
        assert not set(row["item_ids"]) & set(e["item_ids"])
        assert e["item_ids"] == [i for i in k["item_ids"] if i not in row["item_ids"]]


def _payload(model, vocabularies=None):
    payload = {"format": 1, "config": {"model": "hstu-retrieval"}, "step": 1,
               "model_config": {"model": "HSTURetrieval", "kwargs": dict(
                   num_items=NUM_ITEMS, embedding_dim=16, backend="pytorch", max_seq_len=8,
                   dropout_ratio=0.0)},
               "model": model.state_dict()}
    if vocabularies is not None:
        payload[VOCABULARY_KEY] = vocabularies.state()
    return payload


def test_from_checkpoint_carries_the_vocabulary_and_reads_a_run_folder(session, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    torch.save(_payload(session.model, _vocab(ML_LIKE)), run / "checkpoint.pt")
    assert resolve_checkpoint(run) == run / "checkpoint.pt"
    loaded = ServingSession.from_checkpoint(run)
    assert loaded.vocabularies.items == ML_LIKE and loaded.vocabularies.source == "test data"
    torch.save(_payload(session.model), run / "best.pt")  # older: no vocabulary
    assert resolve_checkpoint(run) == run / "best.pt"
    assert ServingSession.from_checkpoint(run).vocabularies is None
    bad = _payload(session.model, IdVocabularies(Vocabulary([1]), Vocabulary([1, 2])))
    torch.save(bad, tmp_path / "bad.pt")
    with pytest.raises(ValueError, match="item vocabulary has 2 ids but the model 30 items"):
        ServingSession.from_checkpoint(tmp_path / "bad.pt")
    with pytest.raises(FileNotFoundError, match="no checkpoint at"):
        ServingSession.from_checkpoint(tmp_path / "empty-run-folder-missing")
