"""The one-user-a-line log (``.seq``: ``user item item ...``) read by path, its edge cases, and
the named sets read in it (S3-Rec's Amazon Beauty and Sports)."""

from __future__ import annotations

import gzip
import hashlib
import pathlib
import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tzrec_bench.data import DataFormatError, leave_one_out, load_dataset, user_lines
from tzrec_bench.data.load import DATA_ENV, DataOptionError

REPO = pathlib.Path(__file__).resolve().parents[3]
S3_DIR = REPO.parent / "shared" / "data" / "amazon-s3"


def _write(path: pathlib.Path, text: str) -> pathlib.Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".gz":
        path.write_bytes(gzip.compress(text.encode()))
    else:
        path.write_bytes(text.encode())
    return path


def _sequences(ds) -> dict:
    return {ds.user_raw_ids[u].item(): [ds.item_raw_ids[i].item() for i in ds.sequence(u)]
            for u in range(ds.num_users)}


def _load(path, tmp_path, **kwargs):
    return load_dataset(str(path), cache_dir=tmp_path / "cache", **kwargs)


@pytest.mark.parametrize("name", ["log.seq", "log.seq.gz", "LOG.SEQ"])
def test_each_line_is_a_user_and_its_items_in_file_order(tmp_path, name):
    path = _write(tmp_path / name, "2 30 10 20\n1 10 40\n")
    ds = _load(path, tmp_path)
    assert _sequences(ds) == {1: [10, 40], 2: [30, 10, 20]}
    assert ds.user_raw_ids.dtype == np.int64 and ds.item_raw_ids.dtype == np.int64
    assert not ds.timestamps.any()  # no timestamps: every time is 0
    assert ds.files == (name,)


def test_white_space_variants_read_alike(tmp_path):
    plain = _load(_write(tmp_path / "a" / "log.seq", "1 5 6 7\n2 8 9\n"), tmp_path)
    varied = _load(_write(tmp_path / "b" / "log.seq",
                          "  1\t5  6 \t7  \r\n2 8\t\t9"), tmp_path)  # no final newline
    assert _sequences(varied) == _sequences(plain) == {1: [5, 6, 7], 2: [8, 9]}


def test_blank_lines_are_skipped_and_errors_count_them(tmp_path):
    path = _write(tmp_path / "log.seq", "\n1 5 6\n \t\n\n2 7 8\n\n3\n")
    with pytest.raises(DataFormatError, match=re.escape(
            f"{path}: line 7: user '3' has no items; expected 'user item item ...' per line")):
        _load(path, tmp_path)
    path.write_text("\n1 5 6\n \t\n\n2 7 8\n\n")
    assert _sequences(_load(path, tmp_path)) == {1: [5, 6], 2: [7, 8]}


def test_a_user_with_one_item_is_one_event_and_not_evaluated(tmp_path):
    ds = _load(_write(tmp_path / "log.seq", "1 5\n2 5 6 7\n"), tmp_path)
    assert _sequences(ds) == {1: [5], 2: [5, 6, 7]}
    split = leave_one_out(ds)
    assert len(split.test) == 1  # users of fewer than 3 events are kept out of the test


@pytest.mark.parametrize("files, places", [
    ({"log.seq": "1 5 6\n2 7 8\n\n1 9\n"}, ["log.seq line 1", "log.seq line 4"]),
    ({"a.seq": "1 5 6\n2 7\n", "b.seq": "3 4\n2 9 9\n"}, ["a.seq line 2", "b.seq line 2"]),
])
def test_a_user_on_two_lines_is_refused_naming_both(tmp_path, files, places):
    for name, text in files.items():
        _write(tmp_path / "log" / name, text)
    first, second = (f"{tmp_path / 'log' / place}" for place in places)
    user = "1" if len(files) == 1 else "2"
    with pytest.raises(DataFormatError, match=re.escape(
            f"user {user!r} is on two lines: {first} and {second}; expected one line per user")):
        _load(tmp_path / "log", tmp_path)


def test_a_user_on_two_lines_is_found_across_blocks(tmp_path, monkeypatch):
    monkeypatch.setattr(user_lines, "BLOCK_BYTES", 7)  # lines cut across blocks
    text = "".join(f"{u} {u + 100} {u + 200}\n" for u in range(1, 40)) + "\n7 1\n"
    path = _write(tmp_path / "log.seq", text)
    with pytest.raises(DataFormatError, match=re.escape(
            f"user '7' is on two lines: {path} line 7 and {path} line 41")):
        _load(path, tmp_path)


def test_string_ids_and_integer_ids_are_told_apart_per_role(tmp_path):
    ds = _load(_write(tmp_path / "log.seq", "alice 10 20\nbob 20 30\n"), tmp_path)
    assert ds.user_raw_ids.tolist() == ["alice", "bob"]
    assert ds.item_raw_ids.dtype == np.int64
    assert _sequences(ds) == {"alice": [10, 20], "bob": [20, 30]}
    # "042" is not the integer 42 written the one way: every item id is then a string
    ds = _load(_write(tmp_path / "b" / "log.seq", "1 042 B7\n2 42\n"), tmp_path)
    assert ds.user_raw_ids.dtype == np.int64
    assert _sequences(ds) == {1: ["042", "B7"], 2: ["42"]}


@pytest.mark.parametrize("name", ["log.seq", "log.txt"])
def test_an_integer_beyond_int64_makes_string_ids(tmp_path, name):
    big = str(2**63)  # 19 digits, one past int64
    ds = _load(_write(tmp_path / name, f"1 {big}\n2 7\n"), tmp_path)
    assert ds.user_raw_ids.dtype == np.int64
    assert ds.item_raw_ids.tolist() == ["7", big]  # sorted as strings


@pytest.mark.parametrize("text", ["", "\n\n  \n"])
def test_a_file_without_users_is_refused(tmp_path, text):
    path = _write(tmp_path / "log.seq", text)
    with pytest.raises(DataFormatError, match=re.escape(f"{path}: no events")):
        _load(path, tmp_path)


def test_a_column_mapping_is_refused(tmp_path):
    path = _write(tmp_path / "log.seq", "1 2 3\n")
    with pytest.raises(DataFormatError, match=re.escape(
            f"{path}: --columns maps user=uid,item=item_id,time=timestamp,rating=,action=, but "
            "a one-user-a-line log (.seq) has no columns to map")):
        _load(path, tmp_path, columns="user=uid")


def test_a_corrupt_gzip_is_refused_naming_the_file(tmp_path):
    path = tmp_path / "log.seq.gz"
    path.write_bytes(gzip.compress(b"1 2 3\n" * 100)[:30])
    with pytest.raises(DataFormatError, match=re.escape(f"{path}: cannot be read")):
        _load(path, tmp_path)


def test_a_txt_file_of_user_lines_points_to_the_suffix(tmp_path):
    path = _write(tmp_path / "Beauty.txt", "1 1 2 3 4 5\n")
    with pytest.raises(DataFormatError, match=re.escape(
            "one user a line, 'user item item ...', is read from a file ending in .seq")):
        _load(path, tmp_path)


def test_a_folder_of_seq_and_txt_files_is_refused(tmp_path):
    _write(tmp_path / "log" / "a.seq", "1 2 3\n")
    _write(tmp_path / "log" / "b.txt", "1 2\n")
    with pytest.raises(DataFormatError, match="files of 2 formats"):
        _load(tmp_path / "log", tmp_path)


@settings(max_examples=20, deadline=None)
@given(users=st.dictionaries(st.integers(1, 50), st.lists(st.integers(1, 9), min_size=1,
                                                            max_size=8), min_size=1, max_size=8),
       block=st.integers(3, 40))
def test_reads_as_the_same_events_written_one_a_line(tmp_path_factory, users, block):
    """Any users, any block size: the same data set as the ``user item`` text log of the
    same events in the same order."""
    folder = tmp_path_factory.mktemp("seq")
    seq = "".join(f"{u} {' '.join(map(str, items))}\n" for u, items in users.items())
    txt = "".join(f"{u} {i}\n" for u, items in users.items() for i in items)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(user_lines, "BLOCK_BYTES", block)
        ds = _load(_write(folder / "log.seq", seq), folder)
    expected = _load(_write(folder / "log.txt", txt), folder)
    assert _sequences(ds) == _sequences(expected) == users
    assert ds.num_items == expected.num_items and ds.num_events == expected.num_events


# -- the named sets ----------------------------------------------------------------------------


def test_a_named_set_reads_its_txt_file_as_user_lines(tmp_path, monkeypatch):
    _write(tmp_path / "amazon-s3" / "Beauty.txt", "1 1 2 3\n2 2 3\n")
    monkeypatch.setenv(DATA_ENV, str(tmp_path))  # both sets share the folder amazon-s3
    ds = load_dataset("amazon-beauty", cache_dir=tmp_path / "cache")
    assert _sequences(ds) == {1: [1, 2, 3], 2: [2, 3]}
    assert ds.files == ("Beauty.txt",)
    with pytest.raises(FileNotFoundError, match=re.escape(
            f"{tmp_path / 'amazon-s3' / 'Sports_and_Outdoors.txt'} not found (nor "
            "Sports_and_Outdoors.txt.gz): expected S3-Rec's Amazon Sports and Outdoors")):
        load_dataset("amazon-sports", cache_dir=tmp_path / "cache")


def test_a_named_sets_folder_is_named_when_none_is_given(monkeypatch):
    monkeypatch.delenv(DATA_ENV, raising=False)
    with pytest.raises(DataOptionError, match=re.escape(
            f"--data amazon-sports needs the folder of its files (or {DATA_ENV} set to a "
            "folder holding amazon-s3/)")):
        load_dataset("amazon-sports")


# SOURCE.md: file, md5 of the uncompressed file, users, items, actions, longest user
PUBLISHED = {
    "amazon-beauty": ("Beauty.txt.gz", "cb03635343187f36526ed4ba48102b53",
                      22363, 12101, 198502, 204),
    "amazon-sports": ("Sports_and_Outdoors.txt.gz", "9691c051152edf528a56581da65b1ce3",
                      35598, 18357, 296337, 296),
}


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_the_s3rec_sets_match_their_published_counts(tmp_path, name):
    file, md5, users, items, actions, longest = PUBLISHED[name]
    if not (S3_DIR / file).is_file():
        pytest.skip(f"{file} is not in {S3_DIR} (never committed)")
    assert hashlib.md5(gzip.decompress((S3_DIR / file).read_bytes())).hexdigest() == md5
    ds = load_dataset(name, S3_DIR, cache_dir=tmp_path)
    assert (ds.num_users, ds.num_items, ds.num_events) == (users, items, actions)
    assert int(ds.lengths.max()) == longest
    assert ds.user_raw_ids.tolist() == list(range(1, users + 1))  # one line each, ids from 1
    assert ds.item_raw_ids.tolist() == list(range(1, items + 1))
    assert ds.item_raw_ids[ds.sequence(0)][:5].tolist() == [1, 2, 3, 4, 5]  # file order
    assert len(leave_one_out(ds).test) == users  # every user has at least 5 actions
