"""CUDA graphs of a ranking server's ``score_step`` (:class:`ScoringServer`, which
:class:`~tzrec_gr.serving.RankingServer` is), one per padded bucket of request shapes.

Legend: B = users, n_b = cached tokens of user b, T = candidates per user, K = tasks; a bucket
(Bb, Lb, Tb) holds up to Bb users of at most Lb cached tokens and Tb candidates each.

Each bucket owns static inputs (:func:`static_cache`, built from the model's own sizes):

* the cache in a padded layout: user b's keys and values in rows ``[b * Lb, b * Lb + n_b)``
  and zeros after them, with offsets ``b * Lb`` (constant) and the real ``lengths``. The
  zero rows change no output: HSTU attention weighs each value row by ``silu(q . k)``
  (no softmax), and a zero value row adds exactly 0, at any key; the positions of the
  candidates come from ``lengths``, and the attention divisor is the model's constant;
* the candidates, Tb per user (the real ones first, then item 0): candidates attend to
  the history and to themselves only, so the filler changes no real candidate's output;
* padding users (b >= B) copy user 0's lengths and features and are dropped after.

A call copies the request into the buffers (the cache only when it is not the one already
there: scoring new candidates for the same users copies only the candidates), replays the
graph and gathers the real candidates' logits.
"""

from __future__ import annotations

import dataclasses
import itertools
import weakref
from typing import Any, Dict, List, Optional, Protocol, Sequence, Tuple

import torch

from tzrec_gr.features import CANDIDATE_ITEM_ID, CANDIDATE_LENGTHS, CANDIDATE_TIMESTAMPS
from tzrec_gr.serving._graphs import Bucket, Entry, GraphPool, GraphSet, fit_sizes, product
from tzrec_gr.serving._host import joined_rows
from tzrec_gr.stu import ServingCache
from tzrec_ops.jagged import host_copy, remember_host_copy

__all__ = [
    "PaddedEntry",
    "ScoreGraphs",
    "ScoringServer",
    "fill_lengths",
    "load_padded_cache",
    "padded_entry_fields",
    "static_cache",
    "windowed_layer",
]


class ScoringServer(Protocol):
    """What the graphs use of the server that builds them (its module imports this one, so
    the graphs name what they need instead of the server's class)."""

    @property
    def model(self) -> Any:
        """The model: its STU layers (``transducer.stu.stu_layers``) and ``max_cached_len``."""

    @property
    def owner_id(self) -> int: ...

    @property
    def time_encoded(self) -> bool: ...

    @property
    def dtype(self) -> torch.dtype: ...

    @property
    def contextual_width(self) -> int: ...

    def score_step(
        self,
        cache: ServingCache,
        candidates: Dict[str, torch.Tensor],
        max_candidates: Optional[int] = None,
    ) -> torch.Tensor:
        """[L_t, K] logits of the candidates against the cache, as a pure function."""


def static_cache(
    server: ScoringServer, batch: int, length: int, device: torch.device
) -> Tuple[ServingCache, torch.Tensor]:
    """A zeroed cache of ``batch`` users in the padded layout of ``length`` rows each, with
    the dtypes and widths of what the server's ``prefill`` builds (no request needed).

    Args:
        server (ScoringServer): the model's server.
        batch (int): Bb, users.
        length (int): Lb, rows per user.
        device (torch.device): where the buffers live.

    Returns:
        (ServingCache, torch.Tensor): the cache (offsets ``b * Lb``, lengths 0, ``max_len``
        Lb) and its lengths' host copy [Bb] (CPU, zeros).
    """
    rows = batch * length
    keys, values = [], []
    for layer in server.model.transducer.stu.stu_layers:
        dtype = next(layer.parameters()).dtype
        heads = layer.num_heads
        keys.append(torch.zeros(rows, heads * layer.attention_dim, dtype=dtype, device=device))
        values.append(torch.zeros(rows, heads * layer.hidden_dim, dtype=dtype, device=device))
    offsets_host = torch.arange(batch + 1, dtype=torch.int64) * length
    offsets = remember_host_copy(offsets_host.to(device), offsets_host)
    lengths = torch.zeros(batch, dtype=torch.int64, device=device)
    width = server.contextual_width
    dtype = server.dtype
    cache = ServingCache(
        keys=tuple(keys),
        values=tuple(values),
        offsets=offsets,
        lengths=lengths,
        query_time=(
            torch.zeros(batch, dtype=torch.int64, device=device) if server.time_encoded else None
        ),
        contextual=(torch.zeros(batch, width, dtype=dtype, device=device) if width > 0 else None),
        max_len=length,
        owner=server.owner_id,
    )
    return cache, torch.zeros(batch, dtype=torch.int64)


def padded_rows(lengths: List[int], width: int) -> torch.Tensor:
    """The rows ``[b * width, b * width + lengths_b)`` of every user b, in order, CPU int64."""
    parts = [torch.arange(b * width, b * width + n) for b, n in enumerate(lengths) if n > 0]
    return joined_rows(parts) if parts else torch.zeros(0, dtype=torch.int64)


def windowed_layer(model: Any) -> Optional[int]:
    """The first STU layer of ``model`` with a sliding attention window (``max_attn_len``),
    or None: the padded layout moves a window (its zero rows count as tokens), so a model
    with one gets no graphs that read a padded cache."""
    for i, layer in enumerate(model.transducer.stu.stu_layers):
        if getattr(layer, "max_attn_len", 0):
            return i
    return None


@dataclasses.dataclass
class PaddedEntry(Entry):
    """A bucket's entry whose first two dimensions are (Bb, Lb): a :func:`static_cache`."""

    cache: Optional[ServingCache] = None  # the static cache (padded layout)
    lengths_host: Optional[torch.Tensor] = None
    written: Optional[List[int]] = None  # [Bb]: cached rows of each user's slot now
    resident: Optional[weakref.ref] = None  # the cache whose rows the slots hold


def padded_entry_fields(
    server: ScoringServer, bucket: Bucket, device: torch.device
) -> Dict[str, Any]:
    """The fields of a new :class:`PaddedEntry` of ``bucket`` (zeros, no user written)."""
    cache, lengths_host = static_cache(server, bucket[0], bucket[1], device)
    return {
        "bucket": bucket,
        "cache": cache,
        "lengths_host": lengths_host,
        "written": [0] * bucket[0],
        "memory_bytes": sum(t.numel() * t.element_size() for t in cache.keys + cache.values),
    }


def fill_lengths(entry: PaddedEntry, length: int) -> None:
    """Every user of ``entry``'s cache ``length`` tokens long (synthetic inputs for a
    capture; the rows are left as they are)."""
    assert entry.cache is not None
    full = torch.full((entry.bucket[0],), length, dtype=torch.int64)
    entry.cache.lengths.copy_(full.to(entry.cache.lengths.device))
    entry.lengths_host = full
    entry.resident = None


def load_padded_cache(entry: PaddedEntry, cache: ServingCache) -> None:
    """Copy ``cache`` into the entry's padded layout (unless it is there already): the rows
    into their slots, the rows that held a longer user before zeroed; padding users take
    user 0's lengths, query time and contextual features (and no rows)."""
    if entry.resident is not None and entry.resident() is cache:
        return
    bb, lb = entry.bucket[:2]
    batch = cache.batch_size
    lengths = host_copy(cache.lengths).values
    written = lengths.tolist() + [0] * (bb - batch)
    assert entry.written is not None and entry.cache is not None
    static = entry.cache
    pairs = list(zip(cache.keys + cache.values, static.keys + static.values))
    # one multi-tensor kernel each (not two per layer): zero what a longer user left,
    # then copy every user's rows of every layer into its slot
    stale = [
        dst[b * lb + n : b * lb + old]
        for b, (n, old) in enumerate(zip(written, entry.written))
        if old > n
        for _, dst in pairs
    ]
    if stale:
        torch._foreach_zero_(stale)
    rows = written[:batch]
    starts = itertools.accumulate(rows, initial=0)
    torch._foreach_copy_(
        [dst[b * lb : b * lb + n] for b, n in enumerate(rows) for _, dst in pairs],
        [src[a : a + n] for a, n in zip(starts, rows) for src, _ in pairs],
    )
    entry.written = written
    padded = torch.tensor(rows + rows[:1] * (bb - batch), dtype=torch.int64)
    static.lengths.copy_(padded, non_blocking=True)
    entry.lengths_host = padded
    pairs = ((cache.query_time, static.query_time), (cache.contextual, static.contextual))
    for src, dst in pairs:
        if src is not None and dst is not None:
            dst[:batch].copy_(src)
            if bb > batch:
                dst[batch:].copy_(src[:1].expand(bb - batch, *src.shape[1:]))
    entry.resident = weakref.ref(cache)


@dataclasses.dataclass
class _ScoreEntry(PaddedEntry):
    candidates: Optional[torch.Tensor] = None  # [2, >= Bb * Tb]: the ids, then their times
    cand_lengths: Optional[torch.Tensor] = None
    # the last candidates' lengths and their slots (CPU and device)
    slots: Optional[Tuple[Tuple[int, ...], torch.Tensor, torch.Tensor]] = None


class ScoreGraphs(GraphSet):
    """The captured graphs of one ranking server's ``score_step`` (see the module docstring).

    Args:
        server (ScoringServer): the model's server, the model on ``device``.
        device (torch.device): where the buffers live.
        pool (GraphPool): the session's graph memory pool.
        batch_buckets, length_buckets, candidate_buckets: Bb, Lb and Tb values.
        max_graphs (int): the most graphs captured.
    """

    kind = "score"
    fields = ("batch", "cached_len", "candidates")

    def __init__(
        self,
        server: ScoringServer,
        device: torch.device,
        pool: GraphPool,
        batch_buckets: Sequence[int],
        length_buckets: Sequence[int],
        candidate_buckets: Sequence[int],
        max_graphs: int,
    ) -> None:
        super().__init__(pool, max_graphs)
        self.server = server
        self.device = device
        self.batch_buckets = tuple(sorted(batch_buckets))
        self.length_buckets = tuple(sorted(length_buckets))
        self.candidate_buckets = tuple(sorted(candidate_buckets))

    def bucket(self, batch: int, max_cached: int, max_candidates: int) -> Optional[Bucket]:
        """The smallest bucket that holds the request, or None (then the call runs eager)."""
        return self.smallest_bucket(
            (batch, self.batch_buckets),
            (max_cached, self.length_buckets),
            (max(max_candidates, 1), self.candidate_buckets),
        )

    def warm_up_buckets(self, sizes: Dict[str, Any], exclude_seen: bool) -> List[Bucket]:
        return product(
            fit_sizes("batch_sizes", sizes["batch_sizes"], self.batch_buckets),
            fit_sizes("lengths", sizes["lengths"], self.length_buckets),
            fit_sizes("candidates", sizes["candidates"], self.candidate_buckets),
        )

    # -- buffers --------------------------------------------------------------------------

    def new_entry(self, bucket: Bucket) -> _ScoreEntry:
        bb, _, tb = bucket
        device = self.device
        cand_lengths_host = torch.full((bb,), tb, dtype=torch.int64)
        cand_lengths = remember_host_copy(cand_lengths_host.to(device), cand_lengths_host)
        return _ScoreEntry(
            **padded_entry_fields(self.server, bucket, device),
            # each row 16-byte aligned, as its own allocation would be (Triton specializes
            # on a pointer's alignment)
            candidates=torch.zeros(2, bb * tb + bb * tb % 2, dtype=torch.int64, device=device),
            cand_lengths=cand_lengths,
        )

    def fill_synthetic(self, entry: Entry) -> None:
        """Every user with a full bucket of cached tokens (within the model's bound), zero
        keys, values and times, item 0 as every candidate: valid inputs to capture on."""
        assert isinstance(entry, _ScoreEntry)
        fill_lengths(entry, min(entry.bucket[1], self.server.model.max_cached_len))
        entry.slots = None

    def load_cache(self, entry: _ScoreEntry, cache: ServingCache) -> None:
        """Copy ``cache`` into the entry's padded layout (:func:`load_padded_cache`)."""
        load_padded_cache(entry, cache)

    def load_candidates(
        self,
        entry: _ScoreEntry,
        ids: torch.Tensor,
        lengths: torch.Tensor,
        timestamps: torch.Tensor,
        query_time: torch.Tensor,
    ) -> torch.Tensor:
        """Copy the candidates (``ids``, ``lengths`` and ``timestamps`` on the CPU) into the
        entry's slots, in one transfer; returns their slots [L_t] (device). The filler is
        shown at its user's ``query_time`` [B] (CPU; 0 without time encoding)."""
        assert entry.candidates is not None and entry.cache is not None
        bb, _, tb = entry.bucket
        key = tuple(lengths.tolist())
        if entry.slots is not None and entry.slots[0] == key:
            slots_host, slots = entry.slots[1:]
        else:
            slots_host = padded_rows(list(key), tb)
            slots = slots_host.to(entry.candidates.device, non_blocking=True)
            entry.slots = (key, slots_host, slots)
        host = torch.zeros(entry.candidates.shape, dtype=torch.int64)
        if entry.cache.query_time is not None:
            batch = lengths.shape[0]
            times = torch.cat([query_time, query_time[:1].expand(bb - batch)])
            host[1, : bb * tb] = times.repeat_interleave(tb)
        host[0, slots_host] = ids
        host[1, slots_host] = timestamps
        entry.candidates.copy_(host, non_blocking=True)
        return slots

    # -- the step -------------------------------------------------------------------------

    def step(self, entry: Entry) -> torch.Tensor:
        """[Bb * Tb, K] logits of every slot, from the buffers (what is captured)."""
        assert isinstance(entry, _ScoreEntry) and entry.cache is not None
        assert entry.candidates is not None
        bb, _, tb = entry.bucket
        candidates = {
            CANDIDATE_ITEM_ID: entry.candidates[0, : bb * tb],
            CANDIDATE_LENGTHS: entry.cand_lengths,
            CANDIDATE_TIMESTAMPS: entry.candidates[1, : bb * tb],
        }
        return self.server.score_step(entry.cache, candidates, entry.bucket[2])

    def before_capture(self, entry: Entry) -> None:
        # the index tensors' host copies, for the ops' value checks during the capture
        assert isinstance(entry, _ScoreEntry) and entry.cache is not None
        remember_host_copy(entry.cache.lengths, entry.lengths_host)

    def score_request(
        self,
        cache: ServingCache,
        ids: torch.Tensor,
        lengths: torch.Tensor,
        timestamps: torch.Tensor,
        query_time: torch.Tensor,
        strict: bool,
    ) -> Optional[torch.Tensor]:
        """:meth:`score` in the request's bucket; None outside every bucket or when the
        capture failed (counted as an eager call: the caller runs it eager)."""
        bucket = self.bucket(
            cache.batch_size,
            int(host_copy(cache.lengths).values.max()),
            int(lengths.max()) if lengths.numel() else 0,
        )
        return self.replayed(
            bucket, lambda b: self.score(b, cache, ids, lengths, timestamps, query_time, strict)
        )

    @torch.no_grad()
    def score(
        self,
        bucket: Bucket,
        cache: ServingCache,
        ids: torch.Tensor,
        lengths: torch.Tensor,
        timestamps: torch.Tensor,
        query_time: torch.Tensor,
        strict: bool,
    ) -> Optional[torch.Tensor]:
        """[L_t, K] logits of the candidates (``lengths`` [B] and the users' ``query_time``
        [B] on the CPU), replayed in ``bucket``'s graph; None when the capture failed
        (``strict``: raise instead)."""
        entry = self.entry(bucket)
        assert isinstance(entry, _ScoreEntry)
        self.load_cache(entry, cache)
        slots = self.load_candidates(
            entry, ids.cpu(), lengths, timestamps.cpu(), query_time
        )
        if not self.captured(entry, strict):
            return None
        return self.replay(entry).index_select(0, slots)
