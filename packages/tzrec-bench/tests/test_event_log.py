"""Event logs read by path: formats, column mapping, ids of any type, order, errors, k-core,
the memory-mapped cache, and the named set on the same reader (amazon-games)."""

from __future__ import annotations

import gzip
import json
import pathlib
import re
from typing import List

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tzrec_bench.data import DataFormatError, leave_one_out, load_dataset
from tzrec_bench.data.event_log import Columns

REPO = pathlib.Path(__file__).resolve().parents[3]
AMAZON_DIR = REPO.parent / "shared" / "data" / "amazon-games"

# (user, item, time) in file order: user "b" has a tie at time 5 (items y then x)
EVENTS = [("b", "y", 5), ("a", "x", 9), ("b", "x", 5), ("a", "z", 1), ("b", "z", 2),
          ("a", "y", 9)]
# grouped by user (rows in raw id order), sorted by time, ties in file order
EXPECTED = {"a": ["z", "x", "y"], "b": ["z", "y", "x"]}


def _sequences(ds) -> dict:
    return {ds.user_raw_ids[u].item(): [ds.item_raw_ids[i].item() for i in ds.sequence(u)]
            for u in range(ds.num_users)}


def _write_csv(path: pathlib.Path, header: str, rows: List[tuple],
               gz: bool = False) -> pathlib.Path:
    text = header + "\n" + "".join(",".join(map(str, row)) + "\n" for row in rows)
    path.parent.mkdir(parents=True, exist_ok=True)
    if gz:
        path = path.with_name(path.name + ".gz")
        with gzip.open(path, "wt") as f:
            f.write(text)
    else:
        path.write_text(text)
    return path


def _load(path, tmp_path, **kwargs):
    return load_dataset(str(path), cache_dir=tmp_path / "cache", **kwargs)


@pytest.mark.parametrize("gz", [False, True], ids=["plain", "gzip"])
def test_csv_with_mapped_columns_groups_sorts_and_breaks_ties_by_file_order(tmp_path, gz):
    path = _write_csv(tmp_path / "log.csv", "uid,sku,ts,extra",
                      [(u, i, t, "ignored") for u, i, t in EVENTS], gz)
    ds = _load(path, tmp_path, columns="user=uid,item=sku,time=ts")
    assert _sequences(ds) == EXPECTED
    assert ds.timestamps.tolist() == [1, 9, 9, 2, 5, 5]
    assert ds.item_raw_ids.tolist() == ["x", "y", "z"]  # item rows follow the raw ids
    vocabularies = ds.id_vocabularies("log")
    assert vocabularies.items.kind == "str" and vocabularies.users.raw([1]) == ["b"]


def test_parquet_folder_is_read_in_file_name_order_with_integer_ids(tmp_path):
    table = pa.table({"user_id": [7, 3, 7, 3], "item_id": [10**12, 5, 5, 10**12],
                      "timestamp": [1, 1, 1, 1]})
    (tmp_path / "log").mkdir()
    pq.write_table(table.slice(2), tmp_path / "log" / "part-1.parquet")
    pq.write_table(table.slice(0, 2), tmp_path / "log" / "part-0.parquet")
    ds = _load(tmp_path / "log", tmp_path)
    assert ds.user_raw_ids.dtype == np.int64 and ds.item_raw_ids.tolist() == [5, 10**12]
    # every time ties: the file order (part-0 before part-1) decides
    assert _sequences(ds) == {3: [5, 10**12], 7: [10**12, 5]}


def test_jsonl_and_text_formats(tmp_path):
    lines = "".join(json.dumps({"user_id": u, "item_id": i, "timestamp": t}) + "\n"
                    for u, i, t in EVENTS)
    (tmp_path / "log.jsonl").write_text(lines)
    assert _sequences(_load(tmp_path / "log.jsonl", tmp_path)) == EXPECTED
    # 'user item' text without time: the file order is the order; timestamps are 0
    with gzip.open(tmp_path / "log.txt.gz", "wt") as f:
        f.write("".join(f"{u} {i}\n" for u, i, _ in EVENTS))
    ds = _load(tmp_path / "log.txt.gz", tmp_path)
    assert _sequences(ds) == {"a": ["x", "z", "y"], "b": ["y", "x", "z"]}
    assert not ds.timestamps.any()


def test_no_time_column_means_file_order_and_integer_text_ids_are_integers(tmp_path):
    path = _write_csv(tmp_path / "log.csv", "user_id,item_id", [(2, 30), (1, 7), (2, 4),
                                                                (1, 100)])
    ds = _load(path, tmp_path)
    assert _sequences(ds) == {1: [7, 100], 2: [30, 4]}
    assert ds.item_raw_ids.dtype == np.int64  # "4" < "30" as integers, not as text
    assert ds.item_raw_ids.tolist() == [4, 7, 30, 100]
    # "007" is not written the way an integer is: the ids stay strings
    path = _write_csv(tmp_path / "s.csv", "user_id,item_id", [(1, "007"), (1, 7)])
    assert _load(path, tmp_path).item_raw_ids.tolist() == ["007", "7"]


def test_ratings_and_actions_are_read_when_mapped(tmp_path):
    path = _write_csv(tmp_path / "log.csv", "u,i,t,stars,acts",
                      [("a", "x", 2, 4.5, 3), ("a", "y", 1, 1.0, 1)])
    ds = _load(path, tmp_path, columns="user=u,item=i,time=t,rating=stars,action=acts")
    assert ds.ratings.tolist() == [1.0, 4.5] and ds.actions.tolist() == [1, 3]


def test_k_core_filter_drops_users_and_items_until_none_is_left(tmp_path):
    rows = [("a", "x", 1), ("a", "y", 2), ("b", "x", 1), ("b", "y", 2), ("c", "x", 1),
            ("c", "z", 2)]  # z has 1 event; once dropped, c has 1 event and goes too
    path = _write_csv(tmp_path / "log.csv", "user_id,item_id,timestamp", rows)
    ds = _load(path, tmp_path, min_events=2)
    assert _sequences(ds) == {"a": ["x", "y"], "b": ["x", "y"]}
    assert ds.num_items == 2 and ds.num_events == 4
    assert _load(path, tmp_path).num_events == 6  # another option, another cache entry


def test_second_load_maps_the_cache(tmp_path, monkeypatch):
    path = _write_csv(tmp_path / "log.csv", "user_id,item_id,timestamp", EVENTS)
    first = _load(path, tmp_path)
    import tzrec_bench.data.load as load

    monkeypatch.setattr(load, "write_event_log", lambda *a: pytest.fail("read again"))
    second = _load(path, tmp_path)
    assert isinstance(second.item_ids, np.memmap)
    assert second.fingerprint == first.fingerprint and second.fingerprint
    assert _sequences(second) == EXPECTED


def test_the_fingerprint_follows_the_events_not_the_file(tmp_path):
    a = _write_csv(tmp_path / "a" / "log.csv", "user_id,item_id,timestamp", EVENTS)
    b = _write_csv(tmp_path / "b" / "other.csv", "user_id,item_id,timestamp", EVENTS)
    c = _write_csv(tmp_path / "c" / "log.csv", "user_id,item_id,timestamp", EVENTS[:-1])
    prints = [_load(p, tmp_path).fingerprint for p in (a, b, c)]
    assert prints[0] == prints[1] != prints[2]


@pytest.mark.parametrize("header,rows,message", [
    ("uid,item_id", [("a", "x")],
     r"log.csv: no column for user \('user_id'\); its columns are uid, item_id "
     r"\(map them with --columns"),
    ("user_id,item_id,timestamp", [("a", "x", 1), ("b", "y", "soon")],
     r"log.csv: row 2 \(line 3\), column 'timestamp': 'soon' is not an integer"),
    ("user_id,item_id,timestamp", [("a", "x", 1), ("b", "y", 99999999999999999999)],
     r"log.csv: row 2 \(line 3\), column 'timestamp': 99999999999999999999 does not fit in "
     r"int64"),
    ("user_id,item_id,timestamp", [("a", "x", 1), ("b", "y")],
     r"log.csv: row 2 \(line 3\): 2 fields; expected 3 \(user_id, item_id, timestamp\)"),
])
def test_bad_csv_names_the_file_line_and_column(tmp_path, header, rows, message):
    path = _write_csv(tmp_path / "log.csv", header, rows)
    with pytest.raises(DataFormatError, match=message):
        _load(path, tmp_path)
    assert not [p for p in (tmp_path / "cache").glob("*") if p.is_dir() and
                not p.name.endswith(".tmp")]


def test_bad_parquet_values_name_the_row_and_column(tmp_path):
    pq.write_table(pa.table({"user_id": ["a", None], "item_id": ["x", "y"]}),
                   tmp_path / "nulls.parquet")
    with pytest.raises(DataFormatError, match=r"nulls.parquet: row 2, column 'user_id': empty"):
        _load(tmp_path / "nulls.parquet", tmp_path)
    pq.write_table(pa.table({"user_id": [1.5], "item_id": ["x"]}), tmp_path / "floats.parquet")
    with pytest.raises(DataFormatError, match=r"column 'user_id' holds double values; expected "
                                              "user ids that are integers or strings"):
        _load(tmp_path / "floats.parquet", tmp_path)
    pq.write_table(pa.table({"user_id": pa.array([1, 2**63 + 5], pa.uint64()),
                             "item_id": ["x", "y"]}), tmp_path / "big.parquet")
    with pytest.raises(DataFormatError, match=r"big.parquet: row 2, column 'user_id': "
                                              r"9223372036854775813 does not fit in int64"):
        _load(tmp_path / "big.parquet", tmp_path)


def test_two_kinds_of_ids_or_an_unknown_suffix_are_refused(tmp_path):
    folder = tmp_path / "log"
    folder.mkdir()
    pq.write_table(pa.table({"user_id": [1], "item_id": ["x"]}), folder / "0.parquet")
    pq.write_table(pa.table({"user_id": ["u"], "item_id": ["x"]}), folder / "1.parquet")
    with pytest.raises(DataFormatError, match=r"1.parquet: user ids are strs here but ints in "
                                              r".*0.parquet"):
        _load(folder, tmp_path)
    (tmp_path / "log.xlsx").write_text("")
    with pytest.raises(DataFormatError, match=r"log.xlsx: unknown format"):
        _load(tmp_path / "log.xlsx", tmp_path)


def test_columns_parse_and_their_errors():
    assert Columns.parse("user=uid,time=") == Columns(user="uid", time=None)
    assert Columns.parse(Columns(item="sku").text()) == Columns(item="sku")
    for text, message in (("who=uid", "'who=uid' is not KEY=COLUMN"),
                          ("user=a,user=b", "user given twice"),
                          ("item=", "item needs a column name")):
        with pytest.raises(ValueError, match=re.escape(message)):
            Columns.parse(text)


@pytest.mark.skipif(not (AMAZON_DIR / "Video.txt.gz").is_file(),
                    reason=f"Amazon Games is not at {AMAZON_DIR} (never committed)")
def test_amazon_games_matches_its_published_counts(tmp_path):
    ds = load_dataset("amazon-games", AMAZON_DIR, cache_dir=tmp_path)
    assert (ds.num_users, ds.num_items, ds.num_events) == (31013, 23715, 287107)
    assert ds.user_raw_ids.tolist() == list(range(1, 31014))
    assert ds.item_raw_ids[ds.sequence(0)][:3].tolist() == [6393, 13504, 14087]  # file order
    assert len(leave_one_out(ds).test) == 30901  # SOURCE.md: 112 users have under 3 actions


@settings(max_examples=25, deadline=None)
@given(events=st.lists(st.tuples(st.integers(0, 6), st.integers(0, 9), st.integers(0, 4)),
                       min_size=1, max_size=60),
       chunk=st.integers(1, 7), min_events=st.sampled_from([0, 2, 3]))
def test_chunked_grouping_matches_a_stable_sort(tmp_path_factory, events, chunk, min_events):
    """Any log, any chunk size: rows are the users' events stably sorted by time (file order
    on ties), after the k-core filter computed the plain way."""
    import tzrec_bench.data.grouping as grouping

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(grouping, "CHUNK", chunk)
        _check_grouping(tmp_path_factory.mktemp("log"), events, min_events)


def _check_grouping(tmp, events, min_events):
    path = _write_csv(tmp / "log.csv", "user_id,item_id,timestamp",
                      [(f"u{u}", i, t) for u, i, t in events])
    kept = list(events)
    while min_events > 1:  # the k-core, by counting
        users = {u: sum(e[0] == u for e in kept) for u, _, _ in kept}
        items = {i: sum(e[1] == i for e in kept) for _, i, _ in kept}
        left = [e for e in kept if users[e[0]] >= min_events and items[e[1]] >= min_events]
        if left == kept:
            break
        kept = left
    if not kept:
        with pytest.raises(DataFormatError, match="no events left after the k-core filter"):
            _load(path, tmp, min_events=min_events)
        return
    ds = _load(path, tmp, min_events=min_events)
    expected = {}
    for u, i, t in sorted(kept, key=lambda e: (f"u{e[0]}", e[2])):  # stable: file order
        expected.setdefault(f"u{u}", []).append((i, t))
    got = {ds.user_raw_ids[r].item(): [(ds.item_raw_ids[i].item(), int(t)) for i, t in zip(
        ds.sequence(r), ds.timestamps[ds.offsets[r]:ds.offsets[r + 1]])]
        for r in range(ds.num_users)}
    assert got == expected


def test_files_that_disagree_on_time_or_hold_no_event_are_named(tmp_path):
    folder = tmp_path / "log"
    _write_csv(folder / "0.csv", "user_id,item_id,timestamp", [("a", "x", 1)])
    _write_csv(folder / "1.csv", "user_id,item_id", [("b", "y")])
    with pytest.raises(DataFormatError, match=r"1.csv: lacks the time column that the files "
                                              "before it have"):
        _load(folder, tmp_path)
    empty = _write_csv(tmp_path / "empty.csv", "user_id,item_id", [])
    with pytest.raises(DataFormatError, match=r"empty.csv: no events"):
        _load(empty, tmp_path)
