"""CUDA graphs of encoding whole histories (``open``, and extended users encoded again), one
per padded bucket of (users, events).

Legend: B = users of the request, n_b = events of user b, N = sum_b n_b, M = the model's
``max_events``; a bucket (Bb, Nb) holds up to Bb users of N <= Nb events in all.

A bucket's buffers hold U = Bb + ceil(Nb / M) users and exactly Nb events, in the jagged
layout the eager encode takes: the request's users first, as they are, then padding users
that take the Nb - N events left over (item 0 at time 0, no action, zero contextual
features, query time 0), at most M each, the rest empty. The users and events are the
same in every replay, so every size the encode derives on the host (token totals, the
interleaved and contextual layouts) is the one captured; only the lengths' values change,
and they live on the device. Users attend to their own tokens only, so the padding users
change no real row: the real users' cached rows are the first rows of every layer's keys
and values, which a call copies out (the next replay overwrites the buffers).

A call copies the request into the buffers in one host-to-device transfer (no read back),
replays the graph and slices the real users' cache, whose offsets and lengths' host copies
come from the request's lengths (the server's ``warm_up_length``: the tokens a user with
n events keeps cached).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional, Sequence

import torch

from tzrec_gr.features import UIH_ACTIONS, UIH_ITEM_ID, UIH_LENGTHS, UIH_TIMESTAMPS
from tzrec_gr.serving._graphs import Bucket, Entry, GraphPool, GraphSet, fit, product
from tzrec_gr.serving._host import copied, lengths_and_offsets
from tzrec_gr.serving.inputs import Histories
from tzrec_gr.stu import ServingCache
from tzrec_ops.jagged import remember_host_copy

__all__ = ["EncodeGraphs", "padded_lengths"]


def padded_lengths(lengths: List[int], users: int, events: int, most: int) -> torch.Tensor:
    """[users] the request's ``lengths`` [B] followed by padding users that take the
    ``events - sum(lengths)`` events left over, at most ``most`` each, then empty ones."""
    full, rest = divmod(events - sum(lengths), most)
    pad = [most] * full + ([rest] if rest else [])
    return torch.tensor(lengths + pad + [0] * (users - len(lengths) - len(pad)), dtype=torch.int64)


@dataclasses.dataclass
class _EncodeEntry(Entry):
    packed: Optional[torch.Tensor] = None  # the int64 inputs, one buffer (one transfer)
    contextual: Optional[torch.Tensor] = None  # [U, C * Fc]
    lengths_host: Optional[torch.Tensor] = None  # the lengths' values in the buffers


class EncodeGraphs(GraphSet):
    """The captured graphs of a server's whole-history encode (see the module docstring).

    Args:
        server (ModelServer): the model's server, the model on ``device``.
        device (torch.device): where the buffers live.
        pool (GraphPool): the session's graph memory pool.
        batch_buckets, event_buckets: Bb and Nb values.
        max_graphs (int): the most graphs captured.
    """

    kind = "encode"
    fields = ("batch", "events")

    def __init__(
        self,
        server: Any,
        device: torch.device,
        pool: GraphPool,
        batch_buckets: Sequence[int],
        event_buckets: Sequence[int],
        max_graphs: int,
    ) -> None:
        super().__init__(pool, max_graphs)
        self.server = server
        self.device = device
        self.batch_buckets = tuple(sorted(batch_buckets))
        self.event_buckets = tuple(sorted(event_buckets))

    def bucket(self, batch: int, events: int) -> Optional[Bucket]:
        """The smallest bucket that holds ``batch`` users of ``events`` events in all, or
        None (then the encode runs eager)."""
        return self.smallest_bucket((batch, self.batch_buckets), (events, self.event_buckets))

    def warm_up_buckets(self, sizes: Dict[str, Any], exclude_seen: bool) -> List[Bucket]:
        """The buckets of ``B`` users of ``n`` events each, for every ``B`` in
        ``sizes["batch_sizes"]`` and ``n`` in ``sizes["histories"]`` that fit one."""
        out = []
        for batch, n in product(sizes["batch_sizes"], sizes["histories"]):
            fits = (fit(batch, self.batch_buckets), fit(batch * n, self.event_buckets))
            if fits[0] is not None and fits[1] is not None:
                out.append((fits[0], fits[1]))
        return out

    def users(self, bucket: Bucket) -> int:
        """U, the users of ``bucket``'s buffers (its users and the padding users)."""
        bb, nb = bucket
        most = self.server.max_events
        return bb + -(-nb // most)

    # -- buffers --------------------------------------------------------------------------

    def new_entry(self, bucket: Bucket) -> _EncodeEntry:
        _, nb = bucket
        users = self.users(bucket)
        width = self.server.contextual_width
        packed = torch.zeros(3 * nb + 2 * users, dtype=torch.int64, device=self.device)
        contextual = None
        if width > 0:
            contextual = torch.zeros(users, width, dtype=self.server.dtype, device=self.device)
        return _EncodeEntry(
            bucket=bucket,
            packed=packed,
            contextual=contextual,
            lengths_host=torch.zeros(users, dtype=torch.int64),
            memory_bytes=packed.numel() * 8,
        )

    def fill_synthetic(self, entry: Entry) -> None:
        """Every event in padding users (item 0 at time 0), as many as the model takes
        each: what every graph is captured on, so that a size the encode reads from the
        lengths' host copy (the longest user's events) bounds every request's in the
        bucket."""
        assert isinstance(entry, _EncodeEntry)
        none = torch.zeros(0, dtype=torch.int64)
        self._write(entry, [], none, none, None, none, None)

    def load(self, entry: _EncodeEntry, histories: Histories, lengths: List[int]) -> None:
        """Copy checked ``histories`` (of ``lengths``, their host values) into the entry's
        buffers, padded (see the module docstring)."""
        self._write(
            entry,
            lengths,
            histories.item_ids.cpu(),
            histories.timestamps.cpu(),
            None if histories.actions is None else histories.actions.cpu(),
            histories.query_times(),
            histories.contextual,
        )

    def _write(
        self,
        entry: _EncodeEntry,
        lengths: List[int],
        item_ids: torch.Tensor,
        timestamps: torch.Tensor,
        actions: Optional[torch.Tensor],
        query_time: torch.Tensor,
        contextual: Optional[torch.Tensor],
    ) -> None:
        assert entry.packed is not None
        _, nb = entry.bucket
        users = self.users(entry.bucket)
        batch, total = len(lengths), item_ids.shape[0]
        padded = padded_lengths(lengths, users, nb, self.server.max_events)
        host = torch.zeros(3 * nb + 2 * users, dtype=torch.int64)
        host[:total] = item_ids
        host[nb : nb + total] = timestamps
        if actions is not None:
            host[2 * nb : 2 * nb + total] = actions
        host[3 * nb : 3 * nb + users] = padded
        host[3 * nb + users : 3 * nb + users + batch] = query_time
        entry.packed.copy_(host, non_blocking=True)
        entry.lengths_host = padded
        if entry.contextual is not None:
            entry.contextual.zero_()
            if contextual is not None and batch:
                entry.contextual[:batch].copy_(
                    contextual.to(entry.contextual.dtype), non_blocking=True
                )

    # -- the step -------------------------------------------------------------------------

    def step(self, entry: Entry) -> ServingCache:
        """The cache of every user of the buffers (what is captured)."""
        assert isinstance(entry, _EncodeEntry) and entry.packed is not None
        _, nb = entry.bucket
        users = self.users(entry.bucket)
        p = entry.packed
        lengths = p[3 * nb : 3 * nb + users]
        # the host copy of the lengths in the buffers when captured; a replay reads nothing
        # on the host, and every size taken from it depends on the bucket alone
        remember_host_copy(lengths, entry.lengths_host)
        features = {UIH_ITEM_ID: p[:nb], UIH_LENGTHS: lengths, UIH_TIMESTAMPS: p[nb : 2 * nb]}
        if self.server.needs_actions:
            features[UIH_ACTIONS] = p[2 * nb : 3 * nb]
        query_time = p[3 * nb + users :]
        return self.server.encode(features, entry.contextual, query_time)

    def result(self, cache: ServingCache, lengths: List[int]) -> ServingCache:
        """The first ``B`` users' cache out of the buffers' (copied), for ``lengths`` [B]
        events; their lengths and offsets built on the host (one transfer)."""
        batch = len(lengths)
        tokens = [self.server.warm_up_length(n) for n in lengths]
        rows = sum(tokens)
        cached_lengths, offsets = lengths_and_offsets(tokens, self.device)

        def head(t: Optional[torch.Tensor], n: int) -> Optional[torch.Tensor]:
            return None if t is None else t[:n].clone()

        layers = len(cache.keys)
        rows_of = copied([t[:rows] for t in cache.keys + cache.values])
        return dataclasses.replace(
            cache,
            keys=tuple(rows_of[:layers]),
            values=tuple(rows_of[layers:]),
            offsets=offsets,
            lengths=cached_lengths,
            query_time=head(cache.query_time, batch),
            contextual=head(cache.contextual, batch),
            user_embeddings=head(cache.user_embeddings, batch),
            max_len=max(tokens, default=0),
        )

    def encode_request(self, histories: Histories, strict: bool) -> Optional[ServingCache]:
        """:meth:`encode` in the request's bucket; None outside every bucket or when the
        capture failed (counted as an eager call: the caller runs it eager)."""
        bucket = self.bucket(histories.batch_size, histories.item_ids.shape[0])
        return self.replayed(bucket, lambda b: self.encode(b, histories, strict))

    @torch.no_grad()
    def encode(self, bucket: Bucket, histories: Histories, strict: bool) -> Optional[ServingCache]:
        """The cache of checked ``histories`` replayed in ``bucket``'s graph; None when the
        capture failed (``strict``: raise instead)."""
        entry = self.entry(bucket)
        assert isinstance(entry, _EncodeEntry)
        if entry.graph is None:  # captured on the synthetic inputs (see fill_synthetic)
            self.fill_synthetic(entry)
            if not self.captured(entry, strict):
                return None
        lengths = histories.lengths.tolist()
        self.load(entry, histories, lengths)
        self.replay(entry)
        return self.result(entry.out, lengths)
