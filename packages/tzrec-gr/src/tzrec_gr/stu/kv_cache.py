"""One STU layer's KV cache as a value, and the jagged cuts that build one.

Legend: B = samples, n_b = cached tokens of sample b, Δ = new tokens per sample, H = heads,
A = attention (q/k) dim per head, V = hidden (v/u) dim per head.

A :class:`KVCache` is never changed in place: :func:`prefix_kv_cache` cuts one out of a
forward's keys and values (prefill) and :func:`append_to_kv_cache` returns a new one with Δ
rows per sample appended (decoding). The layer that calls them passes its backend.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from tzrec_ops import concat_2D_jagged, split_2D_jagged
from tzrec_ops.jagged import (
    check_once,
    first_true,
    host_copy,
    mirror,
    offsets_from_lengths,
    tracing,
)
from tzrec_ops.registry import Backend

__all__ = ["KVCache", "append_to_kv_cache", "prefix_kv_cache"]


def _sum(values: torch.Tensor) -> int:
    return int(values.sum())


def _difference(offsets: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """int64 ``offsets - other`` (the offsets of the rows after each sample's first part)."""
    return offsets.to(torch.int64) - other.to(torch.int64)


def _extended_offsets(offsets: torch.Tensor, delta: int) -> torch.Tensor:
    """The offsets after appending ``delta`` rows to every sample."""
    steps = torch.arange(offsets.numel(), device=offsets.device, dtype=torch.int64) * delta
    return offsets.to(torch.int64) + steps


def _check_whole_sequences(
    offsets: torch.Tensor, kv_caching_lengths: torch.Tensor, rows: int
) -> None:
    """Host check, for lengths that sum to every one of the ``rows``: the offsets end at
    ``rows`` and no length exceeds its sequence's (so each is its sequence's length)."""
    if int(offsets[-1]) != rows:
        raise ValueError(f"offsets[-1] ({int(offsets[-1])}) must equal the rows of k ({rows})")
    lengths = offsets[1:] - offsets[:-1]
    exceeds = kv_caching_lengths.to(lengths.dtype) > lengths
    if bool(exceeds.any()):
        b = first_true(exceeds)
        raise ValueError(
            f"kv_caching_lengths[{b}] ({int(kv_caching_lengths[b])}) must be at most "
            f"sequence {b}'s length ({int(lengths[b])})"
        )


@dataclasses.dataclass(frozen=True)
class KVCache:
    """One STU layer's cached keys and values for a jagged batch.

    Attributes:
        k (torch.Tensor): [sum_b n_b, H * A] cached keys.
        v (torch.Tensor): [sum_b n_b, H * V] cached values.
        offsets (torch.Tensor): [B + 1] int64 offsets of the cached tokens.
        max_len (int): an upper bound on the cached lengths n_b.
    """

    k: torch.Tensor
    v: torch.Tensor
    offsets: torch.Tensor
    max_len: int


def prefix_kv_cache(
    k: torch.Tensor,
    v: torch.Tensor,
    offsets: torch.Tensor,
    max_seq_len: int,
    kv_caching_lengths: torch.Tensor,
    max_kv_caching_len: int,
    total_kv_caching_len: Optional[int],
    backend: Backend,
) -> KVCache:
    """Keep the first ``kv_caching_lengths[b]`` rows of k and v of each sample.

    Args:
        k (torch.Tensor): [L, H * A] a forward's keys.
        v (torch.Tensor): [L, H * V] its values.
        offsets (torch.Tensor): [B + 1] offsets of their samples.
        max_seq_len (int): an upper bound on the sample lengths.
        kv_caching_lengths (torch.Tensor): [B] rows kept per sample.
        max_kv_caching_len (int): an upper bound on them; 0 means ``max_seq_len``.
        total_kv_caching_len (int | None): their sum; None takes it from their host copy.
        backend (Backend): the calling layer's ops backend.

    Returns:
        KVCache: the kept rows, with ``max_len = max_kv_caching_len or max_seq_len``.
    """
    batch = offsets.numel() - 1
    if kv_caching_lengths.dim() != 1 or kv_caching_lengths.numel() != batch:
        raise ValueError(
            f"kv_caching_lengths must have shape [B] = [{batch}] (from the offsets), "
            f"got {tuple(kv_caching_lengths.shape)}"
        )
    if total_kv_caching_len is None:
        # from the host copy: none to read when the lengths came with to_device, else
        # one read shared with every later layer and op that sees these lengths (and
        # read before the offsets below are derived, so that they get a copy too)
        total_kv_caching_len = host_copy(kv_caching_lengths).stat("sum", _sum)
    cache_offsets = mirror(offsets_from_lengths, kv_caching_lengths)
    total = k.shape[0]
    max_len = max_kv_caching_len or max_seq_len
    if total_kv_caching_len == total and not tracing():
        # every row is kept (a prefill caches whole sequences): no split to run; traced
        # calls keep the split, whose graph does not guard on two symbolic sizes being equal
        if v.shape[0] != total:
            raise ValueError(f"v has {v.shape[0]} rows but k has {total}; they must match")
        check_once(
            ("tzrec_gr.kv_caching_lengths", "whole", total),
            (offsets, kv_caching_lengths),
            lambda o, n: _check_whole_sequences(o, n, total),
        )
        return KVCache(k.contiguous(), v.contiguous(), cache_offsets, max_len)
    rest_offsets = mirror(_difference, offsets, cache_offsets)
    caches = []
    for t in (k, v):
        kept, _ = split_2D_jagged(
            max_seq_len=max_seq_len,
            values=t,
            total_len_left=total_kv_caching_len,
            total_len_right=total - total_kv_caching_len,
            max_len_left=None,
            max_len_right=None,
            offsets_left=cache_offsets,
            offsets_right=rest_offsets,
            backend=backend,
        )
        caches.append(kept)
    return KVCache(caches[0], caches[1], cache_offsets, max_len)


def append_to_kv_cache(
    kv_cache: KVCache, delta_k: torch.Tensor, delta_v: torch.Tensor, backend: Backend
) -> KVCache:
    """Append Δ new rows per sample to the cache: ``[cache_b ; delta_b]``.

    Args:
        kv_cache (KVCache): the cache, B samples.
        delta_k (torch.Tensor): [B * Δ, H * A].
        delta_v (torch.Tensor): [B * Δ, H * V].
        backend (Backend): the calling layer's ops backend.

    Returns:
        KVCache: over ``n_b + Δ`` tokens per sample, with ``max_len + Δ``.
    """
    batch = kv_cache.offsets.numel() - 1
    delta = delta_k.shape[0] // batch
    full = [
        concat_2D_jagged(
            values_left=cached,
            values_right=new,
            max_len_left=kv_cache.max_len,
            max_len_right=delta,
            offsets_left=kv_cache.offsets,
            offsets_right=None,
            backend=backend,
        )
        for cached, new in ((kv_cache.k, delta_k), (kv_cache.v, delta_v))
    ]
    offsets = mirror(_extended_offsets, kv_cache.offsets, delta)
    return KVCache(full[0], full[1], offsets, kv_cache.max_len + delta)
