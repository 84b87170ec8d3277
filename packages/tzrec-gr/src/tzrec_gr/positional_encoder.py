"""HSTU positional encoder: scaled input plus learned position (and time-gap) embeddings.

Legend: B = batch, L = total tokens, E = embedding width.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn

from tzrec_gr._backend import BackendArg, resolve_module_backend
from tzrec_ops import add_positional_embeddings, add_timestamp_positional_embeddings
from tzrec_ops.jagged import row_positions

__all__ = ["HSTUPositionalEncoder"]

_TIME_BUCKET_FNS = ("sqrt", "log")


class HSTUPositionalEncoder(nn.Module):
    """``out = sqrt(E) * x + P[pos] (+ T[time bucket])``.

    Without time encoding, positions count forward from the sequence start and every target
    shares the position of the first target (``add_positional_embeddings``). With time
    encoding, positions count backward from the newest history token, contextual tokens keep
    their own positions, and the time bucket is ``fn(max(query_time - ts, 1e-6) /
    increments)`` clamped to ``[0, num_time_buckets]`` (``add_timestamp_positional_embeddings``).

    Args:
        embedding_dim (int): E.
        num_position_buckets (int): rows of the position table; positions are clamped to it.
        num_time_buckets (int): time buckets (the table has one more row). Needed (> 0) with
            time encoding. Default: 0.
        use_time_encoding (bool): add time-gap embeddings. Default: False.
        contextual_seq_len (int): C, the contextual prefix length. Default: 0.
        time_bucket_fn (str): ``"sqrt"`` or ``"log"``. Default: "sqrt".
        time_bucket_increments (float): seconds per unit before ``time_bucket_fn``.
            Default: 60.0.
        backend (str | Backend | None): ops backend. Default: None.
        device (torch.device | None): parameter device. Default: None.

    Call Args:
        max_seq_len (int): upper bound on sample lengths.
        seq_lengths (torch.Tensor): [B].
        seq_offsets (torch.Tensor): [B + 1].
        seq_timestamps (torch.Tensor): [L] integer timestamps (used with time encoding).
        seq_embeddings (torch.Tensor): [L, E].
        num_targets (torch.Tensor | None): [B].
        query_time (torch.Tensor | None): [B] request time per sample; None uses each
            sample's last timestamp.

    Returns:
        torch.Tensor: [L, E] in seq_embeddings' dtype.

    Serving: :meth:`forward_appended` encodes only the tokens added after a KV cache.
    """

    def __init__(
        self,
        embedding_dim: int,
        num_position_buckets: int,
        num_time_buckets: int = 0,
        use_time_encoding: bool = False,
        contextual_seq_len: int = 0,
        time_bucket_fn: str = "sqrt",
        time_bucket_increments: float = 60.0,
        backend: BackendArg = None,
        device: Optional[torch.device] = None,
    ) -> None:
        super().__init__()
        if num_position_buckets <= 0:
            raise ValueError(f"num_position_buckets must be > 0, got {num_position_buckets}")
        if use_time_encoding and num_time_buckets <= 0:
            raise ValueError(
                f"num_time_buckets must be > 0 with use_time_encoding, got {num_time_buckets}"
            )
        if time_bucket_fn not in _TIME_BUCKET_FNS:
            raise ValueError(f"time_bucket_fn must be 'sqrt' or 'log', got {time_bucket_fn!r}")
        if time_bucket_increments <= 0:
            raise ValueError(f"time_bucket_increments must be > 0, got {time_bucket_increments}")
        if contextual_seq_len < 0:
            raise ValueError(f"contextual_seq_len must be >= 0, got {contextual_seq_len}")
        self.embedding_dim = embedding_dim
        self.num_position_buckets = num_position_buckets
        self.num_time_buckets = num_time_buckets
        self.use_time_encoding = use_time_encoding
        self.contextual_seq_len = contextual_seq_len
        self.time_bucket_fn = time_bucket_fn
        self.time_bucket_increments = float(time_bucket_increments)
        self.alpha = math.sqrt(embedding_dim)
        bound = math.sqrt(1.0 / num_position_buckets)
        self.position_embeddings_weight = nn.Parameter(
            torch.empty(num_position_buckets, embedding_dim, device=device).uniform_(-bound, bound)
        )
        if use_time_encoding:
            bound = math.sqrt(1.0 / num_time_buckets)
            self.timestamp_embeddings_weight = nn.Parameter(
                torch.empty(num_time_buckets + 1, embedding_dim, device=device).uniform_(
                    -bound, bound
                )
            )
        op = (
            "add_timestamp_positional_embeddings"
            if use_time_encoding
            else "add_positional_embeddings"
        )
        self._op = op
        self._backend = resolve_module_backend(backend, (op,))

    def forward(
        self,
        max_seq_len: int,
        seq_lengths: torch.Tensor,
        seq_offsets: torch.Tensor,
        seq_timestamps: Optional[torch.Tensor],
        seq_embeddings: torch.Tensor,
        num_targets: Optional[torch.Tensor],
        query_time: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        if seq_embeddings.dim() != 2 or seq_embeddings.shape[1] != self.embedding_dim:
            raise ValueError(
                f"seq_embeddings must be [L, {self.embedding_dim}], "
                f"got {tuple(seq_embeddings.shape)}"
            )
        if not self.use_time_encoding:
            return add_positional_embeddings(
                alpha=self.alpha,
                max_seq_len=max_seq_len,
                position_embeddings_weight=self.position_embeddings_weight,
                seq_offsets=seq_offsets,
                seq_lengths=seq_lengths,
                seq_embeddings=seq_embeddings,
                num_targets=num_targets,
                interleave_targets=False,
                backend=self._backend,
            )
        if seq_timestamps is None:
            raise ValueError("seq_timestamps is required: this encoder uses time encoding")
        if seq_timestamps.shape[0] != seq_embeddings.shape[0]:
            raise ValueError(
                f"seq_timestamps has {seq_timestamps.shape[0]} rows but seq_embeddings has "
                f"{seq_embeddings.shape[0]}; they must match"
            )
        return add_timestamp_positional_embeddings(
            alpha=self.alpha,
            max_seq_len=max_seq_len,
            max_contextual_seq_len=self.contextual_seq_len,
            position_embeddings_weight=self.position_embeddings_weight,
            timestamp_embeddings_weight=self.timestamp_embeddings_weight,
            seq_offsets=seq_offsets,
            seq_lengths=seq_lengths,
            seq_embeddings=seq_embeddings,
            timestamps=seq_timestamps,
            num_targets=num_targets,
            interleave_targets=False,
            time_bucket_fn=self.time_bucket_fn,
            time_bucket_increments=self.time_bucket_increments,
            query_time=query_time,
            backend=self._backend,
        )

    def forward_appended(
        self,
        seq_embeddings: torch.Tensor,
        seq_offsets: torch.Tensor,
        cached_lengths: torch.Tensor,
        seq_timestamps: Optional[torch.Tensor],
        query_time: Optional[torch.Tensor],
        targets: bool,
    ) -> torch.Tensor:
        """What :meth:`forward` gives the last rows of each sample ``[cached_b | new_b]``,
        computed from the new rows alone (the cached tokens are not encoded again).

        ``targets=True``: every new row is a target (candidates scored against the cache);
        ``False``: every new row is history appended after the cache. Without time encoding
        new history takes positions ``n_b, n_b + 1, ...`` and targets share ``n_b``
        (``n_b = cached_lengths[b]``): a cached token's encoding depends on its own place
        only, so appending leaves it as it was. With time encoding every target has
        position C and time bucket ``fn(query_time[b] - ts)``.

        Appending history with time encoding cannot be exact from the new rows alone. A
        cached history token p of a user with n history tokens is encoded as
        ``alpha * x_p + P[min(n - p + C, Kp - 1)] + T[bucket(query_time - ts_p)]``: its
        position counts back from the newest history token and its time bucket is measured
        from the query time, which moves with the newest event. Appending Δ events adds Δ
        to every cached token's position (until it reaches the table's last row Kp - 1)
        and measures every gap from the new query time, so the cached tokens' inputs to the
        first STU layer change. Their keys and values are computed from those inputs
        (normalized, projected; the later layers' from the earlier layers' outputs), so no
        update of the cached keys and values can account for it: the longer history must
        be encoded again.

        Args:
            seq_embeddings (torch.Tensor): [N, E] the new rows.
            seq_offsets (torch.Tensor): [B + 1] offsets of the new rows.
            cached_lengths (torch.Tensor): [B] tokens before them, the C prefix included.
            seq_timestamps (torch.Tensor | None): [N] (used with time encoding).
            query_time (torch.Tensor | None): [B] the anchor the cached tokens were encoded
                with (required with time encoding).
            targets (bool): whether the new rows are targets or history.

        Returns:
            torch.Tensor: [N, E] in seq_embeddings' dtype.

        Raises:
            NotImplementedError: history rows with time encoding.
        """
        sample, step = row_positions(seq_offsets, seq_embeddings.shape[0])
        cached = cached_lengths.to(torch.int64)[sample]
        if not self.use_time_encoding:
            positions = cached if targets else cached + step
            return self._add_rows(seq_embeddings, positions, None)
        if not targets:
            raise NotImplementedError(
                "appending history is not exact with time encoding: positions count back "
                "from the newest history token and time gaps are measured from the query "
                "time, so every cached token's encoding changes; encode the longer history "
                "again"
            )
        if seq_timestamps is None or query_time is None:
            raise ValueError("seq_timestamps and query_time are required with time encoding")
        positions = torch.full_like(cached, self.contextual_seq_len)
        anchor = query_time.reshape(-1).to(seq_timestamps.dtype)[sample]
        return self._add_rows(
            seq_embeddings, positions, self._time_buckets(anchor - seq_timestamps)
        )

    def _time_buckets(self, gaps: torch.Tensor) -> torch.Tensor:
        """[N] bucket of each time gap, in float64 as ``add_timestamp_positional_embeddings``."""
        scaled = gaps.to(torch.float64).clamp(min=1e-6) / self.time_bucket_increments
        scaled = torch.sqrt(scaled) if self.time_bucket_fn == "sqrt" else torch.log(scaled)
        return scaled.clamp(0, self.num_time_buckets).to(torch.int64)

    def _add_rows(
        self, x: torch.Tensor, positions: torch.Tensor, buckets: Optional[torch.Tensor]
    ) -> torch.Tensor:
        """``alpha * x + P[positions] (+ T[buckets])``, summed in float32 (float64 for float64
        x) and cast to x's dtype, as the ops do."""
        compute = torch.float64 if x.dtype == torch.float64 else torch.float32
        index = positions.clamp(max=self.num_position_buckets - 1)
        out = x.to(compute) * self.alpha + self.position_embeddings_weight.to(compute)[index]
        if buckets is not None:
            out = out + self.timestamp_embeddings_weight.to(compute)[buckets]
        return out.to(x.dtype)
