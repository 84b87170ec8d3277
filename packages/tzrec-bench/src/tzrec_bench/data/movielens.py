"""MovieLens ratings (GroupLens, https://grouplens.org/datasets/movielens/) in their own formats.

- ml-100k: ``u.data``, lines ``user<TAB>item<TAB>rating<TAB>timestamp``, ratings 1 to 5.
- ml-1m: ``ratings.dat``, lines ``UserID::MovieID::Rating::Timestamp``, ratings 1 to 5.
- ml-20m: ``ratings.csv``, header ``userId,movieId,rating,timestamp``, ratings 0.5 to 5 in
  half stars.

Each file may also be gzip-compressed (``u.data.gz``); timestamps are Unix seconds. Every
rating is one event; the rating itself goes to ``SequenceDataset.ratings``.
"""

from __future__ import annotations

from pathlib import Path
from typing import List, Sequence

from tzrec_bench.data.dataset import SequenceDataset
from tzrec_bench.data.source import ParsedSource
from tzrec_bench.data.text_format import TextFormat, find_file, read_columns


class MovieLens(ParsedSource):
    """One MovieLens release: one ratings file in ``data_dir``.

    Args:
        name (str): ``"ml-100k"``, ``"ml-1m"`` or ``"ml-20m"``.
        file_name (str): the ratings file's name in the GroupLens archive.
        fmt (TextFormat): its format; columns ``user``, ``item``, ``rating``, ``timestamp``
            whatever their names in the file.
        archive (str): where GroupLens publishes it, for messages.
    """

    version = 1

    def __init__(self, name: str, file_name: str, fmt: TextFormat, archive: str) -> None:
        self.name = name
        self.file_name = file_name
        self.fmt = fmt
        self.archive = archive

    def files(self, data_dir: Path) -> List[Path]:
        what = f"the {self.name} ratings file, {self.fmt.expected} (from {self.archive})"
        return [find_file(data_dir, self.file_name, what)]

    def read(self, files: Sequence[Path]) -> SequenceDataset:
        (path,) = files
        user, item, rating, timestamp = read_columns(path, self.fmt).values()
        return SequenceDataset.from_events(self.name, user, item, timestamp, ratings=rating)


_ARCHIVES = "https://files.grouplens.org/datasets/movielens"

ML_100K = MovieLens(
    "ml-100k",
    "u.data",
    TextFormat(
        expected="4 tab-separated integers per line: user id, item id, rating, timestamp",
        delimiter="\t",
        columns=(("user", "int"), ("item", "int"), ("rating", "int"), ("timestamp", "int")),
    ),
    f"{_ARCHIVES}/ml-100k.zip",
)
ML_1M = MovieLens(
    "ml-1m",
    "ratings.dat",
    TextFormat(
        expected="UserID::MovieID::Rating::Timestamp per line, all integers",
        delimiter="::",
        columns=(("user", "int"), ("item", "int"), ("rating", "int"), ("timestamp", "int")),
    ),
    f"{_ARCHIVES}/ml-1m.zip",
)
ML_20M = MovieLens(
    "ml-20m",
    "ratings.csv",
    TextFormat(
        expected=(
            "a header userId,movieId,rating,timestamp, then comma-separated integer ids, "
            "a numeric rating and an integer timestamp"
        ),
        delimiter=",",
        columns=(
            ("userId", "int"), ("movieId", "int"), ("rating", "float"), ("timestamp", "int"),
        ),
        header=True,
    ),
    f"{_ARCHIVES}/ml-20m.zip",
)
