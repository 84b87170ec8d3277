"""Output postprocessors: applied to the STU output embeddings (with their timestamps).

Legend: N = rows (tokens or candidates), E = embedding width.
All postprocessors take ``(seq_embeddings [..., E], seq_timestamps [...])`` and return
``[..., E]``.
"""

from __future__ import annotations

import abc
import math
from typing import Optional, Sequence

import torch
from torch import nn

from tzrec_gr._backend import BackendArg
from tzrec_gr.layers import LayerNorm, Linear

__all__ = [
    "OutputPostprocessor",
    "L2NormPostprocessor",
    "LayerNormPostprocessor",
    "TimestampLayerNormPostprocessor",
]


class OutputPostprocessor(nn.Module, abc.ABC):
    """Interface.

    Call Args:
        seq_embeddings (torch.Tensor): [..., E].
        seq_timestamps (torch.Tensor): [...] integer timestamps (seconds).

    Returns:
        torch.Tensor: [..., E].
    """

    @abc.abstractmethod
    def forward(
        self, seq_embeddings: torch.Tensor, seq_timestamps: torch.Tensor
    ) -> torch.Tensor: ...


class L2NormPostprocessor(OutputPostprocessor):
    """``x / max(||x||_2, eps)`` over the last dim; timestamps are ignored.

    Args:
        eps (float): lower bound on the norm. Default: 1e-6.
    """

    def __init__(self, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps

    def forward(self, seq_embeddings, seq_timestamps=None):
        norm = torch.linalg.vector_norm(seq_embeddings, dim=-1, keepdim=True)
        return seq_embeddings / norm.clamp(min=self.eps)


def _flat(x: torch.Tensor, dim: int) -> torch.Tensor:
    return x.reshape(-1, dim)


class LayerNormPostprocessor(OutputPostprocessor):
    """Layer norm over the last dim; timestamps are ignored.

    Args:
        embedding_dim (int): E.
        eps (float): variance epsilon. Default: 1e-5.
        backend (str | Backend | None): ops backend. Default: None.
        device (torch.device | None): parameter device. Default: None.
    """

    def __init__(
        self,
        embedding_dim: int,
        eps: float = 1e-5,
        backend: BackendArg = None,
        device: Optional[torch.device] = None,
    ) -> None:
        super().__init__()
        self.embedding_dim = embedding_dim
        self.norm = LayerNorm(embedding_dim, eps=eps, backend=backend, device=device)

    def forward(self, seq_embeddings, seq_timestamps=None):
        shape = seq_embeddings.shape
        if shape[-1] != self.embedding_dim:
            raise ValueError(
                f"seq_embeddings must be [..., {self.embedding_dim}], got {tuple(shape)}"
            )
        return self.norm(_flat(seq_embeddings, self.embedding_dim)).reshape(shape)


class TimestampLayerNormPostprocessor(OutputPostprocessor):
    """Appends periodic time features, projects back to E, then layer-normalizes.

    For each pair ``(P_i, U_i)``: ``k = floor(ts / P_i)``,
    ``phi = 2 * pi * (k mod U_i) / U_i``, features ``[cos phi, sin phi]`` (computed in
    float32). Then ``LayerNorm(Linear_{E + 2F -> E}([x, features]))``. For example
    ``periods [3600, 86400]`` with ``units [24, 7]`` give hour-of-day and day-of-week.

    Args:
        embedding_dim (int): E.
        time_duration_period_units (Sequence[int]): P_i, seconds per period step.
        time_duration_units_per_period (Sequence[int]): U_i, steps per cycle.
        eps (float): layer norm epsilon. Default: 1e-5.
        backend (str | Backend | None): ops backend. Default: None.
        device (torch.device | None): parameter device. Default: None.
    """

    def __init__(
        self,
        embedding_dim: int,
        time_duration_period_units: Sequence[int],
        time_duration_units_per_period: Sequence[int],
        eps: float = 1e-5,
        backend: BackendArg = None,
        device: Optional[torch.device] = None,
    ) -> None:
        super().__init__()
        periods = list(time_duration_period_units)
        units = list(time_duration_units_per_period)
        if len(periods) != len(units):
            raise ValueError(
                f"time_duration_period_units has {len(periods)} entries but "
                f"time_duration_units_per_period has {len(units)}; they must match"
            )
        if not periods:
            raise ValueError("time_duration_period_units must not be empty")
        if any(p <= 0 for p in periods) or any(u <= 0 for u in units):
            raise ValueError(f"periods and units must be positive, got {periods} and {units}")
        self.embedding_dim = embedding_dim
        self.register_buffer("_periods", torch.tensor(periods, dtype=torch.int64, device=device))
        self.register_buffer("_units", torch.tensor(units, dtype=torch.int64, device=device))
        self.proj = Linear(
            embedding_dim + 2 * len(periods), embedding_dim, backend=backend, device=device
        )
        self.norm = LayerNorm(embedding_dim, eps=eps, backend=backend, device=device)

    def time_features(self, seq_timestamps: torch.Tensor) -> torch.Tensor:
        """[...] timestamps -> [..., 2F] float32 ``[cos phi_1, sin phi_1, ...]``."""
        ts = seq_timestamps.to(torch.int64).unsqueeze(-1)
        steps = torch.remainder(torch.div(ts, self._periods, rounding_mode="floor"), self._units)
        # the int64 units are promoted to float32 inside the division (no cast of their own)
        phase = steps.to(torch.float32) / self._units * (2.0 * math.pi)
        return torch.stack([torch.cos(phase), torch.sin(phase)], dim=-1).flatten(-2)

    def forward(self, seq_embeddings, seq_timestamps):
        shape = seq_embeddings.shape
        if shape[-1] != self.embedding_dim:
            raise ValueError(
                f"seq_embeddings must be [..., {self.embedding_dim}], got {tuple(shape)}"
            )
        if seq_timestamps.shape != shape[:-1]:
            raise ValueError(
                f"seq_timestamps must have shape {tuple(shape[:-1])} (one per embedding row), "
                f"got {tuple(seq_timestamps.shape)}"
            )
        features = self.time_features(seq_timestamps).to(seq_embeddings.dtype)
        x = torch.cat([seq_embeddings, features], dim=-1)
        x = self.proj(_flat(x, x.shape[-1]))
        return self.norm(x).reshape(shape)
