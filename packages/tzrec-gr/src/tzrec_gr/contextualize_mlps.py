"""Contextualized MLPs: project jagged sequence embeddings, optionally conditioned on
per-sample contextual features.

Legend: B = batch, L = total tokens, Din / Dout = input / output widths,
Dc = width of the flattened contextual features (``C * Fc``).
"""

from __future__ import annotations

import abc
from typing import Optional

import torch
from torch import nn

from tzrec_gr._backend import BackendArg, resolve_module_backend
from tzrec_gr.layers import LayerNorm, Linear, SwishLayerNorm
from tzrec_ops import jagged_dense_bmm_broadcast_add

__all__ = [
    "ContextualizedMLP",
    "SimpleContextualizedMLP",
    "ParameterizedContextualizedMLP",
]


class ContextualizedMLP(nn.Module, abc.ABC):
    """Interface.

    Call Args:
        seq_embeddings (torch.Tensor): [L, Din].
        seq_offsets (torch.Tensor): [B + 1].
        max_seq_len (int): upper bound on sample lengths.
        contextual_embeddings (torch.Tensor | None): [B, Dc].

    Returns:
        torch.Tensor: [L, Dout].
    """

    output_dim: int

    @abc.abstractmethod
    def forward(
        self,
        seq_embeddings: torch.Tensor,
        seq_offsets: torch.Tensor,
        max_seq_len: int,
        contextual_embeddings: Optional[torch.Tensor] = None,
    ) -> torch.Tensor: ...


class SimpleContextualizedMLP(ContextualizedMLP):
    """``Linear -> SwishLayerNorm -> Linear -> LayerNorm`` per token; ignores the context.

    Args:
        sequential_input_dim (int): Din.
        sequential_output_dim (int): Dout.
        hidden_dim (int): width between the two linears.
        backend (str | Backend | None): ops backend. Default: None.
        device (torch.device | None): parameter device. Default: None.
    """

    def __init__(
        self,
        sequential_input_dim: int,
        sequential_output_dim: int,
        hidden_dim: int,
        backend: BackendArg = None,
        device: Optional[torch.device] = None,
    ) -> None:
        super().__init__()
        self.output_dim = sequential_output_dim
        self.mlp = nn.Sequential(
            Linear(sequential_input_dim, hidden_dim, backend=backend, device=device),
            SwishLayerNorm(hidden_dim, backend=backend, device=device),
            Linear(hidden_dim, sequential_output_dim, backend=backend, device=device),
            LayerNorm(sequential_output_dim, backend=backend, device=device),
        )

    def forward(self, seq_embeddings, seq_offsets, max_seq_len, contextual_embeddings=None):
        return self.mlp(seq_embeddings)


class ParameterizedContextualizedMLP(ContextualizedMLP):
    """Every token of sample b goes through its own user-conditioned affine map.

    ``h_b = Linear(dropout(ctx_b))``,
    ``W_b = LayerNorm_[Din*Dout](Linear(h_b)).reshape(Din, Dout)``,
    ``r_b = Linear(SwishLayerNorm(Linear(h_b)))`` and ``out = x @ W_b + r_b``
    for each token x of sample b (``jagged_dense_bmm_broadcast_add``).

    Args:
        contextual_embedding_dim (int): Dc.
        sequential_input_dim (int): Din.
        sequential_output_dim (int): Dout.
        hidden_dim (int): width of ``h``.
        contextual_dropout_ratio (float): dropout on the context. Default: 0.3.
        backend (str | Backend | None): ops backend. Default: None.
        device (torch.device | None): parameter device. Default: None.
    """

    def __init__(
        self,
        contextual_embedding_dim: int,
        sequential_input_dim: int,
        sequential_output_dim: int,
        hidden_dim: int,
        contextual_dropout_ratio: float = 0.3,
        backend: BackendArg = None,
        device: Optional[torch.device] = None,
    ) -> None:
        super().__init__()
        if contextual_embedding_dim <= 0:
            raise ValueError(
                "ParameterizedContextualizedMLP needs contextual features: "
                f"contextual_embedding_dim must be > 0, got {contextual_embedding_dim}"
            )
        if not 0.0 <= contextual_dropout_ratio < 1.0:
            raise ValueError(
                f"contextual_dropout_ratio must be in [0, 1), got {contextual_dropout_ratio}"
            )
        din, dout = sequential_input_dim, sequential_output_dim
        self.contextual_embedding_dim = contextual_embedding_dim
        self.input_dim = din
        self.output_dim = dout
        self.dropout = nn.Dropout(contextual_dropout_ratio)
        self.hidden = Linear(contextual_embedding_dim, hidden_dim, backend=backend, device=device)
        self.weight_proj = Linear(hidden_dim, din * dout, backend=backend, device=device)
        self.weight_norm = LayerNorm(din * dout, backend=backend, device=device)
        self.bias_mlp = nn.Sequential(
            Linear(hidden_dim, hidden_dim, backend=backend, device=device),
            SwishLayerNorm(hidden_dim, backend=backend, device=device),
            Linear(hidden_dim, dout, backend=backend, device=device),
        )
        self._backend = resolve_module_backend(backend, ("jagged_dense_bmm_broadcast_add",))

    def forward(self, seq_embeddings, seq_offsets, max_seq_len, contextual_embeddings=None):
        if contextual_embeddings is None:
            raise ValueError(
                "ParameterizedContextualizedMLP needs contextual_embeddings [B, "
                f"{self.contextual_embedding_dim}], got None"
            )
        batch = seq_offsets.numel() - 1
        if contextual_embeddings.shape != (batch, self.contextual_embedding_dim):
            raise ValueError(
                f"contextual_embeddings must be [B={batch}, {self.contextual_embedding_dim}], "
                f"got {tuple(contextual_embeddings.shape)}"
            )
        ctx = contextual_embeddings.to(seq_embeddings.dtype)
        h = self.hidden(self.dropout(ctx))
        weights = self.weight_norm(self.weight_proj(h)).reshape(
            batch, self.input_dim, self.output_dim
        )
        bias = self.bias_mlp(h)
        return jagged_dense_bmm_broadcast_add(
            max_seq_len=max_seq_len,
            seq_offsets=seq_offsets,
            jagged=seq_embeddings,
            dense=weights,
            bias=bias,
            backend=self._backend,
        )
