"""CUDA graphs of retrieval's ``recommend`` for opened users: the stored user embeddings'
exact top-K over the catalogue (:func:`~tzrec_gr.serving.topk.scan_topk`), one graph per
padded bucket of request shapes.

Legend: B = users, E = embedding width, I = catalogue items, s_b = items user b has seen;
a bucket (Bb, k, Sb) holds up to Bb users asking for exactly k items, each with at most Sb
seen items to exclude (Sb = 0: nothing excluded, ``exclude_seen=False``).

Each bucket owns static inputs, built from the model's own sizes:

* the users' embeddings [Bb, E] (model dtype): rows b >= B are zeros, and their results
  are dropped;
* the seen items [Bb * Sb] int64 with the constant user of each slot (``b`` for slots
  ``[b * Sb, (b + 1) * Sb)``): user b's s_b items first, then the id I, which lies outside
  every chunk of the catalogue and so excludes nothing.

Every user's row of the scan depends on that user's embedding and exclusions only, and the
scan computes its scores for the users padded to a power of two (eager too), so the padded
scan gives the real users the same ids and scores as the eager call: the user buckets are
the powers of two up to the largest of ``batch_buckets`` (then that largest), where a
request and its bucket round up to the same power. A call copies the request into the
buffers, replays the graph and returns copies of the first B rows.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch

from tzrec_gr.serving._graphs import (
    Bucket,
    Entry,
    GraphPool,
    GraphSet,
    fit,
    fit_sizes,
    powers_of_two_up_to,
    product,
)
from tzrec_gr.serving.topk import TopK, scan_topk
from tzrec_ops.jagged import offsets_from_lengths

__all__ = ["RecommendGraphs"]


@dataclasses.dataclass
class _RecommendEntry(Entry):
    users: Optional[torch.Tensor] = None  # [Bb, E]
    seen: Optional[torch.Tensor] = None  # [Bb * Sb] int64 (None for Sb = 0)
    seen_user: Optional[torch.Tensor] = None  # [Bb * Sb] int64, constant


class RecommendGraphs(GraphSet):
    """The captured graphs of one retrieval model's top-K scan (see the module docstring).

    Args:
        items (Callable[[], torch.Tensor]): the session's [I, E] catalogue; it must return
            the same tensor every time (a graph reads the tensor it was captured with).
        num_items (int): I.
        dim (int): E.
        dtype (torch.dtype): the user embeddings' dtype.
        device (torch.device): where the buffers live.
        pool (GraphPool): the session's graph memory pool.
        batch_buckets: the session's user buckets; this set uses the powers of two up to
            the largest (then the largest).
        seen_buckets: Sb values.
        chunk_size (int): items scored at a time.
        max_graphs (int): the most graphs captured.
    """

    kind = "recommend"
    fields = ("batch", "k", "seen")

    def __init__(
        self,
        items: Callable[[], torch.Tensor],
        num_items: int,
        dim: int,
        dtype: torch.dtype,
        device: torch.device,
        pool: GraphPool,
        batch_buckets: Sequence[int],
        seen_buckets: Sequence[int],
        chunk_size: int,
        max_graphs: int,
    ) -> None:
        super().__init__(pool, max_graphs)
        self.items = items
        self.num_items = num_items
        self.dim = dim
        self.dtype = dtype
        self.device = device
        # powers of two (then the largest): the scan pads its product to a power of two of
        # users, so a request and its bucket then run the same product (same bits)
        self.batch_buckets = powers_of_two_up_to(max(batch_buckets))
        self.seen_buckets = tuple(sorted(seen_buckets))
        self.chunk_size = chunk_size

    def valid_k(self, k: object) -> bool:
        return isinstance(k, int) and not isinstance(k, bool) and 1 <= k <= self.num_items

    def bucket(self, batch: int, k: int, max_seen: Optional[int]) -> Optional[Bucket]:
        """The smallest bucket that holds the request (``max_seen`` None: nothing excluded),
        or None (then the call runs eager)."""
        if not self.valid_k(k):
            return None
        bb = fit(batch, self.batch_buckets)
        sb = 0 if max_seen is None else fit(max(max_seen, 1), self.seen_buckets)
        if bb is None or sb is None:
            return None
        bucket = (bb, k, sb)
        return bucket if self.available(bucket) else None

    def warm_up_buckets(self, sizes: Dict[str, Any], exclude_seen: bool) -> List[Bucket]:
        ks = tuple(sizes["k"] or (10,))
        for i, k in enumerate(ks):
            if not self.valid_k(k):
                raise ValueError(f"k[{i}] = {k} must be an int in [1, num_items={self.num_items}]")
        seen = fit_sizes("lengths", sizes["lengths"], self.seen_buckets) if exclude_seen else (0,)
        batch = fit_sizes("batch_sizes", sizes["batch_sizes"], self.batch_buckets)
        return [(b, k, s) for b, k, s in product(batch, ks, seen)]

    # -- buffers --------------------------------------------------------------------------

    def new_entry(self, bucket: Bucket) -> _RecommendEntry:
        bb, _, sb = bucket
        users = torch.zeros(bb, self.dim, dtype=self.dtype, device=self.device)
        seen = seen_user = None
        if sb > 0:
            seen = torch.full((bb * sb,), self.num_items, dtype=torch.int64, device=self.device)
            seen_user = torch.arange(bb, device=self.device).repeat_interleave(sb)
        return _RecommendEntry(
            bucket=bucket,
            users=users,
            seen=seen,
            seen_user=seen_user,
            memory_bytes=sum(
                t.numel() * t.element_size() for t in (users, seen, seen_user) if t is not None
            ),
        )

    def fill_synthetic(self, entry: Entry) -> None:
        """Zero embeddings and nothing seen: valid inputs to capture on."""
        assert isinstance(entry, _RecommendEntry) and entry.users is not None
        entry.users.zero_()
        if entry.seen is not None:
            entry.seen.fill_(self.num_items)

    def load(
        self, entry: _RecommendEntry, embeddings: torch.Tensor, seen: Optional[List[torch.Tensor]]
    ) -> None:
        """Copy the users' embeddings [B, E] and seen items (CPU, one tensor per user; None
        with Sb = 0) into the entry's buffers, padded."""
        assert entry.users is not None
        bb, _, sb = entry.bucket
        batch = embeddings.shape[0]
        entry.users[:batch].copy_(embeddings)
        entry.users[batch:].zero_()
        if entry.seen is None:
            return
        assert seen is not None and len(seen) == batch
        lengths = torch.tensor([t.numel() for t in seen], dtype=torch.int64)
        offsets = offsets_from_lengths(lengths)
        user = torch.repeat_interleave(torch.arange(batch), lengths)
        slots = user * sb + torch.arange(int(offsets[-1])) - offsets[user]
        padded = torch.full((bb * sb,), self.num_items, dtype=torch.int64)
        if seen:
            padded[slots] = torch.cat(seen).to(torch.int64)
        entry.seen.copy_(padded)

    # -- the step -------------------------------------------------------------------------

    def step(self, entry: Entry) -> TopK:
        """The top-k of every padded user, from the buffers (what is captured)."""
        assert isinstance(entry, _RecommendEntry) and entry.users is not None
        table = self.items()

        def rows(start: int, stop: int) -> torch.Tensor:
            return table[start:stop]

        excluded = None
        if entry.seen is not None:
            assert entry.seen_user is not None
            excluded = (entry.seen_user, entry.seen)
        return scan_topk(
            entry.users, rows, self.num_items, entry.bucket[1], excluded, self.chunk_size
        )

    @torch.no_grad()
    def recommend_request(
        self, embeddings: torch.Tensor, seen: Optional[List[torch.Tensor]], k: int, strict: bool
    ) -> Optional[TopK]:
        """:meth:`recommend` in the request's bucket; None outside every bucket or when
        the capture failed (counted as an eager call: the caller runs it eager), or for a
        bad ``k`` (not counted: the eager call raises)."""
        if not self.valid_k(k):
            return None
        max_seen = None if seen is None else max(t.numel() for t in seen)
        bucket = self.bucket(embeddings.shape[0], k, max_seen)
        return self.replayed(bucket, lambda b: self.recommend(b, embeddings, seen, strict))

    def recommend(
        self,
        bucket: Bucket,
        embeddings: torch.Tensor,
        seen: Optional[List[torch.Tensor]],
        strict: bool,
    ) -> Optional[TopK]:
        """The top-k of the B users (``embeddings`` [B, E], ``seen`` as for :meth:`load`),
        replayed in ``bucket``'s graph; None when the capture failed (``strict``: raise
        instead)."""
        entry = self.entry(bucket)
        assert isinstance(entry, _RecommendEntry)
        self.load(entry, embeddings, seen)
        if not self.captured(entry, strict):
            return None
        out = self.replay(entry)
        batch = embeddings.shape[0]
        return TopK(out.ids[:batch].clone(), out.scores[:batch].clone())
