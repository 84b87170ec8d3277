"""The contract of a sequential transduction unit: :class:`STU` and :class:`STUOutput`.

Shapes use the legend of :mod:`tzrec_gr.stu`.
"""

from __future__ import annotations

import abc
from typing import NamedTuple, Optional, Tuple

import torch
from torch import nn

from tzrec_gr.stu.kv_cache import KVCache
from tzrec_ops import STUTruncationPlan

__all__ = ["STU", "STUOutput"]


class STUOutput(NamedTuple):
    """What :meth:`STU.forward` returns.

    Attributes:
        out: [L, E] the layer output.
        attn_func: [H, 3, L] the semi-local-attention mask used, or the one passed in.
        kv_cache: the prefix cache when ``kv_caching_lengths`` was given, else None.
    """

    out: torch.Tensor
    attn_func: Optional[torch.Tensor]
    kv_cache: Optional[KVCache]


class STU(nn.Module, abc.ABC):
    """Interface of a sequential transduction unit over jagged sequences."""

    @abc.abstractmethod
    def forward(
        self,
        x: torch.Tensor,
        x_offsets: torch.Tensor,
        max_seq_len: int,
        num_targets: Optional[torch.Tensor] = None,
        *,
        kv_caching_lengths: Optional[torch.Tensor] = None,
        max_kv_caching_len: int = 0,
        total_kv_caching_len: Optional[int] = None,
        prev_attn_func: Optional[torch.Tensor] = None,
        prev_attn_func_sig: Optional[str] = None,
    ) -> STUOutput:
        """Transduce ``x`` [L, E] -> [L, E]; optionally return a KV cache of each prefix."""

    @abc.abstractmethod
    def cached_forward(
        self,
        delta_x: torch.Tensor,
        kv_cache: KVCache,
        num_targets: Optional[torch.Tensor] = None,
        *,
        kv_caching_lengths: Optional[torch.Tensor] = None,
        max_kv_caching_len: int = 0,
        total_kv_caching_len: Optional[int] = None,
        update_cache: bool = True,
    ) -> Tuple[torch.Tensor, Optional[KVCache]]:
        """Transduce Δ new tokens per sample against ``kv_cache``; return (out, new cache),
        the new cache being None when ``update_cache`` is False."""

    @property
    @abc.abstractmethod
    def contextual_seq_len(self) -> int:
        """C, the contextual prefix length this unit was built for."""

    @property
    @abc.abstractmethod
    def attn_func_sig(self) -> Optional[str]:
        """Identifies the attention mask this unit builds (None: it builds none)."""

    @abc.abstractmethod
    def truncate_input(
        self,
        x: torch.Tensor,
        x_offsets: torch.Tensor,
        max_seq_len: int,
        num_targets: Optional[torch.Tensor],
        *,
        truncate_tail_len: int,
        total_kept: Optional[int] = None,
        new_max_seq_len: Optional[int] = None,
    ) -> Tuple[torch.Tensor, torch.Tensor, int, STUTruncationPlan]:
        """Drop the oldest history tokens so at most ``truncate_tail_len`` remain per sample."""
