"""tzrec_bench.data: the synthetic generator, the file loaders, the cache, the split, batching."""

from __future__ import annotations

import gzip
import os
import pathlib
import re
from typing import List, Tuple

import numpy as np
import pytest
import torch

from tzrec_bench.data import (
    DATASETS,
    Action,
    DataFormatError,
    SequenceDataset,
    default_cache_dir,
    leave_one_out,
    load_dataset,
    make_batch,
    make_eval_batch,
    row_batches,
    synthetic,
)
from tzrec_bench.data.movielens import MovieLens
from tzrec_bench.data.synthetic import MIN_LENGTH

REPO = pathlib.Path(__file__).resolve().parents[3]
# never copied into the repository: GroupLens' license forbids redistributing it
ML_100K_DIR = REPO.parent / "shared" / "data" / "ml-100k"


def _write(path: pathlib.Path, text: str, gz: bool) -> pathlib.Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if gz:
        path = path.with_name(path.name + ".gz")
        with gzip.open(path, "wt") as f:
            f.write(text)
    else:
        path.write_text(text)
    return path


def _rows(ds: SequenceDataset) -> List[List[int]]:
    """Each row's raw item ids."""
    return [ds.item_raw_ids[ds.sequence(u)].tolist() for u in range(ds.num_users)]


# -- synthetic ---------------------------------------------------------------------------------


def test_synthetic_is_deterministic_by_seed():
    a, b = synthetic(300, 500, seed=7), synthetic(300, 500, seed=7)
    for field in ("offsets", "item_ids", "timestamps", "ratings", "actions", "item_raw_ids"):
        assert np.array_equal(getattr(a, field), getattr(b, field)), field
    assert not np.array_equal(synthetic(300, 500, seed=8).item_ids[:100], a.item_ids[:100])


def test_synthetic_has_power_law_popularity_and_sorted_times():
    ds = synthetic(1000, 2000, seed=0)
    counts = np.sort(np.bincount(ds.item_ids, minlength=ds.num_items))[::-1]
    top_decile_share = counts[: ds.num_items // 10].sum() / counts.sum()
    assert top_decile_share > 0.4, top_decile_share  # uniform popularity would give ~0.1
    for u in range(ds.num_users):
        times = ds.timestamps[ds.offsets[u] : ds.offsets[u + 1]]
        assert np.all(np.diff(times) >= 0)
    assert ds.lengths.min() >= MIN_LENGTH and ds.lengths.max() <= 1000
    assert np.median(ds.lengths) > 2 * MIN_LENGTH  # heavy-tailed, not all at the minimum
    assert set(np.unique(ds.ratings)) <= {1.0, 2.0, 3.0, 4.0, 5.0}
    assert np.all(ds.actions & Action.CLICK)
    assert np.array_equal(ds.actions & Action.LIKE != 0, ds.ratings == 5)
    assert ds.item_ids.dtype == np.int64 and ds.item_ids.max() < ds.num_items


def test_synthetic_through_load_dataset_takes_options():
    ds = load_dataset("synthetic", seed=3, num_users=50, num_items=80)
    assert ds.name == "synthetic" and ds.num_users == 50 and ds.num_items <= 80
    assert np.array_equal(ds.item_ids, synthetic(50, 80, seed=3).item_ids)


def test_synthetic_rejects_bad_sizes():
    with pytest.raises(ValueError, match=r"^num_items must be at least 1; got 0$"):
        synthetic(10, 0)


# -- loaders on small files in the real formats ------------------------------------------------

# (user, item, rating, timestamp) in file order: unsorted, with three events of user 1 at 300
EVENTS = [(2, 30, 4, 200), (1, 10, 5, 300), (1, 20, 3, 100), (2, 10, 2, 100), (1, 40, 1, 300),
          (1, 5, 4, 300)]
# sorted by time, ties by raw item id
EXPECTED_ROWS = [[20, 5, 10, 40], [10, 30]]
EXPECTED_TIMES = [100, 300, 300, 300, 100, 200]
EXPECTED_RATINGS = [3, 4, 5, 1, 2, 4]


def _movielens_text(name: str, events: List[Tuple]) -> Tuple[str, str]:
    """(file name, content) of ``events`` in ``name``'s GroupLens format."""
    if name == "ml-100k":
        return "u.data", "".join(f"{u}\t{i}\t{r}\t{t}\n" for u, i, r, t in events)
    if name == "ml-1m":
        return "ratings.dat", "".join(f"{u}::{i}::{r}::{t}\n" for u, i, r, t in events)
    lines = "".join(f"{u},{i},{float(r)},{t}\n" for u, i, r, t in events)
    return "ratings.csv", "userId,movieId,rating,timestamp\n" + lines


@pytest.mark.parametrize("gz", [False, True], ids=["plain", "gzip"])
@pytest.mark.parametrize("name", ["ml-100k", "ml-1m", "ml-20m"])
def test_movielens_loader_sorts_by_time(tmp_path, name, gz):
    file_name, text = _movielens_text(name, EVENTS)
    _write(tmp_path / "data" / file_name, text, gz)
    ds = load_dataset(name, tmp_path / "data", cache_dir=tmp_path / "cache")
    assert ds.name == name
    assert ds.num_users == 2 and ds.num_items == 5 and ds.num_events == 6
    assert ds.user_raw_ids.tolist() == [1, 2]
    assert ds.item_raw_ids.tolist() == [5, 10, 20, 30, 40]  # dense ids follow raw-id order
    assert _rows(ds) == EXPECTED_ROWS
    assert ds.item_ids.tolist() == [2, 0, 1, 4, 1, 3]
    assert ds.timestamps.tolist() == EXPECTED_TIMES
    assert ds.ratings.tolist() == EXPECTED_RATINGS and ds.ratings.dtype == np.float32
    assert ds.actions is None


def test_ml20m_keeps_half_star_ratings(tmp_path):
    text = "userId,movieId,rating,timestamp\n1,10,3.5,100\n1,11,0.5,101\n"
    _write(tmp_path / "ratings.csv", text, gz=False)
    assert load_dataset("ml-20m", tmp_path, cache_dir=tmp_path).ratings.tolist() == [3.5, 0.5]


KUAIRAND_HEADER = (
    "user_id,video_id,date,hourmin,time_ms,is_click,is_like,is_follow,is_comment,is_forward,"
    "is_hate,long_view,play_time_ms,duration_ms,profile_stay_time,comment_stay_time,"
    "is_profile_enter,is_rand,tab\n"
)


def _kuairand_line(user, video, time_ms, click=0, like=0, follow=0, comment=0, forward=0,
                   hate=0, long_view=0, profile_enter=0) -> str:
    return (f"{user},{video},20220408,1000,{time_ms},{click},{like},{follow},{comment},"
            f"{forward},{hate},{long_view},5000,20000,0,0,{profile_enter},0,1\n")


@pytest.mark.parametrize("gz", [False, True], ids=["plain", "gzip"])
def test_kuairand_loader_reads_standard_logs_into_action_masks(tmp_path, gz):
    data = tmp_path / "KuaiRand-1K" / "data"
    _write(data / "log_standard_4_08_to_4_21_1k.csv", KUAIRAND_HEADER
           + _kuairand_line(7, 100, 1649400000500, click=1, like=1)
           + _kuairand_line(7, 200, 1649400000100), gz)
    _write(data / "log_standard_4_22_to_5_08_1k.csv", KUAIRAND_HEADER
           + _kuairand_line(7, 300, 1650600000000, click=1, long_view=1, profile_enter=1)
           + _kuairand_line(3, 100, 1650600000000, follow=1, comment=1, forward=1, hate=1), gz)
    # the random-exposure log is not read
    _write(data / "log_random_4_22_to_5_08_1k.csv", KUAIRAND_HEADER
           + _kuairand_line(9, 400, 1650600000000, click=1), gz)

    ds = load_dataset("kuairand", tmp_path / "KuaiRand-1K", cache_dir=tmp_path / "cache")
    assert ds.user_raw_ids.tolist() == [3, 7]
    assert _rows(ds) == [[100], [200, 100, 300]]  # milliseconds order within one second
    assert ds.timestamps.tolist() == [1650600000, 1649400000, 1649400000, 1650600000]
    assert ds.actions.tolist() == [
        Action.FOLLOW | Action.COMMENT | Action.FORWARD | Action.HATE,
        0,
        Action.CLICK | Action.LIKE,
        Action.CLICK | Action.LONG_VIEW | Action.PROFILE_ENTER,
    ]
    assert ds.ratings is None


# -- errors name the path and what was expected ------------------------------------------------


def test_missing_file_names_path_and_expected_file(tmp_path):
    with pytest.raises(FileNotFoundError) as info:
        load_dataset("ml-1m", tmp_path, cache_dir=tmp_path)
    message = str(info.value)
    assert message.startswith(f"{tmp_path / 'ratings.dat'} not found (nor ratings.dat.gz)")
    assert "UserID::MovieID::Rating::Timestamp" in message


def test_missing_kuairand_logs_name_the_folders(tmp_path):
    with pytest.raises(FileNotFoundError, match=re.escape(
        f"no log_standard_*.csv (or .csv.gz) in {tmp_path} or {tmp_path / 'data'}"
    )):
        load_dataset("kuairand", tmp_path, cache_dir=tmp_path)


@pytest.mark.parametrize("name, text, problem", [
    ("ml-100k", "1\t10\t5\t300\n1\t11\t300\n", "line 2: 3 fields instead of 4"),
    ("ml-100k", "1\t10\t5\t300\n\n1\t11\tfive\t300\n",
     "line 3: rating is 'five', not an integer"),  # blank lines count, and are skipped
    ("ml-1m", "1::10::5::300\n1:11::5::300\n", "line 2: 3 fields instead of 4"),
    ("ml-20m", "userId,movieId,rating,timestamp\n1,10,,300\n",
     "line 2: rating is '', not a number"),
    ("ml-20m", "1,10,5.0,300\n", "line 1: header lacks the column(s) userId, movieId, rating, "
                                 "timestamp"),
    ("ml-100k", "", "no data lines"),
])
@pytest.mark.parametrize("gz", [False, True], ids=["plain", "gzip"])
def test_malformed_line_names_path_line_and_format(tmp_path, name, text, problem, gz):
    file_name, _ = _movielens_text(name, [])
    path = _write(tmp_path / file_name, text, gz)
    with pytest.raises(DataFormatError) as info:
        load_dataset(name, tmp_path, cache_dir=tmp_path / "cache")
    assert str(info.value).startswith(f"{path}: {problem}; expected ")
    assert not list(tmp_path.rglob("*.parquet"))  # nothing cached


def test_not_gzip_names_the_file(tmp_path):
    (tmp_path / "u.data.gz").write_text("1\t10\t5\t300\n")
    message = re.escape(f"{tmp_path / 'u.data.gz'}: cannot be read")
    with pytest.raises(DataFormatError, match=message):
        load_dataset("ml-100k", tmp_path, cache_dir=tmp_path)


def _many_events(name: str) -> Tuple[str, str]:
    """A file of ``name`` long enough that half of its gzip stream is a cut inside the data."""
    return _movielens_text(name, [(u % 97, u % 89, 1 + u % 5, 1000 + u) for u in range(3000)])


@pytest.mark.parametrize("name", ["ml-100k", "ml-20m"])  # without and with a header line
def test_truncated_gzip_names_the_file(tmp_path, name):
    file_name, text = _many_events(name)
    whole = gzip.compress(text.encode())
    path = tmp_path / f"{file_name}.gz"
    path.write_bytes(whole[: len(whole) // 2])
    with pytest.raises(DataFormatError) as info:
        load_dataset(name, tmp_path, cache_dir=tmp_path / "cache")
    assert str(info.value).startswith(f"{path}: cannot be read as gzip (EOFError: Compressed "
                                      "file ended before the end-of-stream marker was reached)")
    assert "; expected " in str(info.value) and "\n" not in str(info.value)
    assert not list(tmp_path.rglob("*.parquet"))


def test_corrupt_gzip_data_names_the_file(tmp_path):
    file_name, text = _many_events("ml-1m")
    data = bytearray(gzip.compress(text.encode()))
    data[10] = 0b111  # the first deflate block: final, of the reserved type 3
    path = tmp_path / f"{file_name}.gz"
    path.write_bytes(bytes(data))
    with pytest.raises(DataFormatError, match=re.escape(
        f"{path}: cannot be read as gzip (zlib.error: Error -3 while decompressing data: "
        "invalid block type); expected UserID::MovieID::Rating::Timestamp"
    )):
        load_dataset("ml-1m", tmp_path, cache_dir=tmp_path / "cache")


@pytest.mark.parametrize("gz", [False, True], ids=["plain", "gzip"])
def test_undecodable_bytes_name_the_file_and_line(tmp_path, gz):
    path = tmp_path / ("u.data.gz" if gz else "u.data")
    content = b"1\t10\t5\t300\n2\t1\xff\xfe\t4\t301\n"
    path.write_bytes(gzip.compress(content) if gz else content)
    with pytest.raises(DataFormatError) as info:
        load_dataset("ml-100k", tmp_path, cache_dir=tmp_path / "cache")
    assert str(info.value).startswith(
        f"{path}: line 2: item is '1\ufffd\ufffd', not an integer; expected 4 tab-separated"
    )


def test_binary_file_names_the_file(tmp_path):
    path = tmp_path / "ratings.csv"
    path.write_bytes(bytes(range(256)) * 8)
    with pytest.raises(DataFormatError, match=re.escape(
        f"{path}: line 1: header lacks the column(s) userId, movieId, rating, timestamp"
    )):
        load_dataset("ml-20m", tmp_path, cache_dir=tmp_path / "cache")


def test_kuairand_missing_columns_are_named(tmp_path):
    header = KUAIRAND_HEADER.replace("time_ms,", "").replace("is_like,", "")
    path = _write(tmp_path / "log_standard_4_08_to_4_21_pure.csv", header + "1,2\n", gz=False)
    with pytest.raises(DataFormatError, match=re.escape(
        f"{path}: line 1: header lacks the column(s) time_ms, is_like; expected a KuaiRand log"
    )):
        load_dataset("kuairand", tmp_path, cache_dir=tmp_path)


def test_load_dataset_argument_errors(tmp_path, monkeypatch):
    # the rules of --data, with the CLI's messages (tests/test_data_options.py)
    with pytest.raises(ValueError, match=r"^--data: 'ml-10m' is neither a data set \(synthetic, "
                                         r"ml-100k, ml-1m, ml-20m, kuairand, amazon-games, "
                                         r"amazon-beauty, amazon-sports\) nor "
                                         "an existing file or folder$"):
        load_dataset("ml-10m")
    monkeypatch.delenv("TZREC_BENCH_DATA", raising=False)
    with pytest.raises(ValueError, match=r"^--data-dir: --data ml-1m needs the folder of its "
                                         r"files \(or TZREC_BENCH_DATA set"):
        load_dataset("ml-1m")
    with pytest.raises(ValueError, match=r"^num_users: options of the synthetic data set"):
        load_dataset("ml-1m", tmp_path, num_users=3)
    assert DATASETS == ("synthetic", "ml-100k", "ml-1m", "ml-20m", "kuairand", "amazon-games",
                        "amazon-beauty", "amazon-sports")


def test_data_dir_defaults_to_the_environment(tmp_path, monkeypatch):
    _write(tmp_path / "ml-100k" / "u.data", "1\t10\t5\t300\n", gz=False)
    monkeypatch.setenv("TZREC_BENCH_DATA", str(tmp_path))
    assert load_dataset("ml-100k", cache_dir=tmp_path / "cache").num_events == 1


# -- the cache ---------------------------------------------------------------------------------


@pytest.fixture
def read_calls(monkeypatch) -> List[int]:
    """Counts MovieLens parses (each call appends 1)."""
    calls: List[int] = []
    original = MovieLens.read

    def spy(self, files):
        calls.append(1)
        return original(self, files)

    monkeypatch.setattr(MovieLens, "read", spy)
    return calls


def test_second_load_comes_from_the_cache(tmp_path, read_calls):
    file_name, text = _movielens_text("ml-1m", EVENTS)
    _write(tmp_path / file_name, text, gz=True)
    first = load_dataset("ml-1m", tmp_path, cache_dir=tmp_path / "cache")
    second = load_dataset("ml-1m", tmp_path, cache_dir=tmp_path / "cache")
    assert len(read_calls) == 1
    assert len(_entries(tmp_path / "cache", "ml-1m-*")) == 1
    for field in ("offsets", "item_ids", "timestamps", "ratings", "item_raw_ids", "user_raw_ids"):
        a, b = getattr(first, field), getattr(second, field)
        assert np.array_equal(a, b) and a.dtype == b.dtype, field
        assert isinstance(b, np.memmap), field  # mapped, not read into memory
    assert second.num_items == first.num_items and second.name == "ml-1m"
    assert second.fingerprint == first.fingerprint != ""


def test_changed_file_is_read_again(tmp_path, read_calls):
    path = _write(tmp_path / "u.data", "1\t10\t5\t300\n", gz=False)
    load_dataset("ml-100k", tmp_path, cache_dir=tmp_path / "cache")
    path.write_text("1\t10\t5\t300\n1\t11\t4\t301\n")
    assert _rows(load_dataset("ml-100k", tmp_path, cache_dir=tmp_path / "cache")) == [[10, 11]]
    # same size, new content (small files are keyed on their bytes)
    path.write_text("1\t10\t5\t300\n1\t12\t4\t301\n")
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    assert _rows(load_dataset("ml-100k", tmp_path, cache_dir=tmp_path / "cache")) == [[10, 12]]
    assert len(read_calls) == 3
    assert len(_entries(tmp_path / "cache", "*")) == 1  # stale entries removed


def _entries(cache: pathlib.Path, pattern: str) -> List[pathlib.Path]:
    return [p for p in cache.glob(pattern) if p.is_dir()]


def test_unreadable_cache_is_rebuilt(tmp_path, read_calls):
    _write(tmp_path / "u.data", "1\t10\t5\t300\n", gz=False)
    load_dataset("ml-100k", tmp_path, cache_dir=tmp_path / "cache")
    (entry,) = _entries(tmp_path / "cache", "*")
    (entry / "meta.json").write_text("not json")
    assert _rows(load_dataset("ml-100k", tmp_path, cache_dir=tmp_path / "cache")) == [[10]]
    assert len(read_calls) == 2


def test_damaged_cache_is_rebuilt_not_read_as_other_numbers(tmp_path, read_calls):
    file_name, text = _movielens_text("ml-100k", EVENTS)
    _write(tmp_path / file_name, text, gz=False)
    load_dataset("ml-100k", tmp_path, cache_dir=tmp_path / "cache")
    (entry,) = _entries(tmp_path / "cache", "*")
    cached = entry / "timestamps.npy"
    # one bit of the last timestamp: the file stays a readable .npy of other numbers
    data = bytearray(cached.read_bytes())
    data[-8] ^= 1
    cached.write_bytes(bytes(data))
    unchecked = np.load(cached).tolist()
    assert sorted(unchecked) != sorted(EXPECTED_TIMES), "the flipped bit changed no number"
    ds = load_dataset("ml-100k", tmp_path, cache_dir=tmp_path / "cache")
    assert len(read_calls) == 2
    assert _rows(ds) == EXPECTED_ROWS and ds.timestamps.tolist() == EXPECTED_TIMES
    assert np.load(cached).tolist() == EXPECTED_TIMES


@pytest.mark.parametrize("keep", [0.0, 0.5, 0.99])
def test_truncated_cache_is_rebuilt(tmp_path, read_calls, keep):
    file_name, text = _movielens_text("ml-100k", EVENTS)
    _write(tmp_path / file_name, text, gz=False)
    load_dataset("ml-100k", tmp_path, cache_dir=tmp_path / "cache")
    (entry,) = _entries(tmp_path / "cache", "*")
    cached = entry / "item_ids.npy"
    data = cached.read_bytes()
    cached.write_bytes(data[: int(len(data) * keep)])
    assert _rows(load_dataset("ml-100k", tmp_path, cache_dir=tmp_path / "cache")) == EXPECTED_ROWS
    assert len(read_calls) == 2 and cached.read_bytes() == data


def test_cache_dir_defaults_to_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("TZREC_BENCH_CACHE", str(tmp_path / "env-cache"))
    assert default_cache_dir() == tmp_path / "env-cache"
    _write(tmp_path / "u.data", "1\t10\t5\t300\n", gz=False)
    load_dataset("ml-100k", tmp_path)
    assert len(_entries(tmp_path / "env-cache", "ml-100k-*")) == 1
    monkeypatch.delenv("TZREC_BENCH_CACHE")
    assert default_cache_dir() == pathlib.Path.home() / ".cache" / "tzrec-bench"


# -- the real MovieLens-100K -------------------------------------------------------------------


@pytest.mark.skipif(
    not (ML_100K_DIR / "u.data.gz").is_file() and not (ML_100K_DIR / "u.data").is_file(),
    reason=f"MovieLens-100K is not at {ML_100K_DIR} (its license forbids committing it)",
)
def test_real_movielens_100k(tmp_path):
    ds = load_dataset("ml-100k", ML_100K_DIR, cache_dir=tmp_path)
    assert (ds.num_users, ds.num_items, ds.num_events) == (943, 1682, 100_000)
    assert ds.user_raw_ids.tolist() == list(range(1, 944))
    assert ds.item_raw_ids.tolist() == list(range(1, 1683))
    counts = np.bincount(ds.ratings.astype(np.int64), minlength=6)[1:]
    assert counts.tolist() == [6110, 11370, 27145, 34174, 21201]  # as SOURCE.md lists
    assert ds.lengths.min() == 20  # GroupLens kept users with at least 20 ratings
    split = leave_one_out(ds)
    assert len(split.test) == 943 and split.train.num_events == 100_000 - 2 * 943
    # u.data's first line, user 196 rated item 242 at 881250949, is one of that user's events
    row = 196 - 1
    start, end = ds.offsets[row], ds.offsets[row + 1]
    events = set(zip(ds.item_raw_ids[ds.item_ids[start:end]], ds.timestamps[start:end]))
    assert (242, 881250949) in events


# -- leave-one-out -----------------------------------------------------------------------------


def _tiny() -> SequenceDataset:
    """Users with 5, 2 and 3 events; raw item ids equal dense ids, ratings 1..."""
    users = [0] * 5 + [1] * 2 + [2] * 3
    items = [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]
    times = [1, 2, 3, 4, 5, 1, 2, 1, 2, 3]
    return SequenceDataset.from_events("tiny", users, items, times,
                                       ratings=np.arange(1, 11), actions=np.arange(10))


def test_leave_one_out_holds_out_the_last_two_events():
    split = leave_one_out(_tiny())
    assert _rows(split.train) == [[0, 1, 2], [5, 6], [7]]  # user 1 (2 events) stays whole
    assert split.unevaluated.tolist() == [1]
    assert split.valid.rows.tolist() == split.test.rows.tolist() == [0, 2]
    assert _rows(split.valid.history) == [[0, 1, 2], [7]]
    assert split.valid.targets.tolist() == [3, 8]
    assert split.valid.target_timestamps.tolist() == [4, 2]
    assert _rows(split.test.history) == [[0, 1, 2, 3], [7, 8]]
    assert split.test.targets.tolist() == [4, 9]
    assert split.test.history.user_raw_ids.tolist() == [0, 2]
    assert split.test.history.ratings.tolist() == [1, 2, 3, 4, 8, 9]


# -- batching ----------------------------------------------------------------------------------


def test_make_batch_keeps_the_last_max_seq_len_events():
    ds = _tiny()
    batch = make_batch(ds, [0, 1], max_seq_len=3)
    assert batch.item_ids.tolist() == [2, 3, 4, 5, 6]
    assert batch.lengths.tolist() == [3, 2] and batch.max_len == 3
    assert batch.offsets.tolist() == [0, 3, 5]
    assert batch.timestamps.tolist() == [3, 4, 5, 1, 2]
    assert batch.ratings.tolist() == [3, 4, 5, 6, 7] and batch.actions.tolist() == [2, 3, 4, 5, 6]
    assert batch.item_ids.dtype == batch.lengths.dtype == batch.timestamps.dtype == torch.int64
    assert batch.ratings.dtype == torch.float32
    assert batch.item_ids.device.type == "cpu" and batch.targets is None


def test_make_batch_of_no_rows_is_empty():
    batch = make_batch(_tiny(), [], max_seq_len=4)
    assert batch.item_ids.shape == (0,) and batch.lengths.shape == (0,) and batch.max_len == 0


def test_make_batch_rejects_bad_arguments():
    with pytest.raises(ValueError, match=r"^max_seq_len must be at least 1; got 0$"):
        make_batch(_tiny(), [0], max_seq_len=0)
    with pytest.raises(ValueError, match=r"^rows must be a 1-D list of rows in \[0, 3\)$"):
        make_batch(_tiny(), [3], max_seq_len=2)


def test_make_eval_batch_adds_targets():
    split = leave_one_out(_tiny())
    batch = make_eval_batch(split.test, [1, 0], max_seq_len=2)
    assert batch.item_ids.tolist() == [7, 8, 2, 3] and batch.lengths.tolist() == [2, 2]
    assert batch.targets.tolist() == [9, 4] and batch.target_timestamps.tolist() == [3, 5]


def test_row_batches_cover_every_row_once():
    chunks = list(row_batches(10, 4))
    assert [c.tolist() for c in chunks] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    shuffled = np.concatenate(list(row_batches(10, 4, shuffle=True, seed=1)))
    assert sorted(shuffled.tolist()) == list(range(10)) and shuffled.tolist() != list(range(10))
    assert np.array_equal(shuffled, np.concatenate(list(row_batches(10, 4, shuffle=True, seed=1))))


# -- the dataset's own checks ------------------------------------------------------------------


def test_dataset_rejects_unsorted_times():
    ds = _tiny()
    with pytest.raises(ValueError, match=r"^timestamps must be non-decreasing within each row$"):
        SequenceDataset(ds.name, ds.offsets, ds.item_ids, ds.timestamps[::-1].copy(),
                        ds.num_items, ds.item_raw_ids, ds.user_raw_ids)


def test_dataset_allows_any_order_across_rows():
    ds = _tiny()  # row 0 ends at time 5, row 1 starts at time 1
    assert ds.timestamps[ds.offsets[1] - 1] > ds.timestamps[ds.offsets[1]]
