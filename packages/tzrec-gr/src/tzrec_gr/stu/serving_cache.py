"""The serving cache: a batch of users' encoded histories, kept between requests.

Legend: B = users, E = embedding width, C = contextual prefix length, H = heads, A / V =
key / value width per head, n_b = cached tokens of user b.

Like :class:`~tzrec_gr.stu.KVCache` beside it, a :class:`ServingCache` is a value: the
serving functions (:mod:`tzrec_gr.serving`) take one and return a new one, and never change it
in place.
Keeping an old cache (to score several candidate sets against one history), rolling forward
to the new one, or dropping it is the caller's choice.

It is a pytree (:mod:`torch.utils._pytree`) whose leaves are its tensors, so the servers'
pure steps (``score_step``, ``extend_step``...) take and return it whole,
``torch.export`` records them with the cache as one argument, and ``tree_map`` moves or casts
it. Its two ints are not part of the tree: a cache rebuilt from its leaves (by ``torch.export``,
``tree_map`` or the constructor) has ``max_len = None`` (the model's ``max_cached_len`` bounds
it) and ``owner = None`` (any model of the same shape takes it), so neither is baked into an
exported program's input spec.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Iterator, Optional, Tuple

import torch
import torch.utils._pytree as pytree

from tzrec_gr.stu.kv_cache import KVCache
from tzrec_ops.jagged import host_copy, remember_host_copy

__all__ = ["ServingCache", "constant_lengths", "longest", "new_owner_id"]

_owner_ids: Iterator[int] = itertools.count()


def new_owner_id() -> int:
    """A number no other transducer of this process has (identifies a cache's builder)."""
    return next(_owner_ids)


def constant_lengths(value: int, batch: int, device: torch.device) -> torch.Tensor:
    """[B] int64 ``value`` on ``device``, with its host copy known (no read to check it)."""
    # filled on the device (no host-to-device copy, so a CUDA graph can capture it)
    values = torch.full((batch,), value, dtype=torch.int64, device=device)
    return remember_host_copy(values, torch.full((batch,), value, dtype=torch.int64))


def _max(values: torch.Tensor) -> int:
    return int(values.max()) if values.numel() else 0


def longest(lengths: torch.Tensor) -> int:
    """The largest entry of ``lengths`` [B], from its host copy (no read when it is known)."""
    return host_copy(lengths).stat("max", _max)


@dataclasses.dataclass(frozen=True)
class ServingCache:
    """What a server's ``prefill`` returns and its ``score`` / ``extend`` (and their steps)
    take (:class:`~tzrec_gr.serving.RankingServer`, :class:`~tzrec_gr.serving.RetrievalServer`).

    A cache holds keys and values computed with the weights at the time it was built:
    build it again after the weights change.

    Attributes:
        keys (Tuple[torch.Tensor, ...]): each STU layer's cached keys [sum_b n_b, H * A].
        values (Tuple[torch.Tensor, ...]): each STU layer's cached values [sum_b n_b, H * V].
        offsets (torch.Tensor): [B + 1] int64 offsets of the cached tokens (every layer's).
        lengths (torch.Tensor): [B] int64 cached tokens per user (C prefix tokens included).
        query_time (torch.Tensor | None): [B] the time anchor of the cached tokens' time
            encoding (None without time encoding). Default: None.
        contextual (torch.Tensor | None): [B, C * Fc] the users' contextual features, which
            the encoders of new tokens read (None without a contextual prefix). Default: None.
        user_embeddings (torch.Tensor | None): [B, E] retrieval only: the user embedding
            after each user's newest event (zeros for an empty history). Default: None.
        max_len (int | None): an upper bound on ``lengths`` (attention pads to it); None:
            the model's ``max_cached_len``. Not a pytree leaf. Default: None.
        owner (int | None): identifies the transducer that built the cache, which then
            refuses it in any other model; None: not checked. Not a pytree leaf.
            Default: None.

    Raises:
        ValueError: ``offsets`` is not [B + 1] for ``lengths`` [B] (in a trace this compare
            also records that both B are one size: as two symbols, sizes derived from both
            would not simplify).
    """

    keys: Tuple[torch.Tensor, ...]
    values: Tuple[torch.Tensor, ...]
    offsets: torch.Tensor
    lengths: torch.Tensor
    query_time: Optional[torch.Tensor] = None
    contextual: Optional[torch.Tensor] = None
    user_embeddings: Optional[torch.Tensor] = None
    max_len: Optional[int] = None
    owner: Optional[int] = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "keys", tuple(self.keys))
        object.__setattr__(self, "values", tuple(self.values))
        batch = self.lengths.shape[0]
        if self.offsets.dim() != 1 or self.offsets.shape[0] != batch + 1:
            raise ValueError(
                f"offsets must be [B + 1] = [{batch + 1}] for lengths [B], got "
                f"shape {tuple(self.offsets.shape)}"
            )

    @property
    def batch_size(self) -> int:
        """B, the number of users."""
        return self.lengths.shape[0]

    def kv_caches(self, max_len: int) -> Tuple[KVCache, ...]:
        """Each STU layer's :class:`~tzrec_gr.stu.KVCache`, ``max_len`` bounding ``lengths``."""
        return tuple(KVCache(k, v, self.offsets, max_len) for k, v in zip(self.keys, self.values))


# serialized_type_name is the cache's stable name in exported programs' input specs (not its
# module path): renaming it breaks every exported package
_LEAVES = ["keys", "values", "offsets", "lengths", "query_time", "contextual", "user_embeddings"]
pytree.register_dataclass(
    ServingCache,
    field_names=_LEAVES,
    drop_field_names=["max_len", "owner"],
    serialized_type_name="tzrec_gr.serving.ServingCache",
)
