"""Finding the row behind a pyarrow error in an event log's text file.

pyarrow's CSV messages count rows only in some readers (and count the header and blank
lines), and its JSON messages count rows from 0 within a block of the file, so a failed
read scans the file again in Python (only then) to name the first bad row. Rows are the
data rows, counted from 1: a header line and blank lines are not rows; the message adds the
line in the file, ``"row 2 (line 3)"``.
"""

from __future__ import annotations

import csv
import gzip
import json
import re
from pathlib import Path
from typing import Dict, Iterator, List, Optional, TextIO, Tuple

_INT64_MAX = (1 << 63) - 1
_INT = re.compile(r"[-+]?\d+")
#: role -> what the column must hold, for the columns pyarrow converts
_INTEGER_ROLES = ("time", "action")


def open_text(path: Path) -> TextIO:
    """The file as text (``.gz`` decompressed; bytes that are not UTF-8 read as U+FFFD)."""
    if path.suffix == ".gz":
        return gzip.open(path, "rt", encoding="utf-8", errors="replace", newline="")
    return open(path, encoding="utf-8", errors="replace", newline="")


def non_blank_lines(path: Path) -> int:
    """The lines of the file that hold more than white space."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as f:
        return sum(1 for line in f if not line.isspace())


def where(row: int, line: int) -> str:
    return f"row {row}" if row == line else f"row {row} (line {line})"


def _records(path: Path, delimiter: str, header: bool) -> Iterator[Tuple[int, int, List[str]]]:
    """(row, line, fields) of each data row; blank lines are skipped like pyarrow does."""
    with open_text(path) as f:
        reader = csv.reader(f, delimiter=delimiter)
        row = 0
        for fields in reader:
            if not fields or fields == [""]:
                continue
            if header:
                header = False
                continue
            row += 1
            yield row, reader.line_num, fields


def _field_problem(role: str, name: str, value: str) -> Optional[str]:
    if role in _INTEGER_ROLES:
        if not value:
            return None  # an empty field is a null: the batch check names it
        if not _INT.fullmatch(value.strip()):
            return f"column {name!r}: {value!r} is not an integer"
        if abs(int(value)) > _INT64_MAX:
            return f"column {name!r}: {value} does not fit in int64"
    elif role == "rating" and value:
        try:
            float(value)
        except ValueError:
            return f"column {name!r}: {value!r} is not a number"
    return None


def _header(path: Path, delimiter: str) -> List[str]:
    with open_text(path) as f:
        for fields in csv.reader(f, delimiter=delimiter):
            if fields and fields != [""]:
                return [field.strip() for field in fields]
    return []


def delimited_problem(path: Path, delimiter: str, header: bool, names: Optional[List[str]],
                      wanted: Dict[str, str]) -> Optional[str]:
    """``"row N (line L): ..."`` for the first data row whose field count or typed value
    pyarrow refuses; None when none is found. ``names``: the columns of a file without a
    header line (None: the header's)."""
    if names is None:
        names = _header(path, delimiter)
    index = {role: names.index(name) for role, name in wanted.items() if name in names}
    for row, line, fields in _records(path, delimiter, header):
        if len(fields) != len(names):
            return (f"{where(row, line)}: {len(fields)} field{'s' * (len(fields) != 1)}; "
                    f"expected {len(names)} ({', '.join(names)})")
        for role, column in index.items():
            problem = _field_problem(role, wanted[role], fields[column])
            if problem:
                return f"{where(row, line)}, {problem}"
    return None


def _kind(value: object) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    return "list" if isinstance(value, list) else "object"


def _json_value_problem(role: str, name: str, value: object) -> Optional[str]:
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > _INT64_MAX:
        return f"column {name!r}: {value} does not fit in int64"
    if role in ("user", "item") and (isinstance(value, float) or _kind(value) in (
            "boolean", "list", "object")):
        return f"column {name!r}: {json.dumps(value)} is not an integer or string {role} id"
    return None


def json_problem(path: Path, wanted: Dict[str, str]) -> Optional[str]:
    """``"row N (line L): ..."`` for the first line of a JSON-lines file that is not one
    object, or whose value pyarrow cannot read as its column's (a kind other than the
    rows before, an integer beyond int64, a non-integer id); None when none is found."""
    kinds: Dict[str, Tuple[str, int]] = {}
    row = 0
    with open_text(path) as f:
        for line, text in enumerate(f, start=1):
            if not text.strip():
                continue
            row += 1
            try:
                record = json.loads(text)
            except json.JSONDecodeError as exc:
                return (f"{where(row, line)}: not a JSON object on one line ({exc.msg}); "
                        "expected one object per line")
            if not isinstance(record, dict):
                return f"{where(row, line)}: a JSON {_kind(record)}; expected one object per line"
            for role, name in wanted.items():
                value = record.get(name)
                if value is None:
                    continue
                problem = _json_value_problem(role, name, value)
                if problem:
                    return f"{where(row, line)}, {problem}"
                first = kinds.setdefault(name, (_kind(value), row))
                if first[0] != _kind(value):
                    return (f"{where(row, line)}, column {name!r}: a {_kind(value)} where row "
                            f"{first[1]} holds a {first[0]}")
    return None
