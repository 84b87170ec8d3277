"""Item attributes (categories, brands, ...) read from a JSON file, in a data set's item ids.

The file is one JSON object (optionally gzip-compressed, ``.gz``) mapping each raw item id to
a list of its attributes, as S3-Rec's ``*_item2attributes.json`` ship::

    {"4": [1, 2, 3], "83": [4, 5, 6], "sku-x": ["brand:acme", "cat:soap"]}

Keys are matched against the data set's raw item ids as text; attributes are integers or
strings, renumbered densely (in sorted order). An item of the catalogue the file does not name
has no attributes; a key that names no item of the catalogue is counted and ignored.
Legend: I = items, K = (item, attribute) links.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
from pathlib import Path
from typing import Dict, List, Union

import numpy as np

from tzrec_bench.data.text_format import find_file

__all__ = ["ItemAttributes", "load_item_attributes"]


@dataclasses.dataclass(frozen=True)
class ItemAttributes:
    """Each item's attributes as jagged lists, in dense item ids.

    Attributes:
        offsets (np.ndarray): [I + 1] int64; item i's attributes are
            ``attribute_ids[offsets[i]:offsets[i + 1]]``.
        attribute_ids (np.ndarray): [K] int64 in ``[0, num_attributes)``.
        num_attributes (int): distinct attributes.
        unknown_keys (int): keys of the file that name no item of the catalogue.
    """

    offsets: np.ndarray
    attribute_ids: np.ndarray
    num_attributes: int
    unknown_keys: int

    @property
    def num_links(self) -> int:
        return int(self.attribute_ids.shape[0])

    def describe(self) -> str:
        """One line for a run's log."""
        counts = np.diff(self.offsets)
        return (f"item attributes: {self.num_attributes} attributes, {self.num_links} links, "
                f"{int((counts > 0).sum())} of {counts.shape[0]} items with at least one"
                + (f"; {self.unknown_keys} keys of the file are no item of the data"
                   if self.unknown_keys else ""))


FILE_DESCRIPTION = "item attributes (a JSON object: item id -> list of attributes)"


def _read_json(path: Path) -> object:
    path = find_file(path.parent, path.name, FILE_DESCRIPTION)
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rt", encoding="utf-8") as f:
            return json.load(f)
    except (OSError, EOFError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"item attributes: {path} is not readable JSON ({exc})") from None


def _raw_key(raw: object) -> str:
    """A raw item id as the file's keys write it (integers without a decimal point)."""
    if isinstance(raw, (np.integer, int)):
        return str(int(raw))
    return str(raw)


def _attribute_order(name: str) -> tuple:
    """Integers first, by value; then strings."""
    number = name.lstrip("-").isdigit()
    return (not number, int(name) if number else 0, name)


def load_item_attributes(path: Union[str, Path], item_raw_ids: np.ndarray) -> ItemAttributes:
    """The attributes in ``path`` of the items ``item_raw_ids`` (item i's raw id at i).

    Raises:
        FileNotFoundError: no file at ``path`` (nor at ``path`` + ``.gz``).
        ValueError: not a JSON object of lists of integers or strings, or no key names an
            item of the catalogue; the message names the file and the offending key.
    """
    path = Path(path)
    table = _read_json(path)
    if not isinstance(table, dict):
        raise ValueError(f"item attributes: {path} must hold one JSON object (item id -> list "
                         f"of attributes), got a {type(table).__name__}")
    index: Dict[str, int] = {_raw_key(raw): i for i, raw in enumerate(item_raw_ids.tolist())}
    per_item: List[List[str]] = [[] for _ in index]
    unknown = 0
    for key, attributes in table.items():
        if not isinstance(attributes, list) or not all(
            isinstance(a, (int, str)) and not isinstance(a, bool) for a in attributes
        ):
            raise ValueError(f"item attributes: {path}, item {key!r}: expected a list of "
                             f"integers or strings, got {attributes!r}")
        item = index.get(key)
        if item is None:
            unknown += 1
            continue
        # repeated attributes of one item count once
        per_item[item] = sorted({str(a) for a in attributes}, key=_attribute_order)
    names = sorted({a for attributes in per_item for a in attributes}, key=_attribute_order)
    if not names:
        raise ValueError(f"item attributes: no key of {path} names an item of the data "
                         f"({len(table)} keys; the data's item ids look like "
                         f"{', '.join(repr(k) for k in list(index)[:3])})")
    number = {name: i for i, name in enumerate(names)}
    counts = np.array([len(a) for a in per_item], dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    ids = np.array([number[a] for attributes in per_item for a in attributes], dtype=np.int64)
    return ItemAttributes(offsets, ids, len(names), unknown)
