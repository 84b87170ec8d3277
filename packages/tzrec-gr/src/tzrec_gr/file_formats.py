"""The file formats of event logs and prediction inputs, told by their suffix.

One table for both readers: training's event-log reader (tzrec-bench) and the predict input
reader (:mod:`tzrec_gr.serving.files`), so a file that one reads the other reads too. A text
format may be gzip-compressed (``.csv.gz``): ``.gz`` is looked through, it is no format.
``.jsonl``, ``.ndjson`` and ``.json`` are one format, JSON lines (one object per line).
``text`` (``user item [time]`` per line) is for event logs only.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Union

__all__ = ["FORMATS", "format_of"]

#: file suffix (before an optional ``.gz``) -> format
FORMATS = {
    ".parquet": "parquet", ".pq": "parquet", ".csv": "csv", ".tsv": "tsv",
    ".jsonl": "json", ".ndjson": "json", ".json": "json", ".txt": "text",
}


def format_of(path: Union[str, Path]) -> Optional[str]:
    """The file's format by its suffix (``.gz`` looked through), or None."""
    path = Path(path)
    suffixes = path.suffixes[-2:] if path.suffix.lower() == ".gz" else path.suffixes[-1:]
    return FORMATS.get(suffixes[0].lower()) if suffixes else None
