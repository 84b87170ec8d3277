"""The files of an event log given by path, and the rules for a folder of them.

A file given by path must end in a known suffix (:data:`tzrec_gr.file_formats.FORMATS`,
optionally ``.gz``). A folder is searched recursively, and its files are sorted by their
path in it:

- names starting with ``.`` or ``_`` (``_SUCCESS``, ``.DS_Store``, ``_temporary/``), at any
  depth, are a writer's bookkeeping and are passed over without a word;
- files of an unknown kind (no known suffix: ``README.md``, ``notes``) are skipped, and the
  run's header names them;
- the files read must all be of one format: a folder holding Parquet and text files (a
  ``README.txt`` beside ``part-0.parquet``), CSV and Parquet, or JSON lines and CSV, is
  refused, naming each format's files, since a stray file would otherwise be read as
  events. ``.gz`` is a compression, not a format; ``.jsonl``, ``.ndjson`` and ``.json``
  are one format (JSON lines), so a ``schema.json`` beside ``events.jsonl`` is read as a
  log and refused if it is not one object per line;
- the same log twice is refused, naming both files: two files of one folder with one name
  but for the suffix (``events.csv`` and ``events.csv.gz``, ``events.parquet`` and
  ``events.pq``), or two files with identical bytes anywhere in the folder (compared by
  digest among the files of equal size only).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Sequence, Tuple

from tzrec_bench.data.cache import file_digest
from tzrec_bench.data.text_format import DataFormatError
from tzrec_gr.file_formats import FORMATS, format_of

#: names listed in full in a header; longer lists show the first and the last
SHOWN = 4


def _stem(path: Path) -> str:
    """The name without its format suffix and ``.gz``."""
    name = path.name[:-3] if path.name.endswith(".gz") else path.name
    return name[: -len(Path(name).suffix)] if Path(name).suffix else name


def _known_suffixes() -> str:
    return f"{', '.join(FORMATS)} (optionally .gz)"


@dataclass(frozen=True)
class LogFiles:
    """The files of a log: those read, in file order, and those of an unknown kind that a
    folder held and that were skipped; ``names``/``skipped_names`` are relative to the
    folder given (a file given alone: its name)."""

    root: Path
    files: Tuple[Path, ...]
    skipped: Tuple[Path, ...] = ()

    def _relative(self, paths: Sequence[Path]) -> Tuple[str, ...]:
        if self.root.is_file():
            return tuple(path.name for path in paths)
        return tuple(path.relative_to(self.root).as_posix() for path in paths)

    @property
    def names(self) -> Tuple[str, ...]:
        return self._relative(self.files)

    @property
    def skipped_names(self) -> Tuple[str, ...]:
        return self._relative(self.skipped)


def abbreviated(names: Sequence[str]) -> str:
    """``"a, b, c"``; more than :data:`SHOWN` names: ``"first ... last"``."""
    if len(names) <= SHOWN:
        return ", ".join(names)
    return f"{names[0]} ... {names[-1]}"


def describe_files(names: Sequence[str], skipped: Sequence[str] = ()) -> str:
    """``"3 files: a.parquet, b.parquet, c.parquet"``, and the skipped files if any:
    ``"; skipped 1 file of unknown kind: README.md"``; "" for no files."""
    if not names:
        return ""
    text = f"{len(names)} file{'s' if len(names) != 1 else ''}: {abbreviated(names)}"
    if skipped:
        text += (f"; skipped {len(skipped)} file{'s' if len(skipped) != 1 else ''} of "
                 f"unknown kind: {abbreviated(skipped)}")
    return text


def scan(path: Path) -> LogFiles:
    """The log's files by the rules of the module docstring.

    Raises:
        FileNotFoundError: no such path, or a folder with no file of a known kind.
        DataFormatError: a file given alone whose suffix names no format; a folder of
            files of more than one format, or holding the same log twice.
    """
    if path.is_file():
        if format_of(path) is None:
            raise DataFormatError(f"{path}: unknown format; expected a file ending in "
                                  f"{_known_suffixes()}")
        return LogFiles(path, (path,))
    if not path.is_dir():
        raise FileNotFoundError(f"no such file or folder: {path}")
    candidates = sorted(p for p in path.rglob("*") if p.is_file() and not any(
        part.startswith((".", "_")) for part in p.relative_to(path).parts))
    files = [p for p in candidates if format_of(p) is not None]
    skipped = [p for p in candidates if format_of(p) is None]
    if not files:
        raise FileNotFoundError(f"{path}: no file ending in {_known_suffixes()} in this folder")
    log = LogFiles(path, tuple(files), tuple(skipped))
    _refuse_one_name_twice(log)
    _refuse_formats_mixed(log)
    _refuse_same_bytes(log)
    return log


def _refuse_formats_mixed(log: LogFiles) -> None:
    by_format: Dict[str, List[str]] = defaultdict(list)
    for file, name in zip(log.files, log.names):
        by_format[format_of(file)].append(name)
    if len(by_format) > 1:
        kinds = "; ".join(f"{fmt} ({abbreviated(names)})" for fmt, names in by_format.items())
        raise DataFormatError(f"{log.root}: files of {len(by_format)} formats: {kinds}; pass "
                              "one file, or a folder of one format")


def _refuse_one_name_twice(log: LogFiles) -> None:
    seen: Dict[Tuple[Path, str], str] = {}
    for file, name in zip(log.files, log.names):
        key = (file.parent, _stem(file))
        if key in seen:
            raise DataFormatError(f"{log.root}: {seen[key]} and {name} look like the same log "
                                  "twice (one name, two suffixes); keep one of them")
        seen[key] = name


def _refuse_same_bytes(log: LogFiles) -> None:
    by_size: Dict[int, List[int]] = defaultdict(list)
    for index, file in enumerate(log.files):
        by_size[file.stat().st_size].append(index)
    for indices in by_size.values():
        if len(indices) < 2:
            continue
        seen: Dict[str, int] = {}
        for index in indices:
            digest = file_digest(log.files[index])
            if digest in seen:
                first, second = log.names[seen[digest]], log.names[index]
                raise DataFormatError(f"{log.root}: {first} and {second} hold the same bytes: "
                                      "the same log twice; keep one of them")
            seen[digest] = index
