"""HSTU transducer: preprocessor -> positional encoder -> STU stack -> postprocessor.

Legend: B = batch, L = total tokens, E = embedding width, T_b = candidates of sample b,
C = contextual prefix length, N = new tokens of a serving call.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List, NamedTuple, Optional, Tuple

import torch
from torch import nn

from tzrec_gr._backend import BackendArg, resolve_module_backend
from tzrec_gr.positional_encoder import HSTUPositionalEncoder
from tzrec_gr.postprocessors import OutputPostprocessor
from tzrec_gr.preprocessors import InputPreprocessor, PreprocessorOutput
from tzrec_gr.serving import ServingCache, constant_lengths, longest, new_owner_id
from tzrec_gr.stu import KVCache, STUStack
from tzrec_ops import split_2D_jagged
from tzrec_ops.jagged import (
    lengths_from_offsets,
    mirror,
    offsets_from_lengths,
    row_positions,
    select_jagged_rows,
)

Features = Dict[str, torch.Tensor]

__all__ = ["HSTUTransducer", "TransducerOutput"]


class TransducerOutput(NamedTuple):
    """What :meth:`HSTUTransducer.forward` returns.

    Attributes:
        candidate_embeddings: [sum_b T_b, E], one row per candidate (its content token when
            candidates are interleaved).
        full_embeddings: [L', E] every output token (after truncation, if any), when the
            transducer returns full embeddings; else None.
        seq_offsets: [B + 1] offsets of ``full_embeddings`` (also valid when it is None).
    """

    candidate_embeddings: torch.Tensor
    full_embeddings: Optional[torch.Tensor]
    seq_offsets: torch.Tensor


class HSTUTransducer(nn.Module):
    """Encodes a batch of user histories (plus candidates) with an HSTU stack.

    Args:
        input_preprocessor (InputPreprocessor): features -> jagged tokens of width E.
        stu (STUStack): the STU layers (width E).
        positional_encoder (HSTUPositionalEncoder | None): Default: None.
        output_postprocessor (OutputPostprocessor | None): applied to the output rows
            (candidates, or every token with ``return_full_embeddings``). Default: None.
        input_dropout_ratio (float): dropout after positional encoding. Default: 0.0.
        return_full_embeddings (bool): also return every output token. Default: False.
        query_time_key (str): feature key of a [B] request time used as the anchor of
            time encoding ("" : each sample's last timestamp). Default: "".
        backend (str | Backend | None): ops backend for the output split. Default: None.
        max_uih_len (int | None): the longest history (events per sample) the transducer
            takes. With it, every STU layer built with ``scaling_seqlen=-1`` divides
            attention by ``max_seq_len = input_preprocessor.max_output_len(max_uih_len,
            max_targets)``, the longest token sequence of these bounds (C prefix, interleaved
            pairs and candidates included), so a sample's output depends neither on the
            call's bounds nor on the rest of the batch, and the serving methods give what
            ``forward`` gives. The call bounds then default to these and may not exceed them.
            None: the caller passes bounds to every call and the layers keep their scaling.
            Default: None.
        max_targets (int): the most candidates per sample (used with ``max_uih_len``).
            Default: 0.

    Call Args:
        features (Dict[str, torch.Tensor]): see :mod:`tzrec_gr.preprocessors`.
        max_uih_len (int | None): upper bound on history lengths. Default: the
            constructor's (required without it).
        max_targets (int | None): upper bound on candidates per sample. Default: the
            constructor's (0 without it).
        truncated_total_len (int | None): rows left after the stack's truncation (avoids a
            host sync when truncation is on). Default: None.
        truncated_max_seq_len (int | None): upper bound on lengths after truncation.
            Default: None.
        query_time (torch.Tensor | None): [B] anchor of time encoding; None reads the
            ``query_time_key`` feature when that key is set, else each sample's last
            timestamp is used. Keyword only. Default: None.

    Returns:
        TransducerOutput: ``candidate_embeddings [sum T_b, E]``, ``full_embeddings`` or None,
        ``seq_offsets [B + 1]``.

    Serving (eval mode, no gradients): :meth:`prefill` encodes histories and returns a
    :class:`~tzrec_gr.serving.ServingCache`; :meth:`cached_forward` runs only new tokens
    (candidates, or appended events) against it.
    """

    def __init__(
        self,
        input_preprocessor: InputPreprocessor,
        stu: STUStack,
        positional_encoder: Optional[HSTUPositionalEncoder] = None,
        output_postprocessor: Optional[OutputPostprocessor] = None,
        input_dropout_ratio: float = 0.0,
        return_full_embeddings: bool = False,
        query_time_key: str = "",
        backend: BackendArg = None,
        max_uih_len: Optional[int] = None,
        max_targets: int = 0,
    ) -> None:
        super().__init__()
        if input_preprocessor.output_dim != stu.embedding_dim:
            raise ValueError(
                f"input_preprocessor.output_dim ({input_preprocessor.output_dim}) must equal "
                f"the STU embedding_dim ({stu.embedding_dim})"
            )
        if positional_encoder is not None:
            if positional_encoder.embedding_dim != stu.embedding_dim:
                raise ValueError(
                    f"positional_encoder.embedding_dim ({positional_encoder.embedding_dim}) "
                    f"must equal the STU embedding_dim ({stu.embedding_dim})"
                )
            c = input_preprocessor.contextual_seq_len()
            encoder_c = positional_encoder.contextual_seq_len
            if positional_encoder.use_time_encoding and encoder_c != c:
                raise ValueError(
                    f"positional_encoder.contextual_seq_len ({encoder_c})"
                    f" must equal the preprocessor's contextual_seq_len ({c})"
                )
        if not 0.0 <= input_dropout_ratio < 1.0:
            raise ValueError(f"input_dropout_ratio must be in [0, 1), got {input_dropout_ratio}")
        self.input_preprocessor = input_preprocessor
        self.stu = stu
        self.positional_encoder = positional_encoder
        self.output_postprocessor = output_postprocessor
        self.input_dropout = nn.Dropout(input_dropout_ratio)
        self.return_full_embeddings = return_full_embeddings
        self.query_time_key = query_time_key
        self._split_backend = resolve_module_backend(backend, ("split_2D_jagged",))
        self.max_uih_len = max_uih_len
        self.max_targets = max_targets
        self.max_seq_len = self._fix_scaling(max_uih_len, max_targets)
        self._owner = new_owner_id()

    def _fix_scaling(self, max_uih_len: Optional[int], max_targets: int) -> Optional[int]:
        """The constructor bounds' longest token sequence, given to every layer that would
        otherwise divide attention by each call's bound."""
        if not isinstance(max_targets, int) or max_targets < 0:
            raise ValueError(f"max_targets must be an int >= 0, got {max_targets!r}")
        if max_uih_len is None:
            if max_targets:
                raise ValueError(f"max_targets ({max_targets}) needs max_uih_len")
            return None
        if not isinstance(max_uih_len, int) or max_uih_len < 0:
            raise ValueError(f"max_uih_len must be an int >= 0, got {max_uih_len!r}")
        bound = self.input_preprocessor.max_output_len(max_uih_len, max_targets)
        if bound <= 0:
            raise ValueError(f"max_uih_len + max_targets must be > 0, got {bound} tokens")
        for layer in self.stu.stu_layers:
            if getattr(layer, "scaling_seqlen", None) == -1:
                layer.scaling_seqlen = bound
        return bound

    def _call_bounds(
        self, max_uih_len: Optional[int], max_targets: Optional[int]
    ) -> Tuple[int, int]:
        """The call's bounds: the given ones, checked against the constructor's, or those."""
        if self.max_uih_len is None:
            if max_uih_len is None:
                raise ValueError(
                    "max_uih_len is required: this transducer was built without max_uih_len"
                )
            return max_uih_len, max_targets or 0
        uih = self.max_uih_len if max_uih_len is None else max_uih_len
        targets = self.max_targets if max_targets is None else max_targets
        for name, value, limit in (
            ("max_uih_len", uih, self.max_uih_len),
            ("max_targets", targets, self.max_targets),
        ):
            if value > limit:
                raise ValueError(
                    f"{name} ({value}) must be <= the {name} this transducer was built with "
                    f"({limit})"
                )
        return uih, targets

    def _postprocess(self, emb: torch.Tensor, ts: torch.Tensor) -> torch.Tensor:
        if self.output_postprocessor is None:
            return emb
        return self.output_postprocessor(emb, ts)

    def _query_time(
        self, features: Features, query_time: Optional[torch.Tensor]
    ) -> Optional[torch.Tensor]:
        if query_time is not None or not self.query_time_key:
            return query_time
        if self.query_time_key not in features:
            raise KeyError(f"missing feature {self.query_time_key!r} (query_time_key)")
        return features[self.query_time_key]

    def _encode(
        self,
        features: Features,
        max_uih_len: int,
        max_targets: int,
        query_time: Optional[torch.Tensor],
    ) -> Tuple[PreprocessorOutput, torch.Tensor]:
        """Preprocessor, positional encoder and input dropout: (tokens, their embeddings)."""
        pre: PreprocessorOutput = self.input_preprocessor(features, max_uih_len, max_targets)
        x = pre.seq_embeddings
        if self.positional_encoder is not None:
            x = self.positional_encoder(
                pre.max_seq_len,
                pre.seq_lengths,
                pre.seq_offsets,
                pre.seq_timestamps,
                x,
                pre.num_targets,
                query_time,
            )
        return pre, self.input_dropout(x)

    def forward(
        self,
        features: Features,
        max_uih_len: Optional[int] = None,
        max_targets: Optional[int] = None,
        truncated_total_len: Optional[int] = None,
        truncated_max_seq_len: Optional[int] = None,
        *,
        query_time: Optional[torch.Tensor] = None,
    ) -> TransducerOutput:
        max_uih_len, max_targets = self._call_bounds(max_uih_len, max_targets)
        query_time = self._query_time(features, query_time)
        pre, x = self._encode(features, max_uih_len, max_targets, query_time)
        out = self.stu(
            x,
            pre.seq_offsets,
            pre.max_seq_len,
            pre.num_targets,
            truncated_total_len=truncated_total_len,
            truncated_max_seq_len=truncated_max_seq_len,
        )
        lengths, timestamps, total_uih = pre.seq_lengths, pre.seq_timestamps, pre.total_uih_len
        if out.plan is not None:
            lengths = mirror(lengths_from_offsets, out.x_offsets)
            timestamps = self._replay_on_timestamps(pre, out.x_offsets, out.x.shape[0])
            total_uih = out.x.shape[0] - pre.total_targets
        return self._compose(
            out.x,
            out.x_offsets,
            out.max_seq_len,
            lengths,
            timestamps,
            pre.num_targets,
            total_uih,
            pre.total_targets,
        )

    def check_cache(self, cache: Optional[ServingCache]) -> None:
        """Serving needs eval mode, and a cache this transducer built (None: no cache)."""
        if self.training:
            raise RuntimeError(
                "serving runs in eval mode (no dropout, eval-mode interleaving); call .eval() first"
            )
        if cache is not None and cache.owner != self._owner:
            raise ValueError(
                "cache was built by another model's prefill; a cache is only valid for the "
                "model that built it"
            )

    def cache_from_tensors(
        self,
        keys: List[torch.Tensor],
        values: List[torch.Tensor],
        offsets: torch.Tensor,
        lengths: torch.Tensor,
        max_len: int,
        *,
        query_time: Optional[torch.Tensor] = None,
        contextual: Optional[torch.Tensor] = None,
        user_embeddings: Optional[torch.Tensor] = None,
    ) -> ServingCache:
        """A :class:`~tzrec_gr.serving.ServingCache` of this transducer from its tensors
        (``cache.keys``, ``cache.values``, ``cache.offsets``, ``cache.lengths``...): what a
        serving step over plain tensors, such as an exported one, rebuilds.

        Args:
            keys, values (List[torch.Tensor]): each STU layer's cached keys / values.
            offsets (torch.Tensor): [B + 1] int64 offsets of the cached tokens.
            lengths (torch.Tensor): [B] int64 cached tokens per user.
            max_len (int): an upper bound on ``lengths`` (attention pads to it).
            query_time, contextual, user_embeddings: as in ``ServingCache``.
        """
        layers = len(self.stu.stu_layers)
        if len(keys) != layers or len(values) != layers:
            raise ValueError(
                f"keys and values must hold one tensor per STU layer ({layers}), got "
                f"{len(keys)} and {len(values)}"
            )
        # in a trace this compare also records that both B are one size: as two symbols,
        # sizes derived from both (new tokens per user) would not simplify
        if offsets.dim() != 1 or offsets.shape[0] != lengths.shape[0] + 1:
            raise ValueError(
                f"offsets must be [B + 1] = [{lengths.shape[0] + 1}] for lengths [B], got "
                f"shape {tuple(offsets.shape)}"
            )
        kv = tuple(KVCache(k, v, offsets, max_len) for k, v in zip(keys, values))
        return ServingCache(
            kv, lengths, max_len, query_time, contextual, user_embeddings, self._owner
        )

    @torch.no_grad()
    def prefill(
        self,
        features: Features,
        max_uih_len: Optional[int] = None,
        *,
        query_time: Optional[torch.Tensor] = None,
    ) -> Tuple[TransducerOutput, ServingCache]:
        """Encode histories (no candidates) and cache every token of every layer.

        The output is ``forward(features, max_uih_len, 0, query_time=query_time)``'s.

        Args:
            features (Dict[str, torch.Tensor]): history features with no candidates
                (``candidate.sequence_length`` all 0 for a preprocessor that reads them).
            max_uih_len (int | None): as in ``forward``.
            query_time (torch.Tensor | None): [B] the time anchor (read as in ``forward``);
                required with time encoding, where every cached token's time bucket and
                every later candidate's are measured from it.

        Returns:
            (TransducerOutput, ServingCache).
        """
        self.check_cache(None)
        if any(getattr(layer, "scaling_seqlen", 0) == -1 for layer in self.stu.stu_layers):
            raise ValueError(
                "serving needs a fixed attention divisor, or cached outputs would differ from "
                "forward's: build the transducer with max_uih_len (or the STU layers with "
                "scaling_seqlen)"
            )
        max_uih_len, _ = self._call_bounds(max_uih_len, 0)
        query_time = self._query_time(features, query_time)
        timed = self.positional_encoder is not None and self.positional_encoder.use_time_encoding
        if timed and query_time is None:
            raise ValueError(
                "query_time is required to prefill with time encoding: it anchors the time "
                "buckets of every cached token and of the candidates scored later"
            )
        pre, x = self._encode(features, max_uih_len, 0, query_time)
        out = self.stu(
            x,
            pre.seq_offsets,
            pre.max_seq_len,
            pre.num_targets,
            kv_caching_lengths=pre.seq_lengths,
            max_kv_caching_len=pre.max_seq_len,
            total_kv_caching_len=x.shape[0],
        )
        composed = self._compose(
            out.x,
            out.x_offsets,
            out.max_seq_len,
            pre.seq_lengths,
            pre.seq_timestamps,
            pre.num_targets,
            pre.total_uih_len,
            pre.total_targets,
        )
        key = self.input_preprocessor.contextual_feature_key()
        cache = ServingCache(
            kv_caches=tuple(out.kv_caches or ()),
            lengths=pre.seq_lengths,
            max_len=longest(pre.seq_lengths),
            query_time=query_time if timed else None,
            contextual=features[key] if key is not None else None,
            user_embeddings=None,
            owner=self._owner,
        )
        return composed, cache

    @torch.no_grad()
    def cached_forward(
        self,
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
          returned cache is ``prefill(history + events)``'s. Raises NotImplementedError with
          a contextual prefix (the prefix attends to every history token, so its cached keys
          change when history grows) or with time encoding (positions count back from the
          newest event).

        Args:
            features (Dict[str, torch.Tensor]): the new tokens (see above).
            cache (ServingCache): from :meth:`prefill` or an earlier append, same B.
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
        self.check_cache(cache)
        c = self.input_preprocessor.contextual_seq_len()
        if targets and update_cache:
            raise ValueError("candidates are never cached: update_cache must be False with them")
        if not targets and c > 0:
            raise NotImplementedError(
                f"appending history to a cache is not exact with a contextual prefix (C = {c}):"
                " the prefix attends to every history token, so its cached keys and values "
                "change when history grows; prefill the longer history instead"
            )
        features = dict(features)
        key = self.input_preprocessor.contextual_feature_key()
        if key is not None and cache.contextual is not None:
            features[key] = cache.contextual
        bounds = (0, max_new) if targets else (max_new, 0)
        pre: PreprocessorOutput = self.input_preprocessor(features, *bounds)
        if pre.seq_lengths.shape[0] != cache.batch_size:
            raise ValueError(
                f"the new tokens are for B = {pre.seq_lengths.shape[0]} users but the cache "
                f"holds {cache.batch_size}; they must match"
            )
        x, timestamps, new_lengths, new_offsets = self._strip_prefix(pre, c)
        if self.positional_encoder is not None:
            x = self.positional_encoder.forward_appended(
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
        out, kv_caches = self._run_cached(
            x, new_offsets, cache, delta, targets, lengths, max_cached_len
        )
        out = self._postprocess(out, timestamps)
        if kv_caches is None:
            return out, new_offsets, None
        new_cache = dataclasses.replace(
            cache, kv_caches=tuple(kv_caches), lengths=lengths, max_len=max_cached_len
        )
        return out, new_offsets, new_cache

    @staticmethod
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
        self,
        x: torch.Tensor,
        new_offsets: torch.Tensor,
        cache: ServingCache,
        delta: int,
        targets: bool,
        kept: Optional[torch.Tensor],
        max_kept: Optional[int],
    ) -> Tuple[torch.Tensor, Optional[List[KVCache]]]:
        """The STU stack over ``delta`` rows per sample: the new rows, zero-padded at the end
        of each sample. ``kept`` (None: no cache update) are the cached lengths after the
        call, at most ``max_kept``; the new cache is trimmed back to them."""
        update_cache = kept is not None
        batch, rows = cache.batch_size, x.shape[0]
        padded = rows != batch * delta
        if padded:
            sample, step = row_positions(new_offsets, rows)
            slots = sample * delta + step
            x = x.new_zeros(batch * delta, x.shape[1]).index_copy(0, slots, x)
        num_targets = None
        if targets:
            num_targets = constant_lengths(delta, batch, x.device)
        out, kv_caches = self.stu.cached_forward(
            x, cache.kv_caches, num_targets, update_cache=update_cache
        )
        if padded:
            out = out.index_select(0, slots)
            if kv_caches is not None and kept is not None and max_kept is not None:
                total = cache.kv_caches[0].k.shape[0] + rows
                kv_caches = self._drop_padding(kv_caches, kept, max_kept, total)
        return out, kv_caches

    @staticmethod
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

    def _replay_on_timestamps(
        self, pre: PreprocessorOutput, new_offsets: torch.Tensor, total_kept: int
    ) -> torch.Tensor:
        """The truncation applied to the timestamps: rows ``[0, C)`` of each sample are
        kept, then the rows after the ``old_len - new_len`` dropped history rows."""
        c = self.stu.contextual_seq_len
        new_len = lengths_from_offsets(new_offsets)
        dropped = pre.seq_lengths.to(torch.int64) - new_len.to(torch.int64)
        sample, pos = row_positions(new_offsets, total_kept)
        source = pre.seq_offsets[sample] + pos + (pos >= c).to(torch.int64) * dropped[sample]
        return pre.seq_timestamps.index_select(0, source)

    def _compose(
        self,
        encoded: torch.Tensor,
        offsets: torch.Tensor,
        max_seq_len: int,
        lengths: torch.Tensor,
        timestamps: torch.Tensor,
        num_targets: torch.Tensor,
        total_uih: int,
        total_targets: int,
    ) -> TransducerOutput:
        full = None
        if self.return_full_embeddings:
            encoded = self._postprocess(encoded, timestamps)
            full = encoded
        uih_lengths = mirror(torch.sub, lengths, num_targets)
        uih_offsets = mirror(offsets_from_lengths, uih_lengths)
        cand_offsets = mirror(offsets_from_lengths, num_targets)
        _, cand = split_2D_jagged(
            max_seq_len=max_seq_len,
            values=encoded,
            total_len_left=total_uih,
            total_len_right=total_targets,
            offsets_left=uih_offsets,
            offsets_right=cand_offsets,
            backend=self._split_backend,
        )
        cand_ts = select_jagged_rows(timestamps, offsets, cand_offsets, uih_lengths, total_targets)
        if self.input_preprocessor.interleave_targets():
            cand = cand.view(-1, 2, cand.shape[-1])[:, 0]
            cand_ts = cand_ts.view(-1, 2)[:, 0]
        if not self.return_full_embeddings:
            cand = self._postprocess(cand, cand_ts)
        return TransducerOutput(cand, full, offsets)
