"""KuaiRand (Kuaishou short-video logs, https://kuairand.com/): the ``log_standard_*.csv`` logs.

The release archives (KuaiRand-Pure, -1K, -27K) unpack to ``<archive>/data/``; ``data_dir`` is
that folder or its parent. Every ``log_standard_*.csv`` (or ``.csv.gz``) there is read, e.g.
``log_standard_4_08_to_4_21_1k.csv`` and ``log_standard_4_22_to_5_08_1k.csv``. The
``log_random_*`` logs (videos shown at random, for unbiased evaluation) are not read.

Every logged impression is one event, clicked or not: its feedback flags become the action
bitmask (:class:`~tzrec_bench.data.actions.Action`), and a trainer that wants clicks only
filters on ``actions & Action.CLICK``. The columns read (others are ignored):

- ``user_id``, ``video_id``: integer ids;
- ``time_ms``: Unix milliseconds, the sort key (timestamps are then kept in seconds);
- ``is_click``, ``is_like``, ``is_follow``, ``is_comment``, ``is_forward``, ``is_hate``,
  ``long_view``, ``is_profile_enter``: 0/1 flags.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import List, Sequence

import numpy as np

from tzrec_bench.data.actions import Action
from tzrec_bench.data.dataset import SequenceDataset
from tzrec_bench.data.source import ParsedSource
from tzrec_bench.data.text_format import TextFormat, read_columns

# feedback column -> its bit in the action mask
ACTION_COLUMNS = {
    "is_click": Action.CLICK,
    "is_like": Action.LIKE,
    "is_follow": Action.FOLLOW,
    "is_comment": Action.COMMENT,
    "is_forward": Action.FORWARD,
    "is_hate": Action.HATE,
    "long_view": Action.LONG_VIEW,
    "is_profile_enter": Action.PROFILE_ENTER,
}
LOG_FORMAT = TextFormat(
    expected=(
        "a KuaiRand log: a header naming at least user_id, video_id, time_ms, "
        f"{', '.join(ACTION_COLUMNS)}, then comma-separated integers"
    ),
    delimiter=",",
    columns=(
        ("user_id", "int"), ("video_id", "int"), ("time_ms", "int"),
        *((column, "int") for column in ACTION_COLUMNS),
    ),
    header=True,
)
LOG_PATTERNS = ("log_standard_*.csv", "log_standard_*.csv.gz")


class KuaiRand(ParsedSource):
    """Any KuaiRand release's standard logs."""

    name = "kuairand"
    version = 1

    def files(self, data_dir: Path) -> List[Path]:
        for folder in (data_dir / "data", data_dir):
            found = sorted(path for pattern in LOG_PATTERNS for path in folder.glob(pattern))
            if found:
                return found
        raise FileNotFoundError(
            f"no log_standard_*.csv (or .csv.gz) in {data_dir} or {data_dir / 'data'}: "
            "expected the KuaiRand logs there (from https://kuairand.com/)"
        )

    def read(self, files: Sequence[Path]) -> SequenceDataset:
        logs = [read_columns(path, LOG_FORMAT) for path in files]

        def column(name: str) -> np.ndarray:
            return np.concatenate([log[name] for log in logs])

        actions = np.zeros(sum(len(log["user_id"]) for log in logs), dtype=np.int64)
        for name, bit in ACTION_COLUMNS.items():
            actions |= (column(name) != 0).astype(np.int64) * int(bit)
        ds = SequenceDataset.from_events(
            self.name, column("user_id"), column("video_id"), column("time_ms"), actions=actions
        )
        # sorted on milliseconds above; seconds from here on, like every other data set
        return replace(ds, timestamps=ds.timestamps // 1000)


KUAIRAND = KuaiRand()
