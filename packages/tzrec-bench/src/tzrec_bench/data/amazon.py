"""Amazon Games, as the SASRec paper (Kang & McAuley, ICDM 2018) preprocessed it.

``Video.txt`` (or ``Video.txt.gz``): one action a line, ``user item`` separated by a space,
both 1-based integers; each user's lines are in time order and carry no timestamp. It is read
by the event-log reader (:mod:`tzrec_bench.data.event_log`) as a text log without a time
column, so the file order is each user's order and every timestamp is 0 (models that encode
time see no gaps between events).
"""

from __future__ import annotations

from pathlib import Path
from typing import List, Sequence

from tzrec_bench.data.event_log import ReadOptions, write_event_log
from tzrec_bench.data.source import Source
from tzrec_bench.data.text_format import find_file


class AmazonGames(Source):
    """The SASRec paper's Amazon Games: 31,013 users, 23,715 items, 287,107 actions."""

    name = "amazon-games"
    version = 1

    def files(self, data_dir: Path) -> List[Path]:
        what = ("the SASRec paper's Amazon Games actions, 'user item' per line (data/Video.txt "
                "of https://github.com/kang205/SASRec)")
        return [find_file(data_dir, "Video.txt", what)]

    def write(self, folder: Path, files: Sequence[Path], options: ReadOptions) -> None:
        write_event_log(folder, self.name, files, options, self.name)


AMAZON_GAMES = AmazonGames()
