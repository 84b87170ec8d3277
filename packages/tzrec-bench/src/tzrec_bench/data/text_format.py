"""Reading delimited text data files (plain or gzip) into columns, with errors that say where.

The fast path parses with ``pyarrow.csv``. When it fails, the file is scanned again line by
line in Python only to name the first bad line, since pyarrow's messages give no line number.
Bytes that are not UTF-8 are read as U+FFFD, so such a line is named as not numeric.
"""

from __future__ import annotations

import gzip
import re
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, TextIO, Tuple

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv

_INT = re.compile(r"-?\d+")
_FLOAT = re.compile(r"-?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")
_ARROW_TYPES = {"int": pa.int64(), "float": pa.float64()}
# what reading a truncated or corrupt file raises: gzip.BadGzipFile (an OSError) for a bad
# header or CRC, EOFError for a stream cut short, zlib.error for damaged compressed data
_READ_ERRORS = (OSError, EOFError, zlib.error)


class DataFormatError(ValueError):
    """A data file whose content is not in the expected format; the message names the file,
    the line where known, and the format expected."""


@dataclass(frozen=True)
class TextFormat:
    """A delimited text format.

    Attributes:
        expected (str): the format in words, for error messages, e.g. "4 tab-separated
            integers per line: user id, item id, rating, timestamp".
        delimiter (str): one character, or one character doubled (``"::"``, only in files
            without a header).
        columns (Tuple[Tuple[str, str], ...]): the ``(name, kind)`` columns to read, kind
            ``"int"`` or ``"float"``. Without a header these are every column, in file order;
            with one they are looked up by name and other columns are ignored.
        header (bool): whether the first line names the columns. Default: False.
    """

    expected: str
    delimiter: str
    columns: Tuple[Tuple[str, str], ...]
    header: bool = False


def find_file(data_dir: Path, name: str, what: str) -> Path:
    """``data_dir / name``, else ``data_dir / (name + ".gz")``; FileNotFoundError naming both.

    Args:
        what: the file in words for the message, e.g. "the ml-100k ratings file, ...".
    """
    for candidate in (data_dir / name, data_dir / f"{name}.gz"):
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(f"{data_dir / name} not found (nor {name}.gz): expected {what}")


def _open_text(path: Path) -> TextIO:
    if path.suffix == ".gz":
        return gzip.open(path, "rt", encoding="utf-8", errors="replace")
    return open(path, encoding="utf-8", errors="replace")


def _unreadable(path: Path, exc: BaseException) -> str:
    """Why ``path`` cannot be read, in words, for a message."""
    kind = "zlib.error" if isinstance(exc, zlib.error) else type(exc).__name__
    return f"cannot be read{' as gzip' if path.suffix == '.gz' else ''} ({kind}: {exc})"


def _split(line: str, delimiter: str) -> List[str]:
    return line.rstrip("\r\n").split(delimiter)


def _first_line(path: Path, fmt: TextFormat) -> str:
    try:
        with _open_text(path) as f:
            return f.readline()
    except _READ_ERRORS as exc:  # a truncated or non-gzip .gz file
        raise DataFormatError(f"{path}: {_unreadable(path, exc)}; expected {fmt.expected}") from exc


def _header_names(path: Path, fmt: TextFormat) -> List[str]:
    """The header's column names, after checking it names every column of ``fmt``."""
    names = _split(_first_line(path, fmt), fmt.delimiter)
    missing = [name for name, _ in fmt.columns if name not in names]
    if missing:
        raise DataFormatError(
            f"{path}: line 1: header lacks the column(s) {', '.join(missing)}; "
            f"expected {fmt.expected}"
        )
    return names


def _line_problem(fields: List[str], names: List[str], fmt: TextFormat) -> Optional[str]:
    if len(fields) != len(names):
        return f"{len(fields)} fields instead of {len(names)}"
    for name, kind in fmt.columns:
        value = fields[names.index(name)]
        if not (_INT if kind == "int" else _FLOAT).fullmatch(value):
            return f"{name} is {value!r}, not {'an integer' if kind == 'int' else 'a number'}"
    return None


def _first_bad_line(path: Path, fmt: TextFormat, names: List[str]) -> Optional[str]:
    """``"line N: <problem>"`` for the first line that does not fit ``fmt``, ``"no data
    lines"``, or None if every line fits."""
    data_lines = 0
    with _open_text(path) as f:
        for number, line in enumerate(f, start=1):
            if (number == 1 and fmt.header) or not line.strip():
                continue
            data_lines += 1
            problem = _line_problem(_split(line, fmt.delimiter), names, fmt)
            if problem is not None:
                return f"line {number}: {problem}"
    return None if data_lines else "no data lines"


def _parse(path: Path, fmt: TextFormat, names: List[str]) -> pa.Table:
    """``pyarrow.csv`` over the file; a doubled delimiter is read as single with empty fields
    between, which are typed as strings and checked to be empty."""
    arrow_names = names
    if len(fmt.delimiter) == 2:  # "1::2" splits on ":" into "1", "", "2"
        arrow_names = [x for name in names for x in (name, f"_gap{name}")][:-1]
    kinds = dict(fmt.columns)
    types = {name: _ARROW_TYPES[kinds[name]] for name in kinds}
    gaps = [name for name in arrow_names if name.startswith("_gap")]
    types.update({gap: pa.string() for gap in gaps})
    table = pacsv.read_csv(
        pa.input_stream(str(path), compression="detect"),
        read_options=pacsv.ReadOptions(column_names=None if fmt.header else arrow_names),
        parse_options=pacsv.ParseOptions(delimiter=fmt.delimiter[0], quote_char=False),
        convert_options=pacsv.ConvertOptions(
            column_types=types, include_columns=[*kinds, *gaps]
        ),
    )
    if any(table.column(name).null_count for name in kinds):
        raise pa.ArrowInvalid("empty field")
    if any(pc.any(pc.not_equal(table.column(gap), "")).as_py() for gap in gaps):
        raise pa.ArrowInvalid(f"a single {fmt.delimiter[0]!r} where {fmt.delimiter!r} belongs")
    return table


def read_columns(path: Path, fmt: TextFormat) -> Dict[str, np.ndarray]:
    """The columns of ``fmt`` from ``path`` (``.gz`` is decompressed), one array per column.

    Raises:
        DataFormatError: a missing header column, a line with the wrong number of fields or a
            non-numeric field (bytes that are not UTF-8 included), a non-gzip, truncated or
            corrupt ``.gz``, or an empty file; the message names ``path``, the first bad line
            and ``fmt.expected``.
    """
    names = _header_names(path, fmt) if fmt.header else [name for name, _ in fmt.columns]
    try:
        table = _parse(path, fmt, names)
    except (pa.ArrowInvalid, OSError) as exc:
        try:
            where = _first_bad_line(path, fmt, names)
        except _READ_ERRORS as read_error:  # e.g. a truncated gzip stream
            where = _unreadable(path, read_error)
        raise DataFormatError(
            f"{path}: {where or exc}; expected {fmt.expected}"
        ) from exc
    if table.num_rows == 0:
        raise DataFormatError(f"{path}: no data lines; expected {fmt.expected}")
    return {name: table.column(name).to_numpy() for name, _ in fmt.columns}
