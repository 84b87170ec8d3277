"""Writing predictions: rows to a CSV or Parquet file under a temporary name, renamed when
the run ends (:func:`~tzrec_gr.serving.files.predict_file`), so that a failed run leaves no
partial output. Parquet needs pyarrow (imported for a Parquet file only); CSV is written
with the standard library, one row per user like Parquet: a list (item ids, scores) is a JSON
list in its cell (``["a b", "c,d"]``, ``[0.91, 0.5]``), so that any id, one with spaces,
commas or quotes too, reads back with a CSV reader and ``json.loads``.
"""

from __future__ import annotations

import csv
import json
import os
import pathlib
from typing import Any, Dict, List, Optional, Sequence, TextIO, Tuple

from tzrec_gr.serving._rows import PredictError
from tzrec_ops.extras import require

__all__ = ["Writer"]


class Writer:
    """Rows to a CSV or Parquet file, under a temporary name until :meth:`commit`."""

    def __init__(
        self,
        path: pathlib.Path,
        fmt: str,
        columns: Sequence[Tuple[str, str]],
        item_kind: str = "int",
    ) -> None:
        self.path = path
        self.tmp = path.with_name(f".{path.name}.partial")
        self.fmt = fmt
        self.columns = list(columns)  # (name, "id" | "items" | "floats")
        self.item_kind = item_kind  # "int" or "str": the type of the "items" columns' ids
        self._csv: Optional[Any] = None
        self._file: Optional[TextIO] = None
        self._parquet: Optional[Any] = None
        self._id_type: Optional[str] = None
        if fmt == "csv":
            self._file = open(self.tmp, "w", newline="")
            self._csv = csv.writer(self._file)
            self._csv.writerow([name for name, _ in self.columns])

    def write(self, rows: List[Dict[str, Any]]) -> None:
        if not rows:
            return
        if self._csv is not None:
            for r in rows:
                self._csv.writerow([_cell(r[name], kind) for name, kind in self.columns])
            return
        pa = require("pyarrow", "pyarrow", "writing Parquet (--output *.parquet)")
        pq = require("pyarrow.parquet", "pyarrow", "writing Parquet (--output *.parquet)")
        if self._id_type is None:
            ints = all(
                isinstance(r["user_id"], int) and not isinstance(r["user_id"], bool) for r in rows
            )
            self._id_type = "int" if ints else "str"
        types = {
            **self._list_types(pa),
            "id": pa.int64() if self._id_type == "int" else pa.string(),
        }
        schema = pa.schema([(name, types[kind]) for name, kind in self.columns])
        data = {}
        for name, kind in self.columns:
            values = [r[name] for r in rows]
            if kind == "id" and self._id_type == "str":
                values = [str(v) for v in values]
            data[name] = values
        try:
            table = pa.Table.from_pydict(data, schema=schema)
        except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError) as exc:
            raise PredictError(
                f"--output {self.path}: user_id must keep one type across the file ({exc})"
            ) from exc
        if self._parquet is None:
            self._parquet = pq.ParquetWriter(str(self.tmp), schema)
        self._parquet.write_table(table)

    def commit(self) -> None:
        self._close()
        if self.fmt == "parquet" and not self.tmp.exists():  # no row: an empty table
            pa = require("pyarrow", "pyarrow", "writing Parquet")
            pq = require("pyarrow.parquet", "pyarrow", "writing Parquet")
            types = {**self._list_types(pa), "id": pa.string()}
            schema = pa.schema([(name, types[kind]) for name, kind in self.columns])
            pq.write_table(schema.empty_table(), str(self.tmp))
        os.replace(self.tmp, self.path)

    def _list_types(self, pa: Any) -> Dict[str, Any]:
        items = pa.int64() if self.item_kind == "int" else pa.string()
        return {"items": pa.list_(items), "floats": pa.list_(pa.float32())}

    def abort(self) -> None:
        self._close()
        self.tmp.unlink(missing_ok=True)

    def _close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._parquet is not None:
            self._parquet.close()
            self._parquet = None


def _cell(value: Any, kind: str) -> str:
    if kind == "items":
        return json.dumps(list(value), ensure_ascii=False)
    if kind == "floats":
        return json.dumps([float(v) for v in value])
    return str(value)
