"""HSTU transducer: preprocessor -> positional encoder -> STU stack -> postprocessor.

Legend: B = batch, L = total tokens, E = embedding width, T_b = candidates of sample b.
"""

from __future__ import annotations

from typing import Dict, NamedTuple, Optional

import torch
from torch import nn

from tzrec_gr._backend import BackendArg, resolve_module_backend
from tzrec_gr._jagged import (
    lengths_to_offsets,
    offsets_to_lengths,
    row_positions,
    select_jagged_rows,
)
from tzrec_gr.positional_encoder import HSTUPositionalEncoder
from tzrec_gr.postprocessors import OutputPostprocessor
from tzrec_gr.preprocessors import InputPreprocessor, PreprocessorOutput
from tzrec_gr.stu import STUStack
from tzrec_ops.ops.host_copies import mirror
from tzrec_ops.ops.jagged import split_2D_jagged

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

    Call Args:
        features (Dict[str, torch.Tensor]): see :mod:`tzrec_gr.preprocessors`.
        max_uih_len (int): upper bound on history lengths.
        max_targets (int): upper bound on candidates per sample. Default: 0.
        truncated_total_len (int | None): rows left after the stack's truncation (avoids a
            host sync when truncation is on). Default: None.
        truncated_max_seq_len (int | None): upper bound on lengths after truncation.
            Default: None.

    Returns:
        TransducerOutput: ``candidate_embeddings [sum T_b, E]``, ``full_embeddings`` or None,
        ``seq_offsets [B + 1]``.
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

    def _postprocess(self, emb: torch.Tensor, ts: torch.Tensor) -> torch.Tensor:
        if self.output_postprocessor is None:
            return emb
        return self.output_postprocessor(emb, ts)

    def forward(
        self,
        features: Dict[str, torch.Tensor],
        max_uih_len: int,
        max_targets: int = 0,
        truncated_total_len: Optional[int] = None,
        truncated_max_seq_len: Optional[int] = None,
    ) -> TransducerOutput:
        pre: PreprocessorOutput = self.input_preprocessor(features, max_uih_len, max_targets)
        x = pre.seq_embeddings
        if self.positional_encoder is not None:
            query_time = None
            if self.query_time_key:
                if self.query_time_key not in features:
                    raise KeyError(f"missing feature {self.query_time_key!r} (query_time_key)")
                query_time = features[self.query_time_key]
            x = self.positional_encoder(
                pre.max_seq_len,
                pre.seq_lengths,
                pre.seq_offsets,
                pre.seq_timestamps,
                x,
                pre.num_targets,
                query_time,
            )
        x = self.input_dropout(x)
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
            lengths = offsets_to_lengths(out.x_offsets)
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

    def _replay_on_timestamps(
        self, pre: PreprocessorOutput, new_offsets: torch.Tensor, total_kept: int
    ) -> torch.Tensor:
        """The truncation applied to the timestamps: rows ``[0, C)`` of each sample are
        kept, then the rows after the ``old_len - new_len`` dropped history rows."""
        c = self.stu.contextual_seq_len
        new_len = new_offsets[1:] - new_offsets[:-1]
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
        uih_offsets = lengths_to_offsets(uih_lengths)
        cand_offsets = lengths_to_offsets(num_targets)
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
