"""CUDA graphs of a ranking model's ``score_step``, one per padded bucket of request shapes.

Legend: B = users, n_b = cached tokens of user b, T = candidates per user, K = tasks; a bucket
(Bb, Lb, Tb) holds up to Bb users of at most Lb cached tokens and Tb candidates each.

A graph replays fixed kernels on fixed buffers, so each bucket owns static inputs:

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
graph and gathers the real candidates' logits. Graphs are captured lazily, on the first
request in their bucket, into one memory pool shared by every bucket (graphs replay one at
a time on one stream, so they can share their scratch memory).
"""

from __future__ import annotations

import dataclasses
import time
import weakref
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from tzrec_gr.features import CANDIDATE_ITEM_ID, CANDIDATE_LENGTHS, CANDIDATE_TIMESTAMPS
from tzrec_gr.serving.cache import ServingCache
from tzrec_ops.jagged import host_copy, offsets_from_lengths, remember_host_copy

Bucket = Tuple[int, int, int]


def powers_of_two_up_to(bound: int, start: int = 1) -> Tuple[int, ...]:
    """``start, 2 * start, ...`` below ``bound``, then ``bound``."""
    out: List[int] = []
    value = start
    while value < bound:
        out.append(value)
        value *= 2
    out.append(bound)
    return tuple(out)


def _fit(value: int, buckets: Sequence[int]) -> Optional[int]:
    for b in buckets:
        if value <= b:
            return b
    return None


@dataclasses.dataclass
class _Entry:
    bucket: Bucket
    cache: ServingCache  # the static cache (padded layout)
    lengths_host: torch.Tensor
    cand_ids: torch.Tensor
    cand_ts: torch.Tensor
    cand_lengths: torch.Tensor
    graph: Optional[Any] = None
    out: Optional[torch.Tensor] = None
    resident: Optional[weakref.ref] = None
    slots: Optional[Tuple[Tuple[int, ...], torch.Tensor]] = None  # the last candidates' slots
    capture_ms: float = 0.0
    memory_bytes: int = 0
    replays: int = 0


class ScoreGraphs:
    """The captured graphs of one model's ``score_step`` (see the module docstring)."""

    def __init__(
        self,
        model: torch.nn.Module,
        batch_buckets: Sequence[int],
        length_buckets: Sequence[int],
        candidate_buckets: Sequence[int],
        max_graphs: int,
    ) -> None:
        self.model = model
        self.batch_buckets = tuple(sorted(batch_buckets))
        self.length_buckets = tuple(sorted(length_buckets))
        self.candidate_buckets = tuple(sorted(candidate_buckets))
        self.max_graphs = max_graphs
        self.entries: Dict[Bucket, _Entry] = {}
        self.failed: Dict[Bucket, str] = {}
        self.pool: Optional[Any] = None
        self.captures = 0
        self.replays = 0
        self.eager_calls = 0

    def bucket(self, batch: int, max_cached: int, max_candidates: int) -> Optional[Bucket]:
        """The smallest bucket that holds the request, or None (then the call runs eager)."""
        fits = (
            _fit(batch, self.batch_buckets),
            _fit(max_cached, self.length_buckets),
            _fit(max(max_candidates, 1), self.candidate_buckets),
        )
        if any(f is None for f in fits):
            return None
        bucket = (fits[0], fits[1], fits[2])
        if bucket in self.failed:
            return None
        if bucket not in self.entries and len(self.entries) >= self.max_graphs:
            return None
        return bucket  # type: ignore[return-value]

    # -- buffers --------------------------------------------------------------------------

    def _new_entry(self, bucket: Bucket, like: ServingCache) -> _Entry:
        bb, lb, tb = bucket
        device = like.offsets.device
        rows = bb * lb
        keys = tuple(k.new_zeros(rows, k.shape[1]) for k in like.keys)
        values = tuple(v.new_zeros(rows, v.shape[1]) for v in like.values)
        offsets_host = torch.arange(bb + 1, dtype=torch.int64) * lb
        offsets = remember_host_copy(offsets_host.to(device), offsets_host)
        lengths = torch.zeros(bb, dtype=torch.int64, device=device)
        query_time = None
        if like.query_time is not None:
            query_time = like.query_time.new_zeros(bb)
        contextual = None
        if like.contextual is not None:
            contextual = like.contextual.new_zeros(bb, like.contextual.shape[1])
        cache = ServingCache(
            keys=keys,
            values=values,
            offsets=offsets,
            lengths=lengths,
            query_time=query_time,
            contextual=contextual,
            max_len=lb,
            owner=like.owner,
        )
        cand_lengths_host = torch.full((bb,), tb, dtype=torch.int64)
        cand_lengths = remember_host_copy(cand_lengths_host.to(device), cand_lengths_host)
        ids = torch.zeros(bb * tb, dtype=torch.int64, device=device)
        return _Entry(
            bucket=bucket,
            cache=cache,
            lengths_host=torch.zeros(bb, dtype=torch.int64),
            cand_ids=ids,
            cand_ts=torch.zeros_like(ids),
            cand_lengths=cand_lengths,
            memory_bytes=sum(t.numel() * t.element_size() for t in keys + values),
        )

    def _load_cache(self, entry: _Entry, cache: ServingCache) -> None:
        """Copy ``cache`` into the entry's padded layout (unless it is there already)."""
        if entry.resident is not None and entry.resident() is cache:
            return
        bb, lb, _ = entry.bucket
        batch = cache.batch_size
        device = cache.offsets.device
        lengths = host_copy(cache.lengths).values
        offsets = offsets_from_lengths(lengths)
        user = torch.repeat_interleave(torch.arange(batch), lengths)
        dest = (user * lb + torch.arange(int(offsets[-1])) - offsets[user]).to(device)
        static = entry.cache
        for src, dst in zip(cache.keys + cache.values, static.keys + static.values):
            dst.zero_()
            dst.index_copy_(0, dest, src.to(dst.dtype))
        pad = bb - batch
        padded = torch.cat([lengths, lengths[:1].expand(pad)])
        static.lengths.copy_(padded.to(device))
        entry.lengths_host = padded
        pairs = ((cache.query_time, static.query_time), (cache.contextual, static.contextual))
        for src, dst in pairs:
            if src is not None and dst is not None:
                dst[:batch].copy_(src)
                dst[batch:].copy_(src[:1].expand(pad, *src.shape[1:]))
        entry.resident = weakref.ref(cache)

    def _load_candidates(
        self, entry: _Entry, ids: torch.Tensor, lengths: torch.Tensor, timestamps: torch.Tensor
    ) -> torch.Tensor:
        """Copy the candidates into the entry's slots; returns their slots [L_t] (device)."""
        _, _, tb = entry.bucket
        key = tuple(lengths.tolist())
        if entry.slots is not None and entry.slots[0] == key:
            slots = entry.slots[1]
        else:
            offsets = offsets_from_lengths(lengths)
            user = torch.repeat_interleave(torch.arange(lengths.shape[0]), lengths)
            slots = (user * tb + torch.arange(int(offsets[-1])) - offsets[user]).to(ids.device)
            entry.slots = (key, slots)
        entry.cand_ids.zero_()
        entry.cand_ids.index_copy_(0, slots, ids)
        # the filler is shown at its user's query time (or 0 without time encoding)
        qt = entry.cache.query_time
        if qt is not None:
            entry.cand_ts.copy_(qt.to(entry.cand_ts.dtype).repeat_interleave(tb))
        else:
            entry.cand_ts.zero_()
        entry.cand_ts.index_copy_(0, slots, timestamps.to(entry.cand_ts.dtype))
        return slots

    # -- capture and replay ---------------------------------------------------------------

    def _step(self, entry: _Entry) -> torch.Tensor:
        from tzrec_gr.serving.ranking import score_step

        candidates = {
            CANDIDATE_ITEM_ID: entry.cand_ids,
            CANDIDATE_LENGTHS: entry.cand_lengths,
            CANDIDATE_TIMESTAMPS: entry.cand_ts,
        }
        return score_step(self.model, entry.cache, candidates, entry.bucket[2])

    def _capture(self, entry: _Entry) -> None:
        # the index tensors' host copies, for the ops' value checks during the capture
        remember_host_copy(entry.cache.lengths, entry.lengths_host)
        torch.cuda.synchronize()
        reserved = torch.cuda.memory_reserved()
        started = time.perf_counter()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):  # autotuning and lazy allocations, outside the capture
                self._step(entry)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = self._step(entry)
        torch.cuda.synchronize()
        entry.graph, entry.out = graph, out
        entry.capture_ms = (time.perf_counter() - started) * 1e3
        entry.memory_bytes += max(torch.cuda.memory_reserved() - reserved, 0)
        self.captures += 1

    @torch.no_grad()
    def score(
        self,
        bucket: Bucket,
        cache: ServingCache,
        ids: torch.Tensor,
        lengths: torch.Tensor,
        timestamps: torch.Tensor,
        strict: bool,
    ) -> Optional[torch.Tensor]:
        """[L_t, K] logits of the candidates (``lengths`` [B] on the CPU), replayed in
        ``bucket``'s graph; None when the capture failed (``strict``: raise instead)."""
        entry = self.entries.get(bucket)
        if entry is None:
            entry = self._new_entry(bucket, cache)
        self._load_cache(entry, cache)
        slots = self._load_candidates(entry, ids, lengths, timestamps)
        if entry.graph is None:
            try:
                self._capture(entry)
            except Exception as exc:  # an op that cannot be captured: run eager from now on
                if strict:
                    raise
                self.failed[bucket] = f"{type(exc).__name__}: {exc}"
                return None
            self.entries[bucket] = entry
        entry.graph.replay()
        entry.replays += 1
        self.replays += 1
        assert entry.out is not None
        return entry.out.index_select(0, slots)

    def stats(self) -> Dict[str, Any]:
        return {
            "captures": self.captures,
            "replays": self.replays,
            "eager_calls": self.eager_calls,
            "graphs": [
                {
                    "bucket": {
                        "batch": e.bucket[0],
                        "cached_len": e.bucket[1],
                        "candidates": e.bucket[2],
                    },
                    "capture_ms": e.capture_ms,
                    "memory_bytes": e.memory_bytes,
                    "replays": e.replays,
                }
                for e in self.entries.values()
            ],
            "failed": dict(self.failed),
        }
