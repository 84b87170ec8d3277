"""The file formats of event logs and prediction inputs, told by their suffix.

One table for both readers: training's event-log reader (tzrec-bench) and the predict input
reader (:mod:`tzrec_gr.serving.files`), so a file that one reads the other reads too. A text
format may be gzip-compressed (``.csv.gz``): ``.gz`` is looked through, it is no format.
``.jsonl``, ``.ndjson`` and ``.json`` are one format, JSON lines (one object per line).
``text`` (``user item [time]`` per line) and ``sequences`` (``.seq``: ``user item item ...``,
one user a line) are for event logs only (:data:`LOG_ONLY`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Union

__all__ = ["FORMATS", "LOG_ONLY", "format_of"]

#: file suffix (before an optional ``.gz``) -> format
FORMATS = {
    ".parquet": "parquet", ".pq": "parquet", ".csv": "csv", ".tsv": "tsv",
    ".jsonl": "json", ".ndjson": "json", ".json": "json", ".txt": "text", ".seq": "sequences",
}
#: the formats read as event logs only, not as prediction inputs
LOG_ONLY = frozenset({"text", "sequences"})


def format_of(path: Union[str, Path]) -> Optional[str]:
    """The file's format by its suffix (``.gz`` looked through), or None."""
    path = Path(path)
    suffixes = path.suffixes[-2:] if path.suffix.lower() == ".gz" else path.suffixes[-1:]
    return FORMATS.get(suffixes[0].lower()) if suffixes else None
