"""Raw ids <-> model rows: what a checkpoint carries so that users talk in their own ids.

A model numbers its items (and a data set its users) densely, ``0..N-1``; the ids in a user's
event log are anything else: integers of any range, or strings. A :class:`Vocabulary` holds
the raw ids of one kind of entity sorted, so that row ``r`` is the ``r``-th smallest raw id
(the numbering tzrec-bench's loaders give). :class:`IdVocabularies` pairs the users' and the
items' with a fingerprint of the training data; checkpoints store its :meth:`state
<IdVocabularies.state>` under :data:`VOCABULARY_KEY` and exported packages carry it::

    vocab = Vocabulary(["sku-9", "sku-1", "sku-4"])     # rows: sku-1 0, sku-4 1, sku-9 2
    vocab.rows(["sku-4", "nope"])                        # array([ 1, -1])
    vocab.raw([2, 0])                                    # ['sku-9', 'sku-1']

Lookups are vectorised (``numpy.searchsorted`` over the sorted ids): no Python loop per id.
The state is made of tensors, strings and ints only, so ``torch.load(weights_only=True)``
reads it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Sequence, Union

import numpy as np
import torch

__all__ = [
    "ID_KINDS",
    "VOCABULARY_KEY",
    "IdVocabularies",
    "Vocabulary",
    "VocabularyError",
]

#: the payload key under which checkpoints and exported packages hold :class:`IdVocabularies`
VOCABULARY_KEY = "vocabulary"
#: the raw id types a vocabulary holds
ID_KINDS = ("int", "str")

RawIds = Union[Sequence[Any], np.ndarray]


class VocabularyError(ValueError):
    """A vocabulary state that cannot be read, or two vocabularies that do not match; the
    message says which and how."""


def _as_id_array(raw_ids: RawIds) -> np.ndarray:
    """``raw_ids`` as an int64 array (integers) or a numpy str array (anything else)."""
    array = np.asarray(raw_ids)
    if array.dtype.kind in "iu":
        if array.dtype == np.uint64 and array.size and array.max() > np.iinfo(np.int64).max:
            raise VocabularyError("raw integer ids must fit in int64")
        return array.astype(np.int64, copy=False)
    if array.dtype.kind == "U":
        return array
    if array.dtype.kind == "b" or array.dtype.kind == "f":
        raise VocabularyError(
            f"raw ids must be integers or strings; got {array.dtype} values"
        )
    values = array.tolist() if array.ndim else [array.item()]
    if all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in values):
        return np.asarray(values, dtype=np.int64)
    if all(isinstance(v, str) for v in values):
        return np.asarray(values, dtype=np.str_)
    kinds = sorted({type(v).__name__ for v in values})
    raise VocabularyError(f"raw ids must be all integers or all strings; got {', '.join(kinds)}")


class Vocabulary:
    """The raw ids of one kind of entity (users or items), sorted: row ``r`` is the
    ``r``-th smallest.

    Args:
        raw_ids: the distinct raw ids, integers or strings, in any order; duplicates are an
            error (two rows cannot share an id).

    Attributes:
        kind (str): ``"int"`` or ``"str"``.
        ids (np.ndarray): [N] the sorted raw ids (int64, or a numpy str array).
    """

    def __init__(self, raw_ids: RawIds) -> None:
        ids = np.sort(_as_id_array(raw_ids).reshape(-1))
        if len(ids) > 1 and np.any(ids[1:] == ids[:-1]):
            duplicate = ids[1:][ids[1:] == ids[:-1]][0]
            raise VocabularyError(f"raw id {duplicate!r} appears twice")
        self.ids = ids
        self.kind = "int" if ids.dtype == np.int64 else "str"

    @classmethod
    def dense(cls, size: int) -> "Vocabulary":
        """The identity vocabulary ``0..size-1`` (data generated with dense ids)."""
        return cls(np.arange(size, dtype=np.int64))

    def __len__(self) -> int:
        return len(self.ids)

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, Vocabulary)
            and self.kind == other.kind
            and len(self) == len(other)
            and bool(np.array_equal(self.ids, other.ids))
        )

    def __repr__(self) -> str:
        shown = ", ".join(repr(v) for v in self.ids[:3].tolist())
        return f"Vocabulary({len(self)} {self.kind} ids: {shown}{', ...' if len(self) > 3 else ''})"

    def rows(self, raw_ids: RawIds) -> np.ndarray:
        """[n] int64 rows of ``raw_ids``; -1 for an id this vocabulary does not hold (an id
        of the other kind, e.g. a string in an integer vocabulary, included)."""
        query = np.asarray(raw_ids)
        flat = query.reshape(-1)
        out = np.full(flat.shape, -1, dtype=np.int64)
        if not len(self) or not flat.size:
            return out.reshape(query.shape)
        if self.kind == "int":
            if flat.dtype.kind not in "iu":
                if flat.dtype.kind != "O":
                    return out.reshape(query.shape)
                is_int = np.array([isinstance(v, (int, np.integer)) and not isinstance(v, bool)
                                   and -2**63 <= v < 2**63 for v in flat.tolist()], dtype=bool)
                if not is_int.any():
                    return out.reshape(query.shape)
                sub = np.asarray([v for v, ok in zip(flat.tolist(), is_int) if ok], np.int64)
                out[is_int] = self.rows(sub)
                return out.reshape(query.shape)
            if flat.dtype == np.uint64:
                fits = flat <= np.iinfo(np.int64).max
                out[fits] = self.rows(flat[fits].astype(np.int64))
                return out.reshape(query.shape)
            flat = flat.astype(np.int64, copy=False)
        elif flat.dtype.kind != "U":
            if flat.dtype.kind != "O":
                return out.reshape(query.shape)
            is_str = np.array([isinstance(v, str) for v in flat.tolist()], dtype=bool)
            if not is_str.any():
                return out.reshape(query.shape)
            out[is_str] = self.rows(np.asarray([v for v in flat[is_str].tolist()], np.str_))
            return out.reshape(query.shape)
        pos = np.searchsorted(self.ids, flat)
        inside = pos < len(self)
        hit = np.zeros(flat.shape, dtype=bool)
        hit[inside] = self.ids[pos[inside]] == flat[inside]
        out[hit] = pos[hit]
        return out.reshape(query.shape)

    def raw(self, rows: Union[Sequence[int], np.ndarray, torch.Tensor]) -> List[Any]:
        """The raw ids of ``rows`` (Python ints or strs), in order.

        Raises:
            IndexError: a row outside ``[0, len(self))``.
        """
        if isinstance(rows, torch.Tensor):
            rows = rows.detach().cpu().numpy()
        index = np.asarray(rows, dtype=np.int64).reshape(-1)
        if index.size and (index.min() < 0 or index.max() >= len(self)):
            raise IndexError(f"rows must lie in [0, {len(self)}); got [{index.min()}, "
                             f"{index.max()}]")
        return self.ids[index].tolist()

    def parse(self, text: str) -> Any:
        """A raw id from its text (a CSV field): an int for an integer vocabulary when the
        text is one, else the text itself (which then matches no integer id)."""
        if self.kind == "int":
            try:
                return int(text)
            except ValueError:
                return text
        return text

    # -- saving ------------------------------------------------------------------------

    def state(self) -> Dict[str, Any]:
        """What a checkpoint stores: ``{"kind", "ids"}`` (int64 tensor) for integers;
        ``{"kind", "utf8", "offsets"}`` (the ids' UTF-8 bytes back to back, and where each
        starts) for strings."""
        if self.kind == "int":
            return {"kind": "int", "ids": torch.from_numpy(self.ids.copy())}
        encoded = [value.encode("utf-8") for value in self.ids.tolist()]
        offsets = np.zeros(len(encoded) + 1, dtype=np.int64)
        np.cumsum([len(b) for b in encoded], out=offsets[1:])
        utf8 = np.frombuffer(b"".join(encoded), dtype=np.uint8).copy()
        return {"kind": "str", "utf8": torch.from_numpy(utf8),
                "offsets": torch.from_numpy(offsets)}

    @classmethod
    def from_state(cls, state: Mapping[str, Any], what: str = "vocabulary") -> "Vocabulary":
        """The inverse of :meth:`state`.

        Raises:
            VocabularyError: ``state`` is not such a dict (``what`` names it in the message).
        """
        try:
            kind = state["kind"]
            if kind == "int":
                ids = state["ids"]
                return cls(np.asarray(ids.numpy() if isinstance(ids, torch.Tensor) else ids,
                                      dtype=np.int64))
            if kind == "str":
                data = bytes(state["utf8"].numpy().tobytes())
                offsets = state["offsets"].tolist()
                return cls(np.asarray([data[a:b].decode("utf-8")
                                       for a, b in zip(offsets[:-1], offsets[1:])],
                                      dtype=np.str_))
        except (KeyError, TypeError, AttributeError, UnicodeDecodeError, ValueError) as exc:
            raise VocabularyError(f"{what}: not a saved vocabulary ({exc})") from exc
        raise VocabularyError(f"{what}: kind must be one of {', '.join(ID_KINDS)}; got {kind!r}")


@dataclass(frozen=True, eq=False)
class IdVocabularies:
    """The users' and the items' vocabularies of a model's training data.

    Attributes:
        users (Vocabulary): row ``u`` of the data is user ``users.ids[u]``.
        items (Vocabulary): item row ``i`` of the model is ``items.ids[i]``.
        fingerprint (str): a digest of the training data's events (tzrec-bench: the events,
            users and items after loading and filtering), compared on ``--resume`` and
            ``evaluate``.
        source (str): where the data came from, in words (a data set's name, a path).
    """

    users: Vocabulary
    items: Vocabulary
    fingerprint: str = ""
    source: str = ""

    def check_catalogue(self, num_items: int, what: str) -> None:
        """Raises ValueError naming ``what`` unless the item vocabulary holds ``num_items``
        ids, one per row of the model's catalogue."""
        if len(self.items) != num_items:
            raise ValueError(
                f"{what}: its item vocabulary has {len(self.items)} ids but the model "
                f"{num_items} items; the file is inconsistent"
            )

    def state(self) -> Dict[str, Any]:
        """What checkpoints store under :data:`VOCABULARY_KEY`."""
        return {"users": self.users.state(), "items": self.items.state(),
                "fingerprint": self.fingerprint, "source": self.source}

    @classmethod
    def from_state(cls, state: Any, what: str = "the checkpoint") -> "IdVocabularies":
        """The inverse of :meth:`state`; :class:`VocabularyError` naming ``what``."""
        if not isinstance(state, Mapping) or not {"users", "items"} <= set(state):
            raise VocabularyError(f"{what}: its {VOCABULARY_KEY} is not a dict with users "
                                  "and items")
        return cls(
            users=Vocabulary.from_state(state["users"], f"{what}: user vocabulary"),
            items=Vocabulary.from_state(state["items"], f"{what}: item vocabulary"),
            fingerprint=str(state.get("fingerprint", "")),
            source=str(state.get("source", "")),
        )

    @classmethod
    def from_payload(cls, payload: Mapping[str, Any], what: str) -> Optional["IdVocabularies"]:
        """The vocabularies a checkpoint or package ``payload`` holds, or None when it has
        none (a plain state dict, or a checkpoint saved without one)."""
        state = payload.get(VOCABULARY_KEY)
        return None if state is None else cls.from_state(state, what)

    def differences(self, other: "IdVocabularies") -> List[str]:
        """What differs between ``self`` (e.g. a checkpoint's) and ``other`` (e.g. the data
        at hand), in words; empty when they match."""
        found: List[str] = []
        for name, mine, theirs in (("item", self.items, other.items),
                                   ("user", self.users, other.users)):
            if mine == theirs:
                continue
            if mine.kind != theirs.kind:
                found.append(f"{name} ids are {theirs.kind}s, not {mine.kind}s")
            elif len(mine) != len(theirs):
                found.append(f"{len(theirs)} {name}s instead of {len(mine)}")
            else:
                first = int(np.flatnonzero(mine.ids != theirs.ids)[0])
                found.append(f"{name} ids differ (row {first}: {theirs.ids[first].item()!r} "
                             f"instead of {mine.ids[first].item()!r})")
        if not found and self.fingerprint and other.fingerprint and (
            self.fingerprint != other.fingerprint
        ):
            found.append(f"the events differ (data fingerprint {other.fingerprint} instead of "
                         f"{self.fingerprint})")
        return found

