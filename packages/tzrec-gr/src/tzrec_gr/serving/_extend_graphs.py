"""CUDA graphs of the incremental ``extend`` (the new events run against the kept keys and
values, for a server that :attr:`~tzrec_gr.serving.server.ModelServer.extends_incrementally`),
one per padded bucket of (users, cached tokens, new events).

Legend: B = users, n_b = cached tokens of user b, e_b = its new events, t = tokens per event
(2 with interleaved actions, else 1); a bucket (Bb, Lb, Eb) holds up to Bb users of at most
Lb cached tokens and Eb new events each.

A bucket's buffers:

* the cache in the score graphs' padded layout (:func:`~._score_graphs.static_cache`):
  user b's keys and values in rows ``[b * Lb, b * Lb + n_b)``, zeros after them, the real
  ``lengths``; padding users (b >= B) take user 0's lengths and no rows;
* the new events, Eb per user: the real ones first, then fillers (item 0 at time 0, no
  action), with the constant lengths Eb, so every size the step derives on the host is the
  bucket's; the real counts e_b live on the device;
* retrieval: the users' embeddings, kept for users without new events.

Why the padding changes no real row: HSTU attention weighs each value row by
``silu(q . k)`` (no softmax) with the model's constant divisor, so a zero key row weighs 0
and a zero value row adds 0; the new events attend to the cache and causally to each other,
so a user's fillers, after its real events, are seen by none of them; the positions of the
new events count on from the cached ``lengths`` (``n_b + i``); users attend to their own
rows only. (A sliding attention window would count the zero rows: such a model gets no
graphs, :func:`~._score_graphs.windowed_layer`.)

The step is the server's ``extend_features`` on the buffers: each user's block of every
layer is ``[Lb cached rows ; Eb * t new rows]``, and (retrieval) the user embedding is the
row of the newest real event, or the kept one. A call copies the request into the buffers
(the cache rows by one multi-tensor copy, the events in one host-to-device transfer),
replays the graph and gathers the real rows (user b's first n_b and its first e_b * t new
ones) out of every layer by one index, which moves to the device with the new lengths and
offsets in one transfer: the jagged cache the eager ``extend_histories`` returns.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional, Protocol, Sequence

import torch

from tzrec_gr.features import UIH_ACTIONS, UIH_ITEM_ID, UIH_LENGTHS, UIH_TIMESTAMPS
from tzrec_gr.serving._graphs import Bucket, Entry, GraphPool, GraphSet, fit, product
from tzrec_gr.serving._host import offsets_of, to_device_together
from tzrec_gr.serving._score_graphs import (
    PaddedEntry,
    fill_lengths,
    load_padded_cache,
    padded_entry_fields,
    padded_rows,
)
from tzrec_gr.serving.inputs import Histories
from tzrec_gr.stu import ServingCache
from tzrec_gr.stu.serving_cache import constant_lengths
from tzrec_ops.jagged import host_copy, remember_host_copy

__all__ = ["ExtendGraphs", "ExtendingServer", "kept_rows"]


class ExtendingServer(Protocol):
    """What the graphs use of the server that extends (besides what
    :func:`~._score_graphs.static_cache` reads: its model, owner, dtype...)."""

    @property
    def model(self) -> Any: ...

    @property
    def max_events(self) -> int: ...

    @property
    def needs_actions(self) -> bool: ...

    @property
    def user_embedding_width(self) -> int:
        """E of the user embeddings its caches keep (0: none)."""

    def warm_up_length(self, events: int) -> int:
        """The tokens a user with ``events`` events keeps cached."""

    def extend_features(
        self,
        cache: ServingCache,
        features: Dict[str, torch.Tensor],
        max_events: int,
        new_lengths: Optional[torch.Tensor] = None,
    ) -> ServingCache:
        """The extended cache, reading nothing on the host (what is captured)."""


def kept_rows(cached: List[int], new: List[int], length: int, block: int) -> List[int]:
    """The rows of every user's extended cache in the step's output, user-major: user b's
    block starts at ``b * block``, its ``cached[b]`` rows first and its ``new[b]`` new
    rows from ``length`` on."""
    rows: List[int] = []
    for b, (n, e) in enumerate(zip(cached, new)):
        start = b * block
        rows += range(start, start + n)
        rows += range(start + length, start + length + e)
    return rows


@dataclasses.dataclass
class _ExtendEntry(PaddedEntry):
    packed: Optional[torch.Tensor] = None  # ids, times, actions, real counts: one transfer
    new_lengths: Optional[torch.Tensor] = None  # [Bb] the constant Eb (host copy known)
    user_embeddings: Optional[torch.Tensor] = None  # [Bb, E] where the caches keep them


class ExtendGraphs(GraphSet):
    """The captured graphs of a server's incremental extend (see the module docstring).

    Args:
        server (ExtendingServer): the model's server, the model on ``device``.
        device (torch.device): where the buffers live.
        pool (GraphPool): the session's graph memory pool.
        batch_buckets, length_buckets, event_buckets: Bb, Lb and Eb values.
        max_graphs (int): the most graphs captured.
    """

    kind = "extend"
    fields = ("batch", "cached_len", "events")

    def __init__(
        self,
        server: ExtendingServer,
        device: torch.device,
        pool: GraphPool,
        batch_buckets: Sequence[int],
        length_buckets: Sequence[int],
        event_buckets: Sequence[int],
        max_graphs: int,
    ) -> None:
        super().__init__(pool, max_graphs)
        self.server = server
        self.device = device
        self.batch_buckets = tuple(sorted(batch_buckets))
        self.length_buckets = tuple(sorted(length_buckets))
        self.event_buckets = tuple(sorted(event_buckets))

    def bucket(self, batch: int, max_cached: int, max_events: int) -> Optional[Bucket]:
        """The smallest bucket that holds ``batch`` users of at most ``max_cached`` cached
        tokens and ``max_events`` new events each, or None (then the extend runs eager)."""
        return self.smallest_bucket(
            (batch, self.batch_buckets),
            (max_cached, self.length_buckets),
            (max(max_events, 1), self.event_buckets),
        )

    def warm_up_buckets(self, sizes: Dict[str, Any], exclude_seen: bool) -> List[Bucket]:
        """The buckets of ``B`` users of ``n`` events each extended by ``Δ`` events, for
        every ``B`` in ``sizes["batch_sizes"]``, ``n`` in ``sizes["histories"]`` and ``Δ``
        in ``sizes["events"]`` with ``n + Δ`` within the model's ``max_events`` that fit
        one."""
        out = []
        bound = self.server.max_events
        for batch, n, delta in product(sizes["batch_sizes"], sizes["histories"], sizes["events"]):
            if n + delta > bound:
                continue
            fits = (
                fit(batch, self.batch_buckets),
                fit(self.server.warm_up_length(n), self.length_buckets),
                fit(delta, self.event_buckets),
            )
            if fits[0] is not None and fits[1] is not None and fits[2] is not None:
                out.append((fits[0], fits[1], fits[2]))
        return out

    def tokens(self, events: int) -> int:
        """The cached tokens that ``events`` new events add to a user."""
        return self.server.warm_up_length(events) - self.server.warm_up_length(0)

    # -- buffers --------------------------------------------------------------------------

    def new_entry(self, bucket: Bucket) -> _ExtendEntry:
        bb, _, eb = bucket
        device = self.device
        segment = bb * eb + bb * eb % 2  # each part 16-byte aligned (see the score graphs)
        packed = torch.zeros(3 * segment + bb + bb % 2, dtype=torch.int64, device=device)
        width = self.server.user_embedding_width
        users = None
        if width > 0:
            users = torch.zeros(bb, width, dtype=self.server.dtype, device=device)
        entry = _ExtendEntry(
            **padded_entry_fields(self.server, bucket, device),
            packed=packed,
            new_lengths=constant_lengths(eb, bb, device),
            user_embeddings=users,
        )
        if entry.cache is not None and users is not None:
            entry.cache = dataclasses.replace(entry.cache, user_embeddings=users)
        entry.memory_bytes += packed.numel() * 8
        return entry

    def fill_synthetic(self, entry: Entry) -> None:
        """Every user with as many cached tokens as the bucket and the model allow, zero
        keys and values, and Eb filler events: valid inputs to capture on."""
        assert isinstance(entry, _ExtendEntry) and entry.packed is not None
        bb, lb, eb = entry.bucket
        room = self.server.model.max_cached_len - self.tokens(eb)
        fill_lengths(entry, max(min(lb, room), 0))
        self._write_events(entry, [eb] * bb, torch.zeros(0, dtype=torch.int64), None, None)

    def load(self, entry: _ExtendEntry, cache: ServingCache, events: Histories,
             new: List[int]) -> None:
        """Copy ``cache`` and its new ``events`` (checked, ``new`` [B] events per user)
        into the entry's buffers, padded (see the module docstring)."""
        load_padded_cache(entry, cache)
        if entry.user_embeddings is not None and cache.user_embeddings is not None:
            entry.user_embeddings[: cache.batch_size].copy_(cache.user_embeddings)
        actions = events.actions if self.server.needs_actions else None
        self._write_events(entry, new, events.item_ids.cpu(), events.timestamps.cpu(),
                           None if actions is None else actions.cpu())

    def _write_events(
        self,
        entry: _ExtendEntry,
        new: List[int],
        item_ids: torch.Tensor,
        timestamps: Optional[torch.Tensor],
        actions: Optional[torch.Tensor],
    ) -> None:
        """The events into their slots (user b's at ``b * Eb``), fillers after them."""
        assert entry.packed is not None
        bb, _, eb = entry.bucket
        segment = bb * eb + bb * eb % 2
        host = torch.zeros(entry.packed.shape, dtype=torch.int64)
        if item_ids.numel():
            slots = padded_rows(new, eb)
            host[slots] = item_ids.to(torch.int64)
            if timestamps is not None:
                host[segment + slots] = timestamps.to(torch.int64)
            if actions is not None:
                host[2 * segment + slots] = actions.to(torch.int64)
        host[3 * segment : 3 * segment + len(new)] = torch.tensor(new, dtype=torch.int64)
        entry.packed.copy_(host, non_blocking=True)

    # -- the step -------------------------------------------------------------------------

    def step(self, entry: Entry) -> ServingCache:
        """The extended cache of every user of the buffers (what is captured)."""
        assert isinstance(entry, _ExtendEntry) and entry.packed is not None
        assert entry.cache is not None
        bb, _, eb = entry.bucket
        segment = bb * eb + bb * eb % 2
        p, n = entry.packed, bb * eb
        features = {
            UIH_ITEM_ID: p[:n],
            UIH_LENGTHS: entry.new_lengths,
            UIH_TIMESTAMPS: p[segment : segment + n],
        }
        if self.server.needs_actions:
            features[UIH_ACTIONS] = p[2 * segment : 2 * segment + n]
        real = p[3 * segment : 3 * segment + bb]
        return self.server.extend_features(entry.cache, features, eb, real)

    def before_capture(self, entry: Entry) -> None:
        # the cached lengths' host copy, for the ops' value checks during the capture
        assert isinstance(entry, _ExtendEntry) and entry.cache is not None
        remember_host_copy(entry.cache.lengths, entry.lengths_host)

    def result(self, out: ServingCache, bucket: Bucket, cached: List[int],
               new: List[int]) -> ServingCache:
        """The real users' extended cache out of the step's ``out`` (copied: the next
        replay overwrites it), for ``cached`` [B] tokens and ``new`` [B] events each."""
        bb, lb, _ = bucket
        batch = len(cached)
        block = out.keys[0].shape[0] // bb
        added = [self.tokens(e) for e in new]
        lengths = [n + a for n, a in zip(cached, added)]
        index, kept, offsets = to_device_together(
            [kept_rows(cached, added, lb, block), lengths, offsets_of(lengths)], self.device
        )
        layers = len(out.keys)
        rows = [t.index_select(0, index) for t in out.keys + out.values]

        def head(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
            return None if t is None else t[:batch].clone()

        return dataclasses.replace(
            out,
            keys=tuple(rows[:layers]),
            values=tuple(rows[layers:]),
            offsets=offsets,
            lengths=kept,
            query_time=head(out.query_time),
            contextual=head(out.contextual),
            user_embeddings=head(out.user_embeddings),
            max_len=max(lengths, default=0),
        )

    def extend_request(
        self, cache: ServingCache, events: Histories, strict: bool
    ) -> Optional[ServingCache]:
        """:meth:`extend` in the request's bucket; None outside every bucket or when the
        capture failed (counted as an eager call: the caller runs it eager)."""
        cached = host_copy(cache.lengths).values.tolist()
        new = events.lengths.tolist()
        bucket = self.bucket(len(cached), max(cached, default=0), max(new, default=0))
        return self.replayed(bucket, lambda b: self.extend(b, cache, events, strict))

    @torch.no_grad()
    def extend(
        self, bucket: Bucket, cache: ServingCache, events: Histories, strict: bool
    ) -> Optional[ServingCache]:
        """``cache`` with checked ``events`` appended, replayed in ``bucket``'s graph; None
        when the capture failed (``strict``: raise instead)."""
        entry = self.entry(bucket)
        assert isinstance(entry, _ExtendEntry)
        if entry.graph is None:  # captured on the synthetic inputs (see fill_synthetic)
            self.fill_synthetic(entry)
            if not self.captured(entry, strict):
                return None
        cached = host_copy(cache.lengths).values.tolist()
        new = events.lengths.tolist()
        self.load(entry, cache, events, new)
        out = self.replay(entry)
        return self.result(out, bucket, cached, new)
