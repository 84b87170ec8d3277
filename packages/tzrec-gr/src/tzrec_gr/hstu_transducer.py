"""HSTU transducer: preprocessor -> positional encoder -> STU stack -> postprocessor.

Legend: B = batch, L = total tokens, E = embedding width, T_b = candidates of sample b,
C = contextual prefix length, N = new tokens of a serving call.
"""

from __future__ import annotations

from typing import Dict, NamedTuple, Optional, Tuple

import torch
from torch import nn

from tzrec_gr._backend import BackendArg, resolve_module_backend
from tzrec_gr.positional_encoder import HSTUPositionalEncoder
from tzrec_gr.postprocessors import OutputPostprocessor
from tzrec_gr.preprocessors import InputPreprocessor, PreprocessorOutput
from tzrec_gr.stu import STUStack
from tzrec_gr.stu.serving_cache import new_owner_id
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
            call's bounds nor on the rest of the batch, and serving (:mod:`tzrec_gr.serving`)
            gives what ``forward`` gives. The call bounds then default to these and may not
            exceed them. None: the caller passes bounds to every call and the layers keep
            their scaling. Default: None.
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

    Serving (:mod:`tzrec_gr.serving.transducer`) runs the steps of ``forward`` one by one
    through the public pieces: :meth:`call_bounds`, :meth:`resolve_query_time`,
    :meth:`encode`, the ``stu`` stack, :meth:`compose_output` and :meth:`postprocess`;
    :attr:`owner_id` marks the caches built from this transducer.
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
        # the most tokens a sample's serving cache holds (None: no bound built in)
        self.max_cached_len = (
            None if max_uih_len is None else input_preprocessor.max_output_len(max_uih_len, 0)
        )
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

    @property
    def owner_id(self) -> int:
        """Identifies this transducer: the ``owner`` of the serving caches built from it."""
        return self._owner

    @property
    def time_encoded(self) -> bool:
        """Whether the positional encoder encodes time (anchored at a query time)."""
        encoder = self.positional_encoder
        return encoder is not None and encoder.use_time_encoding

    def call_bounds(
        self, max_uih_len: Optional[int], max_targets: Optional[int]
    ) -> Tuple[int, int]:
        """A call's ``(max_uih_len, max_targets)``: the given ones, checked against the
        constructor's, or the constructor's where None.

        Raises:
            ValueError: a bound above the constructor's, or no ``max_uih_len`` at all.
        """
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

    def postprocess(self, emb: torch.Tensor, ts: torch.Tensor) -> torch.Tensor:
        """The output postprocessor over rows ``emb`` [N, E] with timestamps ``ts`` [N]
        (``emb`` itself without a postprocessor)."""
        if self.output_postprocessor is None:
            return emb
        return self.output_postprocessor(emb, ts)

    def resolve_query_time(
        self, features: Features, query_time: Optional[torch.Tensor]
    ) -> Optional[torch.Tensor]:
        """The [B] time anchor of a call: ``query_time`` when given, else the
        ``query_time_key`` feature when that key is set, else None (each sample's last
        timestamp).

        Raises:
            KeyError: ``query_time_key`` is set but the feature is missing.
        """
        if query_time is not None or not self.query_time_key:
            return query_time
        if self.query_time_key not in features:
            raise KeyError(f"missing feature {self.query_time_key!r} (query_time_key)")
        return features[self.query_time_key]

    def encode(
        self,
        features: Features,
        max_uih_len: int,
        max_targets: int,
        query_time: Optional[torch.Tensor],
    ) -> Tuple[PreprocessorOutput, torch.Tensor]:
        """Preprocessor, positional encoder and input dropout.

        Returns:
            (PreprocessorOutput, torch.Tensor): the tokens and their encoded embeddings
            [L, E], ready for the STU stack.
        """
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
        max_uih_len, max_targets = self.call_bounds(max_uih_len, max_targets)
        query_time = self.resolve_query_time(features, query_time)
        pre, x = self.encode(features, max_uih_len, max_targets, query_time)
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
        return self.compose_output(
            out.x,
            out.x_offsets,
            out.max_seq_len,
            lengths,
            timestamps,
            pre.num_targets,
            total_uih,
            pre.total_targets,
            target_offsets=pre.target_offsets,
            target_timestamps=pre.target_timestamps,
        )

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

    def compose_output(
        self,
        encoded: torch.Tensor,
        offsets: torch.Tensor,
        max_seq_len: int,
        lengths: torch.Tensor,
        timestamps: torch.Tensor,
        num_targets: torch.Tensor,
        total_uih: int,
        total_targets: int,
        target_offsets: Optional[torch.Tensor] = None,
        target_timestamps: Optional[torch.Tensor] = None,
    ) -> TransducerOutput:
        """The transducer's output from the stack's rows ``encoded`` [L, E]: the
        candidates' rows, postprocessed (every row too with full embeddings).
        ``target_offsets`` (the offsets of ``num_targets``) and
        ``target_timestamps`` (the candidate rows' timestamps): the preprocessor's when it
        gives them, else derived here."""
        full = None
        if self.return_full_embeddings:
            encoded = self.postprocess(encoded, timestamps)
            full = encoded
        if total_targets == 0:
            # no candidate rows (history only): empty slices, no split
            cand, cand_ts = encoded[encoded.shape[0] :], timestamps[timestamps.shape[0] :]
        else:
            if target_offsets is None:
                target_offsets = mirror(offsets_from_lengths, num_targets)
            # offsets of the non-candidate rows: the running sums subtract (int64, exact)
            uih_offsets = mirror(torch.sub, offsets, target_offsets)
            _, cand = split_2D_jagged(
                max_seq_len=max_seq_len,
                values=encoded,
                total_len_left=total_uih,
                total_len_right=total_targets,
                offsets_left=uih_offsets,
                offsets_right=target_offsets,
                backend=self._split_backend,
            )
            cand_ts = target_timestamps
            if cand_ts is None:
                uih_lengths = mirror(torch.sub, lengths, num_targets)
                cand_ts = select_jagged_rows(
                    timestamps, offsets, target_offsets, uih_lengths, total_targets
                )
        if self.input_preprocessor.interleave_targets():
            cand = cand.view(-1, 2, cand.shape[-1])[:, 0]
            cand_ts = cand_ts.view(-1, 2)[:, 0]
        if not self.return_full_embeddings:
            cand = self.postprocess(cand, cand_ts)
        return TransducerOutput(cand, full, offsets)
