"""The one-user-a-line log: ``user item item ...`` per line, how many public sequential
recommendation sets ship (S3-Rec's Amazon Beauty and Sports, for one).

A file is read this way when its name ends in ``.seq`` (optionally ``.seq.gz``): the suffix is
the opt-in, since the format cannot be told from the content (``1 2 3`` is a user with two
items here, and ``user item time`` in a ``.txt`` log). The rules:

- fields are separated by runs of spaces or tabs; white space at either end of a line, and
  a ``\\r`` before the ``\\n``, are ignored;
- the first field is the user, the others that user's items in time order; there are no
  timestamps, so every event's time is 0 and the file order is the time order (models that
  encode time see no gaps);
- a blank line (or one of white space only) is skipped: it is no user;
- a user with one item is read (one event; :func:`~tzrec_bench.data.split.leave_one_out`
  keeps users of fewer than 3 events out of validation and test, as for any log);
- a line with a user and no item is refused, naming the file and line;
- a user on two lines, in one file or in two files of a folder, is refused naming both
  places: one line holds all of a user's items;
- ids are read as text, as in CSV and text logs: users (and items) whose every id is a
  canonical integer (``42``, not ``042``) have integer ids, otherwise string ids;
- there is no header line: a first line ``user items`` would be read as a user.

The lines are split with pyarrow compute kernels, a block of the file at a time, with no
per-line Python loop.
"""

from __future__ import annotations

import gzip
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Iterator, List, Tuple

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from tzrec_bench.data.text_format import DataFormatError

#: the format's name in :data:`tzrec_gr.file_formats.FORMATS`
FORMAT = "sequences"
EXPECTED = ("'user item item ...' per line (one user a line, the items in time order), "
            "separated by spaces or tabs")
BLOCK_BYTES = 16 << 20  # bytes of the file split at a time


@dataclass(frozen=True)
class UserLines:
    """One block of a file: its users (one per non-blank line, with the line's number) and
    their events (each item, with its user repeated), in file order."""

    path: Path
    users: pa.Array  # string, one per non-blank line
    lines: np.ndarray  # int64, each user's line number, from 1
    event_users: pa.Array  # string, one per event
    items: pa.Array  # string, one per event


def _open(path: Path) -> BinaryIO:
    return gzip.open(path, "rb") if path.suffix == ".gz" else open(path, "rb")


def _blocks(path: Path) -> Iterator[Tuple[int, str]]:
    """(number of the block's first line, its text: whole lines without the last ``\\n``)."""
    first = 1
    rest = b""
    try:
        with _open(path) as f:
            while True:
                chunk = f.read(BLOCK_BYTES)
                if not chunk:
                    break
                data = rest + chunk
                end = data.rfind(b"\n")
                if end < 0:
                    rest = data
                    continue
                text, rest = data[:end], data[end + 1:]
                yield first, text.decode("utf-8", errors="replace")
                first += text.count(b"\n") + 1
    except (OSError, EOFError, zlib.error) as exc:
        raise DataFormatError(f"{path}: cannot be read ({type(exc).__name__}: {exc}); "
                              f"expected {EXPECTED}") from exc
    if rest:
        yield first, rest.decode("utf-8", errors="replace")


def read_user_lines(path: Path) -> Iterator[UserLines]:
    """The file's users and events block by block (rules: the module docstring).

    Raises:
        DataFormatError: an unreadable file, or a line with a user and no item, naming the
            file and line.
    """
    for first, text in _blocks(path):
        lines = pc.ascii_trim_whitespace(pc.list_flatten(pc.split_pattern(
            pa.array([text]), "\n")))
        numbers = np.flatnonzero(pc.not_equal(lines, "").to_numpy(zero_copy_only=False))
        if not len(numbers):
            continue
        fields = pc.ascii_split_whitespace(lines.take(numbers))
        counts = pc.list_value_length(fields).to_numpy().astype(np.int64)
        alone = np.flatnonzero(counts == 1)
        if len(alone):
            line = int(numbers[alone[0]]) + first
            user = fields[int(alone[0])][0].as_py()
            raise DataFormatError(f"{path}: line {line}: user {user!r} has no items; "
                                  f"expected {EXPECTED}")
        flat = pc.list_flatten(fields)
        offsets = fields.offsets.to_numpy()
        starts = offsets[:-1] - offsets[0]  # each line's user in the flattened fields
        is_item = np.ones(len(flat), dtype=bool)
        is_item[starts] = False
        users = flat.take(starts)
        yield UserLines(path, users, numbers.astype(np.int64) + first,
                        users.take(np.repeat(np.arange(len(users)), counts - 1)),
                        flat.filter(pa.array(is_item)))


class OneLinePerUser:
    """Collects each file's users and their lines, to refuse a user on two lines."""

    def __init__(self) -> None:
        self.parts: List[Tuple[Path, pa.Array, np.ndarray]] = []

    def add(self, block: UserLines) -> None:
        self.parts.append((block.path, block.users, block.lines))

    def check(self) -> None:
        """Raises DataFormatError naming the first user (in file order of its second line)
        found on two lines, and both places."""
        if not self.parts:
            return
        users = pa.concat_arrays([users for _, users, _ in self.parts])
        if len(pc.unique(users)) == len(users):
            return
        order = pc.sort_indices(users).to_numpy()  # stable: equal users in file order
        ranked = users.take(order)
        same = pc.equal(ranked[1:], ranked[:-1]).to_numpy(zero_copy_only=False)
        later = order[1:][same]
        earlier = order[:-1][same]
        pick = int(np.argmin(later))
        places = [self._place(int(earlier[pick])), self._place(int(later[pick]))]
        raise DataFormatError(f"user {users[int(later[pick])].as_py()!r} is on two lines: "
                              f"{places[0]} and {places[1]}; expected one line per user, "
                              "holding all of its items")

    def _place(self, index: int) -> str:
        for path, users, lines in self.parts:
            if index < len(users):
                return f"{path} line {int(lines[index])}"
            index -= len(users)
        raise IndexError(index)
