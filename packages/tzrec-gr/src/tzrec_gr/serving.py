"""The serving cache: a batch of users' encoded histories, kept between requests.

Legend: B = users, E = embedding width, C = contextual prefix length.

Like :class:`~tzrec_gr.stu.KVCache`, a :class:`ServingCache` is a value: the models' and the
transducer's serving methods take one and return a new one, and never change it in place.
Keeping an old cache (to score several candidate sets against one history), rolling forward
to the new one, or dropping it is the caller's choice.

Its tensors (``keys``, ``values``, ``offsets``, ``lengths``, ``query_time``, ``contextual``,
``user_embeddings``) are what the models' pure serving steps (``score_step``,
``extend_step``...) take and return: functions of plain tensors that ``torch.export``
can record, and that the methods over a cache call.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Iterator, List, Optional, Tuple

import torch

from tzrec_gr.stu import KVCache
from tzrec_ops.jagged import host_copy, remember_host_copy

__all__ = ["ServingCache"]

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
    """What a model's ``prefill`` returns and its ``score`` / ``extend`` take.

    A cache holds keys and values computed with the weights at the time it was built:
    build it again after the weights change.

    Attributes:
        kv_caches (Tuple[KVCache, ...]): one per STU layer, every cached token of each user.
        lengths (torch.Tensor): [B] int64 cached tokens per user (C prefix tokens included).
        max_len (int): the largest entry of ``lengths``.
        query_time (torch.Tensor | None): [B] the time anchor of the cached tokens' time
            encoding (None without time encoding).
        contextual (torch.Tensor | None): [B, C * Fc] the users' contextual features, which
            the encoders of new tokens read (None without a contextual prefix).
        user_embeddings (torch.Tensor | None): [B, E] retrieval only: the user embedding
            after each user's newest event (zeros for an empty history).
        owner (int): identifies the transducer that built the cache.
    """

    kv_caches: Tuple[KVCache, ...]
    lengths: torch.Tensor
    max_len: int
    query_time: Optional[torch.Tensor]
    contextual: Optional[torch.Tensor]
    user_embeddings: Optional[torch.Tensor]
    owner: int

    @property
    def batch_size(self) -> int:
        """B, the number of users."""
        return self.lengths.shape[0]

    @property
    def keys(self) -> List[torch.Tensor]:
        """Each STU layer's cached keys [sum_b lengths[b], H * A]."""
        return [kv.k for kv in self.kv_caches]

    @property
    def values(self) -> List[torch.Tensor]:
        """Each STU layer's cached values [sum_b lengths[b], H * V]."""
        return [kv.v for kv in self.kv_caches]

    @property
    def offsets(self) -> torch.Tensor:
        """[B + 1] int64 offsets of the cached tokens (every layer's)."""
        return self.kv_caches[0].offsets
