"""What a data set loader provides: where its files are and how to read them."""

from __future__ import annotations

import abc
from pathlib import Path
from typing import List, Sequence

from tzrec_bench.data.dataset import SequenceDataset


class Source(abc.ABC):
    """A data set read from local files.

    Attributes:
        name (str): the name ``load_dataset`` knows it by, e.g. ``"ml-1m"``.
        version (int): bumped whenever :meth:`read` changes what it returns, so that cached
            datasets made by the old code are not reused.
    """

    name: str
    version: int

    @abc.abstractmethod
    def files(self, data_dir: Path) -> List[Path]:
        """The files :meth:`read` needs, found in ``data_dir``.

        Raises:
            FileNotFoundError: naming the path looked for and the file expected there.
        """

    @abc.abstractmethod
    def read(self, files: Sequence[Path]) -> SequenceDataset:
        """Parse ``files`` (as returned by :meth:`files`) into a dataset.

        Raises:
            DataFormatError: naming the file, the bad line and the format expected.
        """
