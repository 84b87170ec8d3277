"""Exact top-K items of the whole catalogue per user, in item chunks on the device.

Legend: B = users, I = catalogue items, E = embedding width, K = items returned, c = chunk.

:func:`catalogue_topk` scores ``user_embeddings @ item_embeddings.T`` one chunk of items at a
time and keeps a running top-K per user, so it holds ``B x (c + K)`` scores at most (never
``B x I``) and scans catalogues of millions of items. The items may be one tensor or a
function that returns any id range's rows (a table that is not one tensor, e.g. torchrec's).

The order is total and exact: score descending, then item id ascending among equal scores.
It is what a dense ``torch.sort(scores, descending=True, stable=True)`` gives, whatever the
chunk size: each score is turned into an int64 key ``(order-preserving bits of the float32
score) << 32 | (2^32 - 1 - id)``, which no two items share, so every top-K (of a chunk or of
the running one) picks the same items.
"""

from __future__ import annotations

from typing import Any, Callable, List, NamedTuple, Optional, Sequence, Tuple, Union

import torch

from tzrec_ops.jagged import check_once, first_true, offsets_from_lengths, row_positions

__all__ = ["ItemRows", "TopK", "catalogue_topk"]

#: a function from an id range ``(start, stop)`` to those items' rows ``[stop - start, E]``
ItemRows = Callable[[int, int], torch.Tensor]

#: Exclusions: jagged ``(values [X], offsets [B + 1])``, or one sequence of ids per user.
Exclusions = Union[Tuple[torch.Tensor, torch.Tensor], Sequence[Sequence[int]]]

_ABSENT = torch.iinfo(torch.int64).min  # the key of an excluded item or an empty slot
_LOW32 = (1 << 32) - 1


class TopK(NamedTuple):
    """The K best items of each user.

    Attributes:
        ids (torch.Tensor): [B, K] int64 item ids, best first; ``-1`` in the slots left over
            when a user has fewer than K items that are not excluded.
        scores (torch.Tensor): [B, K] their scores (``-inf`` in the left-over slots).
    """

    ids: torch.Tensor
    scores: torch.Tensor

    def raw_ids(self, vocabulary: Any) -> List[List[Any]]:
        """The items as raw ids, one list per user, best first, without the ``-1`` slots
        (one read of ``ids`` to the host).

        Args:
            vocabulary: the model's :class:`~tzrec_gr.vocabulary.IdVocabularies` (a
                session's ``vocabularies``) or its items'
                :class:`~tzrec_gr.vocabulary.Vocabulary`.
        """
        items = getattr(vocabulary, "items", vocabulary)
        if vocabulary is None or not hasattr(items, "raw"):
            raise ValueError(
                "raw_ids needs the model's item vocabulary (a session's vocabularies); "
                f"got {type(vocabulary).__name__}"
            )
        ids = self.ids.detach().cpu()
        return [items.raw(row[row >= 0]) for row in ids]


def _keys(scores: torch.Tensor, first_id: int) -> torch.Tensor:
    """[B, c] unique int64 keys of ``scores`` [B, c] for items ``first_id + j``: larger for a
    larger score, then for a smaller id."""
    s = scores.float() + 0.0  # -0.0 + 0.0 is +0.0: equal scores get equal bits
    bits = s.view(torch.int32).to(torch.int64)
    ordered = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)  # monotonic in the float
    ids = torch.arange(first_id, first_id + s.shape[1], device=s.device, dtype=torch.int64)
    return (ordered << 32) | (_LOW32 - ids)


def _ids_of(keys: torch.Tensor) -> torch.Tensor:
    return _LOW32 - (keys & _LOW32)


def _exclusions(
    exclude: Optional[Exclusions], batch: int, num_items: int, device: torch.device
) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
    """The exclusions as (user [X], item [X]) int64 on ``device``, or None."""
    if exclude is None:
        return None
    if isinstance(exclude, tuple) and len(exclude) == 2 and isinstance(exclude[0], torch.Tensor):
        values, offsets = exclude
        if not isinstance(offsets, torch.Tensor):
            raise ValueError(
                "exclude must be (values, offsets) tensors or one id sequence per user, got "
                f"offsets of type {type(offsets).__name__}"
            )
    else:
        rows = [torch.as_tensor(list(r), dtype=torch.int64) for r in exclude]
        values = torch.cat(rows) if rows else torch.zeros(0, dtype=torch.int64)
        offsets = offsets_from_lengths(torch.tensor([r.numel() for r in rows], dtype=torch.int64))
    for name, t in (("exclude values", values), ("exclude offsets", offsets)):
        if t.dim() != 1 or t.is_floating_point() or t.dtype == torch.bool:
            raise ValueError(f"{name} must be a 1-D integer tensor, got {t.dtype} {tuple(t.shape)}")
    if offsets.shape[0] != batch + 1:
        raise ValueError(
            f"exclude holds {offsets.shape[0] - 1} users but user_embeddings has {batch}; "
            "they must match"
        )

    def check(o: torch.Tensor, v: torch.Tensor) -> None:
        if int(o[0]) != 0 or bool((o[1:] < o[:-1]).any()) or int(o[-1]) != v.shape[0]:
            raise ValueError(
                f"exclude offsets must start at 0, never decrease and end at the number of "
                f"values ({v.shape[0]}), got {o.tolist()}"
            )
        bad = (v < 0) | (v >= num_items)
        if bool(bad.any()):
            i = first_true(bad)
            user = int(torch.searchsorted(o, torch.tensor(i), right=True)) - 1
            raise ValueError(
                f"exclude of user {user} holds item id {int(v[i])}, outside the catalogue "
                f"[0, {num_items})"
            )

    check_once(("tzrec_gr.exclude", num_items), (offsets, values), check)
    values = values.to(device=device, dtype=torch.int64)
    offsets = offsets.to(device=device, dtype=torch.int64)
    user, _ = row_positions(offsets, values.shape[0])
    return user, values


def catalogue_topk(
    user_embeddings: torch.Tensor,
    item_embeddings: Union[torch.Tensor, ItemRows],
    k: int,
    *,
    exclude: Optional[Exclusions] = None,
    num_items: Optional[int] = None,
    chunk_size: int = 65536,
) -> TopK:
    """The K items of the catalogue with the largest ``user . item`` per user.

    Exact, in a total order: score descending, then item id ascending (see the module
    docstring); equal to a dense ``torch.sort(user_embeddings @ item_embeddings.T,
    descending=True, stable=True)`` cut to K, with excluded items removed.

    Args:
        user_embeddings (torch.Tensor): [B, E] float.
        item_embeddings (torch.Tensor | Callable[[int, int], torch.Tensor]): the catalogue
            [I, E], or a function from an id range ``(start, stop)`` to its rows
            ``[stop - start, E]`` (then ``num_items`` is required). Rows are cast to
            ``user_embeddings``' dtype.
        k (int): items per user, in ``[1, I]``.
        exclude: items never returned, per user: jagged ``(values [X], offsets [B + 1])``
            integer tensors or one sequence of ids per user; ids in ``[0, I)``, repeats
            allowed. Default: None.
        num_items (int | None): I; required with a function, checked against a tensor.
        chunk_size (int): items scored at a time (memory ``B x (chunk_size + k)``).
            Default: 65536.

    Returns:
        TopK: ``ids`` [B, K] int64 and ``scores`` [B, K] in the scores' dtype, best first;
        a user with fewer than K items left after the exclusions gets ``-1`` / ``-inf`` in
        the remaining slots. Scores must be finite or ``-inf`` (NaN has no place in the
        order).

    Raises:
        ValueError: a bad argument (named), an exclusion outside the catalogue (its user
            named; checked on host copies, so pass CPU exclusions or tensors moved with
            ``tzrec_ops.to_device`` to avoid a device read).
    """
    if not isinstance(user_embeddings, torch.Tensor) or user_embeddings.dim() != 2:
        raise ValueError(
            "user_embeddings must be a [B, E] tensor, got "
            f"{getattr(user_embeddings, 'shape', type(user_embeddings).__name__)}"
        )
    if not user_embeddings.is_floating_point():
        raise ValueError(f"user_embeddings must be a float tensor, got {user_embeddings.dtype}")
    if isinstance(item_embeddings, torch.Tensor):
        if item_embeddings.dim() != 2 or item_embeddings.shape[1] != user_embeddings.shape[1]:
            raise ValueError(
                f"item_embeddings must be [I, E] with E = {user_embeddings.shape[1]} (from "
                f"user_embeddings), got {tuple(item_embeddings.shape)}"
            )
        if num_items is not None and num_items != item_embeddings.shape[0]:
            raise ValueError(
                f"num_items ({num_items}) must equal item_embeddings.shape[0] "
                f"({item_embeddings.shape[0]})"
            )
        table = item_embeddings
        num_items = table.shape[0]

        def rows(start: int, stop: int) -> torch.Tensor:
            return table[start:stop]

    elif callable(item_embeddings):
        if num_items is None:
            raise ValueError("num_items is required when item_embeddings is a function")
        rows = item_embeddings
    else:
        raise ValueError(
            "item_embeddings must be an [I, E] tensor or a function (start, stop) -> rows, "
            f"got {type(item_embeddings).__name__}"
        )
    for name, value, low in (("num_items", num_items, 1), ("chunk_size", chunk_size, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= num_items:
        raise ValueError(f"k must be an int in [1, num_items={num_items}], got {k!r}")
    if num_items >= _LOW32:
        raise ValueError(f"num_items must be below 2**32 - 1, got {num_items}")
    excluded = _exclusions(exclude, user_embeddings.shape[0], num_items, user_embeddings.device)
    return scan_topk(user_embeddings, rows, num_items, k, excluded, chunk_size)


def scan_topk(
    users: torch.Tensor,
    rows: ItemRows,
    num_items: int,
    k: int,
    excluded: Optional[Tuple[torch.Tensor, torch.Tensor]],
    chunk_size: int,
) -> TopK:
    """:func:`catalogue_topk`'s scan, on checked arguments: nothing is read on the host, so
    a CUDA graph can capture it (the chunk loop is fixed by ``num_items`` and
    ``chunk_size``). The scores are computed for the users padded with zero rows to a power
    of two, so B users and the same users padded to any count up to that power get the
    same bits.

    Args:
        users (torch.Tensor): [B, E] float.
        rows (Callable[[int, int], torch.Tensor]): the catalogue rows of an id range.
        num_items (int): I.
        k (int): items per user, in ``[1, I]``.
        excluded: (user [X], item [X]) int64 on ``users``' device, or None; an item outside
            ``[0, I)`` excludes nothing (padding).
        chunk_size (int): items scored at a time.

    Returns:
        TopK: as :func:`catalogue_topk`.
    """
    batch, device = users.shape[0], users.device
    # the product runs on the users padded with zero rows to a power of two: a matrix
    # library may round a row differently for another number of rows, and this way a CUDA
    # graph of a padded batch (2^n users, or fewer padded to them) gives the same bits
    rows_padded = 1 << (batch - 1).bit_length()
    lhs = users
    if rows_padded != batch:
        lhs = torch.cat([users, users.new_zeros(rows_padded - batch, users.shape[1])])
    best_keys = torch.full((batch, k), _ABSENT, dtype=torch.int64, device=device)
    best_scores: Optional[torch.Tensor] = None
    for start in range(0, num_items, chunk_size):
        stop = min(start + chunk_size, num_items)
        chunk = rows(start, stop)
        if chunk.shape != (stop - start, users.shape[1]):
            raise ValueError(
                f"item_embeddings({start}, {stop}) must return [{stop - start}, "
                f"{users.shape[1]}] rows, got {tuple(chunk.shape)}"
            )
        scores = (lhs @ chunk.to(device=device, dtype=users.dtype).t())[:batch]
        keys = _keys(scores, start)
        if excluded is not None:
            user, item = excluded
            inside = (item >= start) & (item < stop)
            # exclusions outside the chunk go to a spare column, dropped after
            column = torch.where(inside, item - start, stop - start)
            keys = torch.cat([keys, keys.new_empty(batch, 1)], dim=1)
            keys = keys.index_put((user, column), torch.full_like(item, _ABSENT)).narrow(
                1, 0, stop - start
            )
        if best_scores is None:
            best_scores = torch.full((batch, k), float("-inf"), dtype=scores.dtype, device=device)
        both_keys = torch.cat([best_keys, keys], dim=1)
        both_scores = torch.cat([best_scores, scores], dim=1)
        best_keys, where = both_keys.topk(k, dim=1)
        best_scores = both_scores.gather(1, where)
    assert best_scores is not None  # num_items >= 1
    absent = best_keys == _ABSENT
    ids = torch.where(absent, torch.full_like(best_keys, -1), _ids_of(best_keys))
    scores = best_scores.masked_fill(absent, float("-inf"))
    return TopK(ids, scores)
