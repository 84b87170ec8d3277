"""A stack of STU layers: :class:`STUStack`, with optional history truncation before one
layer and a KV cache per layer.

Shapes use the legend of :mod:`tzrec_gr.stu`.
"""

from __future__ import annotations

from typing import List, NamedTuple, Optional, Sequence, Tuple

import torch
from torch import nn

from tzrec_gr.stu.interface import STU
from tzrec_gr.stu.kv_cache import KVCache
from tzrec_ops import STUTruncationPlan

__all__ = ["STUStack", "STUStackOutput"]


class STUStackOutput(NamedTuple):
    """What :meth:`STUStack.forward` returns.

    Attributes:
        x: [L', E] the output (L' < L when truncation dropped history tokens).
        x_offsets: [B + 1] offsets of ``x``.
        max_seq_len: upper bound on the output lengths.
        plan: the truncation plan that was applied, or None.
        kv_caches: one :class:`KVCache` per layer when ``kv_caching_lengths`` was given.
    """

    x: torch.Tensor
    x_offsets: torch.Tensor
    max_seq_len: int
    plan: Optional[STUTruncationPlan]
    kv_caches: Optional[List[KVCache]]


class STUStack(nn.Module):
    """STU layers run in order, with optional history truncation before one layer.

    With truncation on, layers ``[0, truncate_split_layer)`` see the full sequence and the
    later ones only ``[C | last truncate_tail_len history tokens | targets]`` of each sample.
    Consecutive SLA layers with the same mask signature share one mask tensor.

    Args:
        stu_list (Sequence[STU]): the layers; all must have the same ``embedding_dim``.
        truncate_split_layer (int): index of the first layer that sees the truncated
            sequence; 0 with ``truncate_tail_len = 0`` turns truncation off. Default: 0.
        truncate_tail_len (int): history tokens kept per sample. Default: 0.

    Call Args:
        x (torch.Tensor): [L, E].
        x_offsets (torch.Tensor): [B + 1].
        max_seq_len (int): upper bound on sample lengths.
        num_targets (torch.Tensor | None): [B].
        kv_caching_lengths, max_kv_caching_len, total_kv_caching_len: as in
            :meth:`STULayer.forward`; returns one cache per layer. Not with truncation.
        truncated_total_len (int | None): rows left after truncation, from the caller (the
            plan then needs no sizes from the offsets; checked against their host copies).
            Default: None (the plan takes its sizes from the offsets' host copies).
        truncated_max_seq_len (int | None): upper bound on the lengths after truncation,
            used with ``truncated_total_len``. Default: None (``max_seq_len``).

    Returns:
        STUStackOutput: ``(x [L', E], x_offsets [B + 1], max_seq_len, plan, kv_caches)``.

    Sync-free steps: pass ``x_offsets``, ``num_targets`` and ``kv_caching_lengths`` moved
    with :func:`tzrec_ops.jagged.to_device` (or built from lengths moved that way):
    then neither a training step nor a cached serving step reads anything back from the
    device (a truncation plan is derived from their host copies too). Otherwise the first
    op that needs a value reads the batch once (one transfer) and every later layer reuses
    it; the checks a batch passed are not run again by the next layer.

    Example::

        offsets = to_device(torch.tensor([0, 3, 7]), "cuda")  # CPU copy kept on the host
        out = stack(x, offsets, max_seq_len=4, num_targets=to_device(targets, "cuda"))
    """

    def __init__(
        self,
        stu_list: Sequence[STU],
        truncate_split_layer: int = 0,
        truncate_tail_len: int = 0,
    ) -> None:
        super().__init__()
        if len(stu_list) == 0:
            raise ValueError("stu_list must contain at least one STU layer, got []")
        if truncate_split_layer < 0 or truncate_tail_len < 0:
            raise ValueError(
                "truncate_split_layer and truncate_tail_len must be non-negative, got "
                f"{truncate_split_layer} and {truncate_tail_len}"
            )
        if (truncate_split_layer > 0) != (truncate_tail_len > 0):
            raise ValueError(
                "truncate_split_layer and truncate_tail_len must both be > 0 (truncation on) "
                f"or both 0 (off), got {truncate_split_layer} and {truncate_tail_len}"
            )
        if truncate_split_layer >= len(stu_list) and truncate_split_layer > 0:
            raise ValueError(
                f"truncate_split_layer ({truncate_split_layer}) must be < the number of "
                f"layers ({len(stu_list)})"
            )
        dims = {getattr(s, "embedding_dim", None) for s in stu_list}
        if len(dims) != 1:
            raise ValueError(
                f"every STU layer must have the same embedding_dim, got {sorted(dims)}"
            )
        self.stu_layers = nn.ModuleList(stu_list)
        self.embedding_dim = dims.pop()
        self.truncate_split_layer = truncate_split_layer
        self.truncate_tail_len = truncate_tail_len
        # the attention mask is rebuilt at layer 0 and where truncation changes the sequences
        self._prev_sigs: List[Optional[str]] = [
            None
            if i == 0 or (self.truncation_enabled and i == truncate_split_layer)
            else stu_list[i - 1].attn_func_sig
            for i in range(len(stu_list))
        ]

    @property
    def truncation_enabled(self) -> bool:
        return self.truncate_tail_len > 0

    @property
    def contextual_seq_len(self) -> int:
        return self.stu_layers[0].contextual_seq_len

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
        truncated_total_len: Optional[int] = None,
        truncated_max_seq_len: Optional[int] = None,
    ) -> STUStackOutput:
        if kv_caching_lengths is not None and self.truncation_enabled:
            raise NotImplementedError(
                "KV caching with truncation is not supported: the cache would hold the "
                "untruncated prefix for early layers and the truncated one for later layers"
            )
        plan: Optional[STUTruncationPlan] = None
        attn_func: Optional[torch.Tensor] = None
        caches: List[KVCache] = []
        for i, layer in enumerate(self.stu_layers):
            if self.truncation_enabled and i == self.truncate_split_layer:
                x, x_offsets, max_seq_len, plan = layer.truncate_input(
                    x,
                    x_offsets,
                    max_seq_len,
                    num_targets,
                    truncate_tail_len=self.truncate_tail_len,
                    total_kept=truncated_total_len,
                    new_max_seq_len=truncated_max_seq_len,
                )
                attn_func = None
            out = layer(
                x,
                x_offsets,
                max_seq_len,
                num_targets,
                kv_caching_lengths=kv_caching_lengths,
                max_kv_caching_len=max_kv_caching_len,
                total_kv_caching_len=total_kv_caching_len,
                prev_attn_func=attn_func,
                prev_attn_func_sig=self._prev_sigs[i],
            )
            x, attn_func = out.out, out.attn_func
            if out.kv_cache is not None:
                caches.append(out.kv_cache)
        return STUStackOutput(x, x_offsets, max_seq_len, plan, caches if caches else None)

    def cached_forward(
        self,
        delta_x: torch.Tensor,
        kv_caches: Sequence[KVCache],
        num_targets: Optional[torch.Tensor] = None,
        *,
        kv_caching_lengths: Optional[torch.Tensor] = None,
        max_kv_caching_len: int = 0,
        total_kv_caching_len: Optional[int] = None,
        update_cache: bool = True,
    ) -> Tuple[torch.Tensor, Optional[List[KVCache]]]:
        """Each layer's :meth:`STULayer.cached_forward` in turn (inference only).

        Every layer reads its cache in place; ``update_cache=True`` also copies each cache
        into the extended one it returns (decoding); ``False`` builds no new caches (scoring
        candidates against a fixed history).

        Args:
            delta_x (torch.Tensor): [B * Δ, E].
            kv_caches (Sequence[KVCache]): one per layer, e.g. from ``forward`` with
                ``kv_caching_lengths``.
            num_targets, kv_caching_lengths, max_kv_caching_len, total_kv_caching_len,
                update_cache: as in :meth:`STULayer.cached_forward`.

        Returns:
            (out [B * Δ, E], new caches, one per layer, or None when ``update_cache`` is
            False).

        Raises:
            NotImplementedError: truncation is on (the cache would not match training).
        """
        if self.truncation_enabled:
            raise NotImplementedError(
                "cached_forward is not supported with truncation (truncate_tail_len > 0)"
            )
        if len(kv_caches) != len(self.stu_layers):
            raise ValueError(
                f"kv_caches has {len(kv_caches)} entries but the stack has "
                f"{len(self.stu_layers)} layers; pass one cache per layer"
            )
        new_caches: List[KVCache] = []
        x = delta_x
        for layer, cache in zip(self.stu_layers, kv_caches):
            x, new = layer.cached_forward(
                x,
                cache,
                num_targets,
                kv_caching_lengths=kv_caching_lengths,
                max_kv_caching_len=max_kv_caching_len,
                total_kv_caching_len=total_kv_caching_len,
                update_cache=update_cache,
            )
            if new is not None:
                new_caches.append(new)
        return x, new_caches if update_cache else None
