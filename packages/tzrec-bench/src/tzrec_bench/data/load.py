"""``load_dataset``: any data set by name, from local files through the cache."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Dict, Optional, Union

from tzrec_bench.data.cache import cache_path, default_cache_dir, load_cached
from tzrec_bench.data.dataset import SequenceDataset
from tzrec_bench.data.kuairand import KUAIRAND
from tzrec_bench.data.movielens import ML_1M, ML_20M, ML_100K
from tzrec_bench.data.source import Source
from tzrec_bench.data.synthetic import synthetic

PathLike = Union[str, "os.PathLike[str]"]
DATA_ENV = "TZREC_BENCH_DATA"
SOURCES: Dict[str, Source] = {source.name: source for source in (ML_100K, ML_1M, ML_20M, KUAIRAND)}
DATASETS = ("synthetic", *SOURCES)


def load_dataset(
    name: str,
    data_dir: Optional[PathLike] = None,
    cache_dir: Optional[PathLike] = None,
    seed: int = 0,
    **synthetic_options,
) -> SequenceDataset:
    """The data set ``name``, one of :data:`DATASETS`.

    ``"synthetic"`` is generated (not cached) by :func:`synthetic` with ``seed`` and
    ``synthetic_options``. The others are read from ``data_dir`` the first time and from the
    cache afterwards, until their files change; ``seed`` does not affect them.

    Args:
        name (str): ``synthetic``, ``ml-100k``, ``ml-1m``, ``ml-20m`` or ``kuairand``.
        data_dir (str | PathLike | None): the folder holding the data set's files. Default:
            ``$TZREC_BENCH_DATA/<name>``.
        cache_dir (str | PathLike | None): where preprocessed data sets are cached. Default:
            ``$TZREC_BENCH_CACHE``, else ``~/.cache/tzrec-bench``.
        seed (int): the synthetic data set's seed. Default: 0.
        **synthetic_options: keyword arguments of :func:`synthetic` (``num_users``, ...).

    Raises:
        ValueError: an unknown name, options given to a real data set, or no ``data_dir``.
        FileNotFoundError: a missing file, naming the path and the file expected.
        DataFormatError: a malformed file, naming the path, the line and the format expected.
    """
    if name == "synthetic":
        return synthetic(seed=seed, **synthetic_options)
    source = SOURCES.get(name)
    if source is None:
        raise ValueError(f"unknown data set {name!r}; expected one of {', '.join(DATASETS)}")
    if synthetic_options:
        raise ValueError(
            f"{', '.join(synthetic_options)}: options of the synthetic data set, not {name}"
        )
    if data_dir is None:
        root = os.environ.get(DATA_ENV)
        if not root:
            raise ValueError(f"{name} needs data_dir, or {DATA_ENV} set to a folder with {name}/")
        data_dir = Path(root) / name
    files = source.files(Path(data_dir))
    path = cache_path(
        Path(cache_dir) if cache_dir is not None else default_cache_dir(),
        source.name,
        source.version,
        files,
    )
    return load_cached(path, name, lambda: source.read(files))
