"""What a data set loader provides: where its files are and how to read them into a cache
entry."""

from __future__ import annotations

import abc
from pathlib import Path
from typing import List, Sequence

from tzrec_bench.data.dataset import SequenceDataset
from tzrec_bench.data.event_log import ReadOptions
from tzrec_bench.data.grouping import write_sequences


class Source(abc.ABC):
    """A data set read from local files.

    Attributes:
        name (str): the name ``load_dataset`` knows it by, e.g. ``"ml-1m"``.
        version (int): bumped whenever :meth:`write` changes what it writes, so that cached
            datasets made by the old code are not reused.
    """

    name: str
    version: int

    @property
    def folder(self) -> str:
        """Its folder under ``$TZREC_BENCH_DATA`` (and ``--data-root``): its name, unless
        several sets share one (S3-Rec's Amazon sets: ``amazon-s3``)."""
        return self.name

    @abc.abstractmethod
    def files(self, data_dir: Path) -> List[Path]:
        """The files :meth:`write` needs, found in ``data_dir``.

        Raises:
            FileNotFoundError: naming the path looked for and the file expected there.
        """

    @abc.abstractmethod
    def write(self, folder: Path, files: Sequence[Path], options: ReadOptions) -> None:
        """Reads ``files`` (as returned by :meth:`files`) into a cache entry in ``folder``
        (:mod:`tzrec_bench.data.cache`).

        Raises:
            DataFormatError: naming the file, the bad line and the format expected.
        """


class ParsedSource(Source):
    """A source small enough to parse in memory (:meth:`read`), then written to the cache
    through the event log's grouping and k-core filter."""

    @abc.abstractmethod
    def read(self, files: Sequence[Path]) -> SequenceDataset:
        """Parse ``files`` into a dataset.

        Raises:
            DataFormatError: naming the file, the bad line and the format expected.
        """

    def write(self, folder: Path, files: Sequence[Path], options: ReadOptions) -> None:
        write_sequences(folder, self.read(files), options.min_events,
                        {"source": self.name, "has_time": True, "columns": ""})
