"""``load_dataset``: a named data set, or any event log by its path, through the cache."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Dict, Optional, Union

from tzrec_bench.data.amazon import AMAZON_BEAUTY, AMAZON_GAMES, AMAZON_SPORTS
from tzrec_bench.data.cache import cache_path, default_cache_dir, load_cached
from tzrec_bench.data.dataset import SequenceDataset
from tzrec_bench.data.event_log import Columns, ReadOptions, write_event_log
from tzrec_bench.data.kuairand import KUAIRAND
from tzrec_bench.data.log_files import scan
from tzrec_bench.data.movielens import ML_1M, ML_20M, ML_100K
from tzrec_bench.data.source import Source
from tzrec_bench.data.synthetic import synthetic

PathLike = Union[str, "os.PathLike[str]"]
DATA_ENV = "TZREC_BENCH_DATA"
SOURCES: Dict[str, Source] = {
    source.name: source for source in (ML_100K, ML_1M, ML_20M, KUAIRAND, AMAZON_GAMES,
                                       AMAZON_BEAUTY, AMAZON_SPORTS)
}
DATASETS = ("synthetic", *SOURCES)
#: the cache entries of event logs read by path are named after this
EVENT_LOG = "events"
EVENT_LOG_VERSION = 1


def is_named(data: str) -> bool:
    """Whether ``data`` names a data set (else it is the path of an event log)."""
    return data in DATASETS


class DataOptionError(ValueError):
    """Settings of the data that do not fit together; ``field`` is the setting at fault
    (``data_dir``), and the message starts with its option (``--data-dir: ...``)."""

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        self.message = message
        super().__init__(f"--{field.replace('_', '-')}: {message}")


def check_data_options(
    data: str,
    data_dir: Optional[PathLike] = None,
    columns: Optional[Union[str, Columns]] = None,
    min_events: int = 0,
    folders: bool = True,
) -> None:
    """The rules of ``--data`` and the options that go with it, checked before any file is
    read (by ``tzrec-bench train`` and ``evaluate``, a run's settings and
    :func:`load_dataset`).

    Args:
        data: a data set's name (:data:`DATASETS`) or the path of an event log.
        data_dir: a named data set's folder (``--data-dir``).
        columns: an event log's column mapping (``--columns``).
        min_events: the k-core filter (``--min-events``); 0: none.
        folders: also check where a named data set is read from: ``data_dir`` only for
            one read from files, which needs it (or ``$TZREC_BENCH_DATA``) as an existing
            folder. False where that is settled later (a run config's folder comes from
            ``--data-root``).

    Raises:
        DataOptionError: the first rule broken, naming its option.
        FileNotFoundError: ``data_dir`` is no folder (``--data-dir: no such folder: ...``).
    """
    if not is_named(data):
        if not Path(data).exists():
            raise DataOptionError("data", f"{data!r} is neither a data set "
                                  f"({', '.join(DATASETS)}) nor an existing file or folder")
        if folders and data_dir is not None:
            raise DataOptionError("data_dir", "an event log given by path (--data) reads no "
                                  "other folder")
        if isinstance(columns, str):
            try:
                Columns.parse(columns)
            except ValueError as exc:  # its message names the option already
                raise DataOptionError("columns", str(exc).split(": ", 1)[-1]) from None
        return
    if columns is not None:
        raise DataOptionError("columns", f"{data} has its own format; column mappings are "
                              "for event logs given by path")
    if data == "synthetic":
        if min_events:
            raise DataOptionError("min_events", "the synthetic data set is generated; the "
                                  "k-core filter applies to data read from files")
        if folders and data_dir is not None:
            raise DataOptionError("data_dir", "the synthetic data set is generated and reads "
                                  "no files")
        return
    if not folders:
        return
    if data_dir is None:
        if not os.environ.get(DATA_ENV):
            raise DataOptionError("data_dir", f"--data {data} needs the folder of its files "
                                  f"(or {DATA_ENV} set to a folder holding "
                                  f"{SOURCES[data].folder}/)")
    elif not Path(data_dir).is_dir():
        raise FileNotFoundError(f"--data-dir: no such folder: {data_dir}")


def load_dataset(
    name: str,
    data_dir: Optional[PathLike] = None,
    cache_dir: Optional[PathLike] = None,
    seed: int = 0,
    columns: Optional[Union[str, Columns]] = None,
    min_events: int = 0,
    **synthetic_options,
) -> SequenceDataset:
    """The data set ``name``: one of :data:`DATASETS`, or the path of an event log (a file
    or a folder of files: :mod:`tzrec_bench.data.event_log`).

    ``"synthetic"`` is generated (not cached) by :func:`synthetic` with ``seed`` and
    ``synthetic_options``. The others are read the first time and mapped from the cache
    afterwards, until their files or the reading options change; their
    :attr:`SequenceDataset.files` name the files read (and ``skipped_files`` those of an
    unknown kind that the folder held).

    Args:
        name (str): ``synthetic``, ``ml-100k``, ``ml-1m``, ``ml-20m``, ``kuairand``,
            ``amazon-games``, ``amazon-beauty``, ``amazon-sports``, or a path.
        data_dir (str | PathLike | None): a named set's folder. Default:
            ``$TZREC_BENCH_DATA/<folder>``: the set's name, ``amazon-s3`` for
            ``amazon-beauty`` and ``amazon-sports`` (:attr:`Source.folder`).
        cache_dir (str | PathLike | None): where read data sets are cached. Default:
            ``$TZREC_BENCH_CACHE``, else ``~/.cache/tzrec-bench``.
        seed (int): the synthetic data set's seed. Default: 0.
        columns (str | Columns | None): an event log's column mapping
            (``"user=uid,item=sku,time=ts"``). Default: :class:`Columns`' defaults.
        min_events (int): the k-core filter: users and items with fewer events are dropped
            until none is left (0 or 1: no filter; the synthetic data set takes 0). Default: 0.
        **synthetic_options: keyword arguments of :func:`synthetic` (``num_users``, ...).

    Raises:
        DataOptionError: (a ValueError) a name that is no data set and no path either,
            options that do not apply, or no ``data_dir`` (:func:`check_data_options`);
            ValueError: synthetic options for another data set.
        FileNotFoundError: a missing folder or file, naming the path and the file expected.
        DataFormatError: a malformed file, naming the path, the row and the column or format;
            a folder of files of more than one format, or holding the same log twice
            (:mod:`tzrec_bench.data.log_files`).
    """
    check_data_options(name, data_dir, columns, min_events)
    if name == "synthetic":
        return synthetic(seed=seed, **synthetic_options)
    if synthetic_options:
        raise ValueError(
            f"{', '.join(synthetic_options)}: options of the synthetic data set, not {name}"
        )
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    source = SOURCES.get(name)
    if source is None:
        return _load_event_log(name, columns, min_events, cache)
    if data_dir is None:  # check_data_options saw the variable set
        data_dir = Path(os.environ[DATA_ENV]) / source.folder
    files = source.files(Path(data_dir))
    options = ReadOptions(min_events=min_events)
    path = cache_path(cache, source.name, source.version, files, options.min_events)
    ds = load_cached(path, name, lambda folder: source.write(folder, files, options))
    return ds.with_files([file.name for file in files])


def _load_event_log(
    name: str, columns: Optional[Union[str, Columns]], min_events: int, cache: Path
) -> SequenceDataset:
    path = Path(name)
    parsed = columns if isinstance(columns, Columns) else Columns.parse(columns)
    options = ReadOptions(parsed, min_events)
    log = scan(path)
    files = list(log.files)
    entry = cache_path(cache, EVENT_LOG, EVENT_LOG_VERSION, files,
                       [parsed.text(), options.min_events])
    ds = load_cached(entry, name,
                     lambda folder: write_event_log(folder, name, files, options, name))
    return ds.with_files(log.names, log.skipped_names)

