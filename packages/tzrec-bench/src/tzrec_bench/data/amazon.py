"""The Amazon sets of sequential recommendation papers, read from their public files.

- ``amazon-games``: the SASRec paper's (Kang & McAuley, ICDM 2018) Amazon Games. ``Video.txt``
  (or ``Video.txt.gz``): one action a line, ``user item`` separated by a space, both 1-based
  integers; each user's lines are in time order and carry no timestamp. It is read by the
  event-log reader (:mod:`tzrec_bench.data.event_log`) as a text log without a time column.
- ``amazon-beauty`` and ``amazon-sports``: S3-Rec's (Zhou et al., CIKM 2020) Amazon Beauty
  and Sports and Outdoors, reused unchanged by CL4SRec, DuoRec, TIGER, ActionPiece, FuXi-α and
  eSASRec. ``Beauty.txt`` and ``Sports_and_Outdoors.txt`` (or ``.gz``), both in one folder
  (``amazon-s3``): one user a line, ``user item item ...``, 1-based integers, the items in
  time order, no timestamps; read as a one-user-a-line log
  (:mod:`tzrec_bench.data.user_lines`) whatever the suffix.

No file has timestamps: the file order is each user's order and every timestamp is 0 (models
that encode time see no gaps between events).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import List, Sequence

from tzrec_bench.data.event_log import ReadOptions, write_event_log
from tzrec_bench.data.source import Source
from tzrec_bench.data.text_format import find_file
from tzrec_bench.data.user_lines import FORMAT as USER_LINES


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


class S3RecAmazon(Source):
    """One of S3-Rec's Amazon sets: ``file`` (one user a line) in the shared ``amazon-s3``
    folder."""

    folder = "amazon-s3"
    version = 1

    def __init__(self, name: str, file: str, category: str) -> None:
        self.name = name
        self.file = file
        self.category = category

    def files(self, data_dir: Path) -> List[Path]:
        what = (f"S3-Rec's Amazon {self.category}, 'user item item ...' per line (data/"
                f"{self.file} of https://github.com/RUCAIBox/CIKM2020-S3Rec)")
        return [find_file(data_dir, self.file, what)]

    def write(self, folder: Path, files: Sequence[Path], options: ReadOptions) -> None:
        write_event_log(folder, self.name, files,
                        dataclasses.replace(options, file_format=USER_LINES), self.name)


AMAZON_GAMES = AmazonGames()
#: 22,363 users, 12,101 items, 198,502 actions
AMAZON_BEAUTY = S3RecAmazon("amazon-beauty", "Beauty.txt", "Beauty")
#: 35,598 users, 18,357 items, 296,337 actions
AMAZON_SPORTS = S3RecAmazon("amazon-sports", "Sports_and_Outdoors.txt", "Sports and Outdoors")
