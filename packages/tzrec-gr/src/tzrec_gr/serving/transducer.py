"""An :class:`~tzrec_gr.HSTUTransducer`'s serving: prefill histories, run new tokens against a
cache. The servers (:mod:`.ranking`, :mod:`.retrieval`) call these; they use the
transducer's public pieces only (``call_bounds``, ``resolve_query_time``, ``encode``, its
``stu``, ``compose_output``, ``postprocess``).

Legend: B = batch, E = embedding width, C = contextual prefix length, N = new tokens of a
serving call, Δ = new tokens per sample after padding.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional, Tuple

import torch

from tzrec_gr.hstu_transducer import HSTUTransducer, TransducerOutput
from tzrec_gr.preprocessors import PreprocessorOutput
from tzrec_gr.stu import KVCache, ServingCache
from tzrec_gr.stu.serving_cache import constant_lengths, longest
from tzrec_ops.jagged import mirror, offsets_from_lengths, row_positions, select_jagged_rows

Features = Dict[str, torch.Tensor]

__all__ = ["cached_forward", "check_cache", "prefill"]


def check_cache(transducer: HSTUTransducer, cache: Optional[ServingCache]) -> None:
    """Serving needs eval mode, and a cache this transducer built (None: no cache; a cache
    without an owner is not checked)."""
    if transducer.training:
        raise RuntimeError(
            "serving runs in eval mode (no dropout, eval-mode interleaving); call .eval() first"
        )
    if cache is not None and cache.owner is not None and cache.owner != transducer.owner_id:
        raise ValueError(
            "cache was built by another model's prefill; a cache is only valid for the "
            "model that built it"
        )


@torch.no_grad()
def prefill(
    transducer: HSTUTransducer,
    features: Features,
    max_uih_len: Optional[int] = None,
    *,
    query_time: Optional[torch.Tensor] = None,
) -> Tuple[TransducerOutput, ServingCache]:
    """Encode histories (no candidates) and cache every token of every layer.

    The output is ``forward(features, max_uih_len, 0, query_time=query_time)``'s.

    Args:
        transducer (HSTUTransducer): in eval mode.
        features (Dict[str, torch.Tensor]): history features with no candidates
            (``candidate.sequence_length`` all 0 for a preprocessor that reads them).
        max_uih_len (int | None): as in ``forward``.
        query_time (torch.Tensor | None): [B] the time anchor (read as in ``forward``);
            required with time encoding, where every cached token's time bucket and
            every later candidate's are measured from it.

    Returns:
        (TransducerOutput, ServingCache).
    """
    check_cache(transducer, None)
    if any(getattr(layer, "scaling_seqlen", 0) == -1 for layer in transducer.stu.stu_layers):
        raise ValueError(
            "serving needs a fixed attention divisor, or cached outputs would differ from "
            "forward's: build the transducer with max_uih_len (or the STU layers with "
            "scaling_seqlen)"
        )
    max_uih_len, _ = transducer.call_bounds(max_uih_len, 0)
    query_time = transducer.resolve_query_time(features, query_time)
    timed = transducer.time_encoded
    if timed and query_time is None:
        raise ValueError(
            "query_time is required to prefill with time encoding: it anchors the time "
            "buckets of every cached token and of the candidates scored later"
        )
    pre, x = transducer.encode(features, max_uih_len, 0, query_time)
    out = transducer.stu(
        x,
        pre.seq_offsets,
        pre.max_seq_len,
        pre.num_targets,
        kv_caching_lengths=pre.seq_lengths,
        max_kv_caching_len=pre.max_seq_len,
        total_kv_caching_len=x.shape[0],
    )
    composed = transducer.compose_output(
        out.x,
        out.x_offsets,
        out.max_seq_len,
        pre.seq_lengths,
        pre.seq_timestamps,
        pre.num_targets,
        pre.total_uih_len,
        pre.total_targets,
    )
    kv_caches = out.kv_caches or []
    key = transducer.input_preprocessor.contextual_feature_key()
    cache = ServingCache(
        keys=tuple(kv.k for kv in kv_caches),
        values=tuple(kv.v for kv in kv_caches),
        offsets=kv_caches[0].offsets,
        lengths=pre.seq_lengths,
        query_time=query_time if timed else None,
        contextual=features[key] if key is not None else None,
        max_len=longest(pre.seq_lengths),
        owner=transducer.owner_id,
    )
    return composed, cache


@torch.no_grad()
def cached_forward(
    transducer: HSTUTransducer,
    features: Features,
    cache: ServingCache,
    max_new: int,
    *,
    targets: bool,
    update_cache: bool = False,
    max_cached_len: Optional[int] = None,
) -> Tuple[torch.Tensor, torch.Tensor, Optional[ServingCache]]:
    """Run only the new tokens of each sample against ``cache``.

    ``features`` hold the new tokens alone, with the keys ``forward`` reads: candidates
    with empty histories (``targets=True``: scored against the cache, never cached) or
    events as history with no candidates (``targets=False``: appended after the cached
    ones). The contextual features come from the cache. Samples may have different
    numbers of new tokens: they are padded to ``max_new`` at the end of each sample,
    where the causal mask hides the padding from them.

    What it equals (same weights, eval mode, up to rounding):

    * ``targets=True``: ``forward(history + candidates, query_time=the cache's)``'s
      candidate embeddings, the history being what ``prefill`` got;
    * ``targets=False``: ``forward(history + events)``'s rows of the new events, and the
      returned cache is ``prefill(history + events)``'s. This holds when a cached token's
      keys and values do not depend on later tokens, and raises NotImplementedError in
      the two modes where they do: a contextual prefix (its C tokens attend to every
      history token, so their outputs, and every later layer's keys and values of them,
      change when history grows) and time encoding (a cached token's position counts back
      from the newest event and its time gap is measured from the query time, so its
      encoded input, and from it its keys and values in every layer, change with each new
      event; see :meth:`HSTUPositionalEncoder.forward_appended
      <tzrec_gr.positional_encoder.HSTUPositionalEncoder.forward_appended>`). There the
      longer history must be prefilled again.

    Args:
        transducer (HSTUTransducer): in eval mode.
        features (Dict[str, torch.Tensor]): the new tokens (see above).
        cache (ServingCache): from :func:`prefill` or an earlier append, same B; its
            ``max_len`` (None: the transducer's ``max_cached_len``) bounds its lengths.
        max_new (int): the most new events or candidates of any sample.
        targets (bool): candidates (True) or appended history events (False).
        update_cache (bool): also return the cache with the new tokens appended; only
            with ``targets=False``. Default: False.
        max_cached_len (int | None): with ``update_cache``, an upper bound on every
            user's cached tokens after the call (the new cache's ``max_len``). None
            takes the largest from the lengths' host copy (no device read when it is
            known); a traced call (``torch.export``) must give it. Default: None.

    Returns:
        (out [N, E] the postprocessed outputs of the new tokens, offsets [B + 1] of them,
        the new cache or None).
    """
    check_cache(transducer, cache)
    preprocessor = transducer.input_preprocessor
    c = preprocessor.contextual_seq_len()
    if targets and update_cache:
        raise ValueError("candidates are never cached: update_cache must be False with them")
    if not targets and c > 0:
        raise NotImplementedError(
            f"appending history to a cache is not exact with a contextual prefix (C = {c}):"
            " the prefix attends to every history token, so its cached keys and values "
            "change when history grows; prefill the longer history instead"
        )
    kv_caches = _layer_caches(transducer, cache)
    features = dict(features)
    key = preprocessor.contextual_feature_key()
    if key is not None and cache.contextual is not None:
        features[key] = cache.contextual
    bounds = (0, max_new) if targets else (max_new, 0)
    pre: PreprocessorOutput = preprocessor(features, *bounds)
    if pre.seq_lengths.shape[0] != cache.batch_size:
        raise ValueError(
            f"the new tokens are for B = {pre.seq_lengths.shape[0]} users but the cache "
            f"holds {cache.batch_size}; they must match"
        )
    x, timestamps, new_lengths, new_offsets = _strip_prefix(pre, c)
    if transducer.positional_encoder is not None:
        x = transducer.positional_encoder.forward_appended(
            x, new_offsets, cache.lengths, timestamps, cache.query_time, targets
        )
    delta = pre.max_seq_len - c
    if delta == 0:
        return x, new_offsets, cache if update_cache else None
    lengths = None
    if update_cache:
        lengths = mirror(torch.add, cache.lengths, new_lengths.to(torch.int64))
        if max_cached_len is None:
            max_cached_len = longest(lengths)
    out, new_caches = _run_cached(
        transducer, x, new_offsets, kv_caches, delta, targets, lengths, max_cached_len
    )
    out = transducer.postprocess(out, timestamps)
    if new_caches is None:
        return out, new_offsets, None
    new_cache = dataclasses.replace(
        cache,
        keys=tuple(kv.k for kv in new_caches),
        values=tuple(kv.v for kv in new_caches),
        offsets=new_caches[0].offsets,
        lengths=lengths,
        max_len=max_cached_len,
    )
    return out, new_offsets, new_cache


def _layer_caches(transducer: HSTUTransducer, cache: ServingCache) -> Tuple[KVCache, ...]:
    """The cache as one :class:`KVCache` per STU layer, bounded by its ``max_len`` (None:
    the transducer's ``max_cached_len``)."""
    layers = len(transducer.stu.stu_layers)
    if len(cache.keys) != layers or len(cache.values) != layers:
        raise ValueError(
            f"keys and values must hold one tensor per STU layer ({layers}), got "
            f"{len(cache.keys)} and {len(cache.values)}"
        )
    bound = transducer.max_cached_len if cache.max_len is None else cache.max_len
    if bound is None:
        raise ValueError(
            "the cache has no max_len and the transducer was built without max_uih_len; "
            "give the cache its max_len"
        )
    return cache.kv_caches(bound)


def _strip_prefix(
    pre: PreprocessorOutput, c: int
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The rows after the C prefix tokens: (embeddings, timestamps, lengths, offsets)."""
    if c == 0:
        return pre.seq_embeddings, pre.seq_timestamps, pre.seq_lengths, pre.seq_offsets
    lengths = mirror(torch.sub, pre.seq_lengths, c)
    offsets = mirror(offsets_from_lengths, lengths)
    total = pre.seq_embeddings.shape[0] - c * lengths.shape[0]
    start = torch.full_like(lengths, c)
    emb, ts = (
        select_jagged_rows(values, pre.seq_offsets, offsets, start, total)
        for values in (pre.seq_embeddings, pre.seq_timestamps)
    )
    return emb, ts, lengths, offsets


def _run_cached(
    transducer: HSTUTransducer,
    x: torch.Tensor,
    new_offsets: torch.Tensor,
    kv_caches: Tuple[KVCache, ...],
    delta: int,
    targets: bool,
    kept: Optional[torch.Tensor],
    max_kept: Optional[int],
) -> Tuple[torch.Tensor, Optional[List[KVCache]]]:
    """The STU stack over ``delta`` rows per sample: the new rows, zero-padded at the end
    of each sample. ``kept`` (None: no cache update) are the cached lengths after the
    call, at most ``max_kept``; the new cache is trimmed back to them."""
    update_cache = kept is not None
    batch, rows = kv_caches[0].offsets.shape[0] - 1, x.shape[0]
    padded = rows != batch * delta
    if padded:
        sample, step = row_positions(new_offsets, rows)
        slots = sample * delta + step
        x = x.new_zeros(batch * delta, x.shape[1]).index_copy(0, slots, x)
    num_targets = None
    if targets:
        num_targets = constant_lengths(delta, batch, x.device)
    out, new_caches = transducer.stu.cached_forward(
        x, kv_caches, num_targets, update_cache=update_cache
    )
    if padded:
        out = out.index_select(0, slots)
        if new_caches is not None and kept is not None and max_kept is not None:
            total = kv_caches[0].k.shape[0] + rows
            new_caches = _drop_padding(new_caches, kept, max_kept, total)
    return out, new_caches


def _drop_padding(
    caches: List[KVCache], kept: torch.Tensor, max_kept: int, total: int
) -> List[KVCache]:
    """Each layer's ``[cache_b ; padded new rows_b]`` cut to its first ``kept[b]`` rows
    (``total`` in all), by one gather index shared by the layers. (A jagged split into
    kept and dropped rows would size a tensor by the dropped padding, which a trace
    with dynamic shapes cannot keep symbolic.)"""
    offsets = mirror(offsets_from_lengths, kept)
    sample, pos = row_positions(offsets, total)
    index = caches[0].offsets.to(torch.int64)[sample] + pos
    return [
        KVCache(c.k.index_select(0, index), c.v.index_select(0, index), offsets, max_kept)
        for c in caches
    ]
