"""Event logs at the edges of a user's data folder and formats: the files read and skipped
named in the run's header, folders of mixed formats or the same log twice refused, text
headers, TSV, empty ids, and rows counted from 1 in every format's errors."""

from __future__ import annotations

import gzip
import json
import pathlib
import re

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tzrec_bench.cli import main
from tzrec_bench.data import DataFormatError, load_dataset
from tzrec_bench.data.log_files import describe_files

MODEL = [
    "--model", "hstu-retrieval", "--max-seq-len", "12", "--embedding-dim", "16",
    "--num-layers", "1", "--num-negatives", "16", "--batch-size", "16", "--device", "cpu",
    "--no-progress", "--no-plot", "--max-steps", "1",
]


def _load(path, tmp_path, **kwargs):
    return load_dataset(str(path), cache_dir=tmp_path / "cache", **kwargs)


def _refused(path, tmp_path, message: str, **kwargs) -> None:
    with pytest.raises(DataFormatError, match=message):
        _load(path, tmp_path, **kwargs)


def _table(users: int = 40, events: int = 6) -> pa.Table:
    """``users`` x ``events`` integer-id events in time order."""
    user = np.repeat(np.arange(users), events)
    return pa.table({"user_id": user, "item_id": (user * 7 + np.tile(np.arange(events), users))
                     % 30, "timestamp": np.arange(len(user))})


def _parquet_folder(folder: pathlib.Path) -> pathlib.Path:
    folder.mkdir(parents=True)
    table = _table()
    pq.write_table(table.slice(0, 100), folder / "part-0.parquet")
    pq.write_table(table.slice(100), folder / "part-1.parquet")
    return folder


# -- the files read, named in the header ------------------------------------------------------


def test_train_and_evaluate_headers_name_the_files_read_and_skipped(tmp_path, capsys):
    data = _parquet_folder(tmp_path / "log")
    (data / "notes.md").write_text("# my log\n")
    (data / "_SUCCESS").write_text("")  # a writer's bookkeeping: passed over silently
    assert main(["train", "--data", str(data), "--cache-dir", str(tmp_path / "cache"),
                 "--out-dir", str(tmp_path / "run"), *MODEL]) == 0
    line = ("  read 2 files: part-0.parquet, part-1.parquet; skipped 1 file of unknown kind: "
            "notes.md\n")
    assert line in capsys.readouterr().out
    assert main(["evaluate", str(tmp_path / "run"), "--cache-dir", str(tmp_path / "cache")]) == 0
    assert line in capsys.readouterr().out


def test_the_dataset_names_its_files_from_the_cache_too(tmp_path):
    data = _parquet_folder(tmp_path / "log")
    (data / "sub").mkdir()
    pq.write_table(_table().slice(0, 6), data / "sub" / "part-2.parquet")
    for _ in range(2):  # read, then mapped from the cache
        ds = _load(data, tmp_path)
        assert ds.files == ("part-0.parquet", "part-1.parquet", "sub/part-2.parquet")
        assert ds.skipped_files == ()
    assert _load(data / "part-1.parquet", tmp_path).files == ("part-1.parquet",)


def test_a_long_file_list_is_abbreviated():
    names = [f"part-{i:03d}.parquet" for i in range(120)]
    assert describe_files(names) == "120 files: part-000.parquet ... part-119.parquet"
    assert describe_files(names[:3]) == ("3 files: part-000.parquet, part-001.parquet, "
                                         "part-002.parquet")
    assert describe_files(names[:1], ["a", "b"]) == (
        "1 file: part-000.parquet; skipped 2 files of unknown kind: a, b")
    assert describe_files([]) == ""


# -- folders refused ----------------------------------------------------------------------------


def test_a_readme_beside_parquet_is_refused_naming_each_format(tmp_path, capsys):
    data = _parquet_folder(tmp_path / "log")
    (data / "README.txt").write_text("my events\nread me first\n")
    message = (f"{data}: files of 2 formats: text (README.txt); parquet (part-0.parquet, "
               "part-1.parquet); pass one file, or a folder of one format")
    _refused(data, tmp_path, re.escape(message))
    # with a rating mapped it was a KeyError traceback: one line, exit 1
    assert main(["train", "--data", str(data), "--columns", "rating=timestamp",
                 "--cache-dir", str(tmp_path / "cache"), "--out-dir", str(tmp_path / "run"),
                 *MODEL]) == 1
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and err.count("\n") == 1


def test_a_pretty_printed_schema_json_is_named_as_no_log(tmp_path):
    (tmp_path / "log").mkdir()
    (tmp_path / "log" / "events.jsonl").write_text('{"user_id": 1, "item_id": 2}\n')
    # pyarrow read this object as the event (user "string", item "string")
    schema = {"user_id": "string", "item_id": "string"}
    (tmp_path / "log" / "schema.json").write_text(json.dumps(schema, indent=2))
    message = (r"log/schema.json: row 1: not a JSON object on one line \(.*\); expected one "
               r"object per line")
    _refused(tmp_path / "log", tmp_path, message)
    (tmp_path / "log" / "schema.json").write_text(json.dumps({"user_id": "int"}, indent=2))
    _refused(tmp_path / "log", tmp_path, message)  # not "no column for item"


@pytest.mark.parametrize("names,message", [
    (("events.csv", "events.parquet"), "events.csv and events.parquet look like the same log "
                                       "twice (one name, two suffixes); keep one of them"),
    (("events.csv", "events.csv.gz"), "events.csv and events.csv.gz look like the same log"),
    (("a.csv", "sub/b.csv"), "a.csv and sub/b.csv hold the same bytes: the same log twice"),
])
def test_the_same_log_twice_is_refused_naming_both_files(tmp_path, names, message):
    text = "user_id,item_id\n1,2\n1,3\n"
    for name in names:
        path = tmp_path / "log" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if name.endswith(".parquet"):
            pq.write_table(pa.table({"user_id": [1, 1], "item_id": [2, 3]}), path)
        elif name.endswith(".gz"):
            path.write_bytes(gzip.compress(text.encode()))
        else:
            path.write_text(text)
    _refused(tmp_path / "log", tmp_path, re.escape(message))


def test_files_of_equal_size_but_other_bytes_are_both_read(tmp_path):
    (tmp_path / "log").mkdir()
    (tmp_path / "log" / "a.csv").write_text("user_id,item_id\n1,2\n")
    (tmp_path / "log" / "b.csv").write_text("user_id,item_id\n1,3\n")
    assert _load(tmp_path / "log", tmp_path).item_raw_ids.tolist() == [2, 3]


# -- text logs and TSV --------------------------------------------------------------------------


@pytest.mark.parametrize("header,columns", [
    ("user item time", None), ("user_id\titem_id\ttimestamp", None),
    ("uid sku ts", "user=uid,item=sku,time=ts"),
])
def test_a_text_header_line_is_skipped_and_integer_ids_stay_integers(tmp_path, header, columns):
    sep = "\t" if "\t" in header else " "
    rows = [(1, 20, 5), (2, 10, 1), (1, 10, 2)]
    (tmp_path / "log.txt").write_text(
        header + "\n" + "".join(sep.join(map(str, row)) + "\n" for row in rows))
    ds = _load(tmp_path / "log.txt", tmp_path, columns=columns)
    assert ds.user_raw_ids.tolist() == [1, 2] and ds.item_raw_ids.tolist() == [10, 20]
    assert ds.timestamps.tolist() == [2, 5, 1] and ds.num_events == 3


def test_a_text_header_may_name_a_rating_and_without_one_it_is_refused(tmp_path):
    (tmp_path / "log.txt").write_text("user item time stars\na x 2 4.5\na y 1 1\n")
    ds = _load(tmp_path / "log.txt", tmp_path, columns="rating=stars")
    assert ds.ratings.tolist() == [1.0, 4.5]
    (tmp_path / "bare.txt").write_text("a x 2\n")
    _refused(tmp_path / "bare.txt", tmp_path, r"bare.txt: --columns maps rating, but a text log "
             r"without a header line has only 'user item \[time\]'", columns="rating=stars")


@pytest.mark.parametrize("text", ["this is not an event log at all", "word"])
def test_a_text_line_of_other_fields_names_the_file_and_row(tmp_path, text):
    (tmp_path / "notes.txt").write_text(f"user item\n1 2\n{text}\n")
    count = len(text.split())
    _refused(tmp_path / "notes.txt", tmp_path, re.escape(
        f"notes.txt: row 2 (line 3): {count} field{'s' * (count > 1)}; expected 2 (user, "
        "item)"))


@pytest.mark.parametrize("gz", [False, True], ids=["plain", "gzip"])
def test_tsv_is_read_with_its_header_row(tmp_path, gz):
    text = "item_id\tuser_id\tnote\n10\t1\ta, b\n20\t1\tc\n"
    path = tmp_path / ("log.tsv.gz" if gz else "log.tsv")
    path.write_bytes(gzip.compress(text.encode()) if gz else text.encode())
    ds = _load(path, tmp_path)
    assert ds.user_raw_ids.tolist() == [1] and ds.item_raw_ids.tolist() == [10, 20]


# -- empty ids and rows counted from 1 ----------------------------------------------------------


@pytest.mark.parametrize("name,text,message", [
    ("log.csv", "user_id,item_id\n1,2\n,3\n", "row 2, column 'user_id': empty"),
    ("log.csv", "user_id,item_id\n1,2\n1,\n", "row 2, column 'item_id': empty"),
    ("log.tsv", "user_id\titem_id\n1\t2\n\t3\n", "row 2, column 'user_id': empty"),
    ("log.txt", "1\t2\n\t3\n", "row 2, column 'user': empty"),
])
def test_an_empty_id_field_is_refused(tmp_path, name, text, message):
    (tmp_path / name).write_text(text)
    role = re.search(r"'(user|item)", message).group(1)
    article = "an" if role == "item" else "a"
    _refused(tmp_path / name, tmp_path, re.escape(
        f"{name}: {message}; every event needs {article} {role} id"))


@pytest.mark.parametrize("text,message", [
    ('{"user_id": 1, "item_id": 2}\n{"user_id": 1, "item_id": 2\n',
     "row 2: not a JSON object on one line"),
    ('{"user_id": 1, "item_id": 2}\n\n{"user_id": 1 "item_id": 2}\n',
     "row 2 (line 3): not a JSON object on one line"),
    ('{"user_id": 1, "item_id": 2}\n{"user_id": 99999999999999999999, "item_id": 2}\n',
     "row 2, column 'user_id': 99999999999999999999 does not fit in int64"),
    ('{"user_id": 1, "item_id": 2}\n{"user_id": "u", "item_id": 2}\n',
     "row 2, column 'user_id': a string where row 1 holds a number"),
    ('{"user_id": 1, "item_id": 2}\n[1, 2]\n', "row 2: a JSON list; expected one object"),
])
def test_jsonl_errors_count_rows_from_1(tmp_path, text, message):
    (tmp_path / "log.jsonl").write_text(text)
    _refused(tmp_path / "log.jsonl", tmp_path, re.escape(f"log.jsonl: {message}"))


@pytest.mark.parametrize("text,message", [
    ("user_id,item_id,timestamp\n1,2,3\n\n1,2,x\n",
     "row 2 (line 4), column 'timestamp': 'x' is not an integer"),
    ("user_id,item_id\n1,2\n1,2,3\n", "row 2 (line 3): 3 fields; expected 2"),
])
def test_csv_errors_count_data_rows_from_1_and_give_the_line(tmp_path, text, message):
    (tmp_path / "log.csv").write_text(text)
    _refused(tmp_path / "log.csv", tmp_path, re.escape(f"log.csv: {message}"))
