"""STU (sequential transduction unit) layers and stacks, with a functional KV cache.

Legend: B = batch, L = total tokens of the jagged batch, E = embedding dim, H = heads,
A = attention (q/k) dim per head, V = hidden (v/u) dim per head, C = contextual prefix
length, T_b = number of targets (candidates) at the end of sample b, N = ``max_seq_len``.

Each sample is laid out as ``[contextual prefix (C) | history (U_b) | targets (T_b)]``.

KV cache design: the cache is a **value**, not module state. :class:`KVCache` holds one
layer's cached keys/values; :meth:`STULayer.forward` returns a new cache when asked to
(``kv_caching_lengths``), and :meth:`STULayer.cached_forward` takes a cache and returns
``(output, full_cache)`` where ``full_cache`` is the input cache with the new tokens
appended (or ``None`` with ``update_cache=False``, for scoring candidates against a fixed
history). Keeping the old cache, rolling forward to the new one, or trimming it is the
caller's choice, so a layer can serve many requests at once and is safe to re-enter.
Attention reads the cache in place (the split form of ``delta_hstu_mha``); only
``update_cache=True`` copies it, to build the returned cache.
"""

from __future__ import annotations

import abc
import dataclasses
import math
import warnings
from typing import List, NamedTuple, Optional, Sequence, Tuple

import torch
from torch import nn

from tzrec_gr._backend import BackendArg, resolve_module_backend
from tzrec_ops import (
    STUTruncationPlan,
    apply_stu_truncation_plan,
    build_sla_func_tensor,
    compute_stu_truncation_plan,
    concat_2D_jagged,
    delta_hstu_mha,
    hstu_compute_output,
    hstu_compute_uqvk,
    hstu_preprocess_and_attention,
    split_2D_jagged,
)
from tzrec_ops.jagged import host_copy, mirror, offsets_from_lengths, tracing

__all__ = ["KVCache", "STU", "STULayer", "STUOutput", "STUStack", "STUStackOutput"]

_NORM_EPS = 1e-6
_LAYER_OPS = (
    "hstu_compute_uqvk",
    "hstu_mha",
    "hstu_compute_output",
    "delta_hstu_mha",
    "split_2D_jagged",
    "concat_2D_jagged",
)


def _sum(values: torch.Tensor) -> int:
    return int(values.sum())


def _difference(offsets: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """int64 ``offsets - other`` (the offsets of the rows after each sample's first part)."""
    return offsets.to(torch.int64) - other.to(torch.int64)


def _extended_offsets(offsets: torch.Tensor, delta: int) -> torch.Tensor:
    """The offsets after appending ``delta`` rows to every sample."""
    steps = torch.arange(offsets.numel(), device=offsets.device, dtype=torch.int64) * delta
    return offsets.to(torch.int64) + steps


@dataclasses.dataclass(frozen=True)
class KVCache:
    """One STU layer's cached keys and values for a jagged batch.

    Attributes:
        k (torch.Tensor): [sum_b n_b, H * A] cached keys.
        v (torch.Tensor): [sum_b n_b, H * V] cached values.
        offsets (torch.Tensor): [B + 1] int64 offsets of the cached tokens.
        max_len (int): an upper bound on the cached lengths n_b.
    """

    k: torch.Tensor
    v: torch.Tensor
    offsets: torch.Tensor
    max_len: int


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


class STULayer(STU):
    r"""One STU layer: pointwise-projected HSTU attention with a gated, normed output.

    ``u, v, q, k = split(LN(x) W_uvqk + b)``, ``u = SiLU(u)``,
    ``attn = HSTU-attention(q, k, v)``,
    ``out = x + Dropout([u, attn, u * Norm(attn)]) W_out``.

    Args:
        embedding_dim (int): E, the width of input and output.
        num_heads (int): H.
        hidden_dim (int): V, the per-head width of u and v.
        attention_dim (int): A, the per-head width of q and k.
        output_dropout_ratio (float): dropout on ``[u, attn, u * Norm(attn)]``. Default: 0.3.
        causal (bool): causal mask; False gives bidirectional attention (the pytorch
            backend supports it; check your backend). Default: True.
        target_aware (bool): targets attend to the history and themselves only (passes
            ``num_targets`` to attention). Default: True.
        max_attn_len (int | None): local window; None or 0 means no window. Default: None.
        attn_alpha (float | None): q.k scale; None means ``1 / sqrt(A)``. Default: None.
        use_group_norm (bool): per-head GroupNorm instead of LayerNorm on ``attn``.
            Default: False.
        recompute_normed_x (bool): recompute ``LN(x)`` in backward. Default: True.
        recompute_uvqk (bool): recompute the UVQK projection in backward. Default: True.
        recompute_y (bool): recompute the gated output in backward (honoured by fused
            backends only). Default: True.
        sort_by_length (bool): let the attention kernel schedule long samples first.
            Default: True.
        contextual_seq_len (int): C, the bidirectional contextual prefix. Default: 0.
        sla_k1 (int): semi-local attention window (0 and ``sla_k2 = 0``: SLA off). SLA builds
            an arbitrary mask, which the triton backends do not support. Default: 0.
        sla_k2 (int): semi-local attention global prefix. Default: 0.
        scaling_seqlen (int): attention divisor; -1 means ``max_seq_len`` of each call (and
            ``cached_forward`` warns: its divisor is the cache's bound plus the new tokens).
            Set it for batch-invariant outputs and for cached == full equality; a transducer
            built with ``max_uih_len`` sets it. Default: -1.
        backend (str | Backend | None): ops backend, resolved once here. Default: None (best
            available).
        device (torch.device | None): where to create the parameters. Default: None.

    Call Args:
        x (torch.Tensor): [L, E].
        x_offsets (torch.Tensor): [B + 1] int32/int64 offsets.
        max_seq_len (int): N, an upper bound on the sample lengths.
        num_targets (torch.Tensor | None): [B] targets at the end of each sample.
        kv_caching_lengths (torch.Tensor | None): [B]; if given, also return a
            :class:`KVCache` holding the keys/values of the first ``kv_caching_lengths[b]``
            tokens of each sample (prefill). Default: None.
        max_kv_caching_len (int): upper bound on ``kv_caching_lengths``; 0 means ``max_seq_len``.
        total_kv_caching_len (int | None): ``sum(kv_caching_lengths)``; None takes it from the
            lengths' host copy (see "Sync-free steps").
        prev_attn_func (torch.Tensor | None): a mask built by the previous layer.
        prev_attn_func_sig (str | None): that mask's signature; reused when equal to ours.

    Returns:
        STUOutput: ``out`` [L, E] in x's dtype, the ``attn_func`` [H, 3, L] or None, and the
        ``kv_cache`` or None.

    Sync-free steps: the ops check the values of ``x_offsets``, ``num_targets`` and
    ``kv_caching_lengths`` (and the layer needs ``sum(kv_caching_lengths)`` when
    ``total_kv_caching_len`` is None) on host copies of them
    (:mod:`tzrec_ops.jagged`). Move them to the device with
    :func:`tzrec_ops.jagged.to_device` (or build them from lengths moved that way)
    and a step reads nothing back from the device; the offsets the layer derives (cache
    offsets, the extended cache's offsets) get host copies from them. Otherwise the first
    op that needs a value reads the batch once, and every later op and layer reuses it.

    Example::

        layer = STULayer(embedding_dim=16, num_heads=2, hidden_dim=8, attention_dim=8)
        x = torch.randn(7, 16)
        out, _, _ = layer(x, torch.tensor([0, 3, 7]), max_seq_len=4)
        assert out.shape == (7, 16)
    """

    def __init__(
        self,
        embedding_dim: int,
        num_heads: int,
        hidden_dim: int,
        attention_dim: int,
        output_dropout_ratio: float = 0.3,
        causal: bool = True,
        target_aware: bool = True,
        max_attn_len: Optional[int] = None,
        attn_alpha: Optional[float] = None,
        use_group_norm: bool = False,
        recompute_normed_x: bool = True,
        recompute_uvqk: bool = True,
        recompute_y: bool = True,
        sort_by_length: bool = True,
        contextual_seq_len: int = 0,
        sla_k1: int = 0,
        sla_k2: int = 0,
        scaling_seqlen: int = -1,
        backend: BackendArg = None,
        device: Optional[torch.device] = None,
    ) -> None:
        super().__init__()
        for name, value in (
            ("embedding_dim", embedding_dim),
            ("num_heads", num_heads),
            ("hidden_dim", hidden_dim),
            ("attention_dim", attention_dim),
        ):
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if not 0.0 <= output_dropout_ratio < 1.0:
            raise ValueError(f"output_dropout_ratio must be in [0, 1), got {output_dropout_ratio}")
        for name, value in (
            ("max_attn_len", max_attn_len or 0),
            ("contextual_seq_len", contextual_seq_len),
            ("sla_k1", sla_k1),
            ("sla_k2", sla_k2),
        ):
            if value < 0:
                raise ValueError(f"{name} must be >= 0, got {value}")
        if scaling_seqlen != -1 and scaling_seqlen <= 0:
            raise ValueError(f"scaling_seqlen must be -1 or > 0, got {scaling_seqlen}")
        if attn_alpha is not None and attn_alpha <= 0:
            raise ValueError(f"attn_alpha must be > 0 or None, got {attn_alpha}")

        self.embedding_dim = embedding_dim
        self.num_heads = num_heads
        self.hidden_dim = hidden_dim
        self.attention_dim = attention_dim
        self.output_dropout_ratio = output_dropout_ratio
        self.causal = causal
        self.target_aware = target_aware
        self.max_attn_len = max_attn_len or 0
        self.attn_alpha = attn_alpha if attn_alpha is not None else 1.0 / math.sqrt(attention_dim)
        self.use_group_norm = use_group_norm
        self.recompute_normed_x = recompute_normed_x
        self.recompute_uvqk = recompute_uvqk
        self.recompute_y = recompute_y
        self.sort_by_length = sort_by_length
        self._contextual_seq_len = contextual_seq_len
        self.sla_k1 = sla_k1
        self.sla_k2 = sla_k2
        self.scaling_seqlen = scaling_seqlen
        self._backend = resolve_module_backend(backend, _LAYER_OPS)
        if self.uses_sla:
            attn_backend = self._backend
            reason = attn_backend.rejection("hstu_mha", {"attn_func": True})
            if reason is not None:
                raise ValueError(
                    f"sla_k1={sla_k1}, sla_k2={sla_k2} need arbitrary attention masks, but "
                    f"backend {attn_backend.name!r} cannot run them: {reason}"
                )

        h, a, v, e = num_heads, attention_dim, hidden_dim, embedding_dim
        kw = {"device": device, "dtype": torch.float32}
        self._uvqk_weight = nn.Parameter(torch.empty(e, (2 * v + 2 * a) * h, **kw))
        self._uvqk_beta = nn.Parameter(torch.zeros((2 * v + 2 * a) * h, **kw))
        self._input_norm_weight = nn.Parameter(torch.ones(e, **kw))
        self._input_norm_bias = nn.Parameter(torch.zeros(e, **kw))
        self._output_weight = nn.Parameter(torch.empty(3 * v * h, e, **kw))
        norm_dim = h if use_group_norm else v * h
        self._output_norm_weight = nn.Parameter(torch.ones(norm_dim, **kw))
        self._output_norm_bias = nn.Parameter(torch.zeros(norm_dim, **kw))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Xavier-uniform projections; norms at identity; zero UVQK bias."""
        if self._uvqk_weight.device.type == "meta":
            return
        nn.init.xavier_uniform_(self._uvqk_weight)
        nn.init.xavier_uniform_(self._output_weight)
        nn.init.zeros_(self._uvqk_beta)
        nn.init.ones_(self._input_norm_weight)
        nn.init.zeros_(self._input_norm_bias)
        nn.init.ones_(self._output_norm_weight)
        nn.init.zeros_(self._output_norm_bias)

    @property
    def contextual_seq_len(self) -> int:
        return self._contextual_seq_len

    @property
    def uses_sla(self) -> bool:
        return self.sla_k1 > 0 or self.sla_k2 > 0

    @property
    def attn_func_sig(self) -> Optional[str]:
        if not self.uses_sla:
            return None
        return ":".join(
            str(x)
            for x in (
                self.sla_k1,
                self.sla_k2,
                self._contextual_seq_len,
                self.num_heads,
                self.target_aware,
                self.max_attn_len,
                self.causal,
            )
        )

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
        """Keep ``[C | last min(U_b, tail) history tokens | all T_b targets]`` per sample.

        Args:
            x: [L, E]. x_offsets: [B + 1]. max_seq_len: upper bound on lengths.
            num_targets: [B] or None (everything after the prefix is history).
            truncate_tail_len: history tokens kept per sample.
            total_kept: rows after truncation (prefix included), from the caller; None
                lets :func:`compute_stu_truncation_plan` read the sizes (one host sync).
            new_max_seq_len: upper bound on the new lengths when ``total_kept`` is given
                (default: ``max_seq_len``).

        Returns:
            (x' [L', E], offsets' [B + 1], max_seq_len', plan).
        """
        plan = compute_stu_truncation_plan(
            x_offsets,
            num_targets,
            max_seq_len,
            truncate_tail_len=truncate_tail_len,
            contextual_seq_len=self._contextual_seq_len,
            total_len=x.shape[0],
            truncated_total_len=total_kept,
            truncated_max_seq_len=new_max_seq_len,
        )
        x = apply_stu_truncation_plan(x, plan, backend=self._backend)
        return x, plan.new_x_offsets, plan.new_max_seq_len, plan

    def _params(self, dtype: torch.dtype) -> Tuple[torch.Tensor, ...]:
        return tuple(
            p.to(dtype)
            for p in (
                self._uvqk_weight,
                self._uvqk_beta,
                self._input_norm_weight,
                self._input_norm_bias,
                self._output_weight,
                self._output_norm_weight,
                self._output_norm_bias,
            )
        )

    def _output(
        self,
        attn: torch.Tensor,
        u: torch.Tensor,
        x: torch.Tensor,
        params: Tuple[torch.Tensor, ...],
    ) -> torch.Tensor:
        return hstu_compute_output(
            attn=attn,
            u=u,
            x=x,
            norm_weight=params[5],
            norm_bias=params[6],
            norm_eps=_NORM_EPS,
            output_weight=params[4],
            num_heads=self.num_heads,
            linear_dim=self.hidden_dim,
            dropout_ratio=self.output_dropout_ratio,
            training=self.training,
            concat_ux=True,
            group_norm=self.use_group_norm,
            recompute_y_in_backward=self.recompute_y,
            backend=self._backend,
        )

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
        self._check_input(x, x_offsets, num_targets)
        targets = num_targets if self.target_aware else None
        attn_func = prev_attn_func
        if self.uses_sla:
            if prev_attn_func is None or prev_attn_func_sig != self.attn_func_sig:
                attn_func = build_sla_func_tensor(
                    nheads=self.num_heads,
                    sla_k1=self.sla_k1,
                    sla_k2=self.sla_k2,
                    seq_offsets=x_offsets,
                    total_q=x.size(0),
                    num_targets=targets,
                    contextual_seq_len=self._contextual_seq_len,
                    device=x.device,
                )
        params = self._params(x.dtype)
        u, attn, k, v = hstu_preprocess_and_attention(
            x=x,
            norm_weight=params[2],
            norm_bias=params[3],
            norm_eps=_NORM_EPS,
            num_heads=self.num_heads,
            attn_dim=self.attention_dim,
            hidden_dim=self.hidden_dim,
            uvqk_weight=params[0],
            uvqk_bias=params[1],
            max_seq_len=max_seq_len,
            seq_offsets=x_offsets,
            attn_alpha=self.attn_alpha,
            causal=self.causal,
            num_targets=targets,
            max_attn_len=self.max_attn_len,
            contextual_seq_len=self._contextual_seq_len,
            recompute_uvqk_in_backward=self.recompute_uvqk,
            recompute_normed_x_in_backward=self.recompute_normed_x,
            sort_by_length=self.sort_by_length,
            prefill=kv_caching_lengths is not None,
            attn_func=attn_func if self.uses_sla else None,
            scaling_seqlen=self.scaling_seqlen,
            backend=self._backend,
        )
        kv_cache = None
        if kv_caching_lengths is not None:
            if k is None or v is None:
                raise RuntimeError(
                    "hstu_preprocess_and_attention(prefill=True) returned no k/v; "
                    "the backend must materialize them for the KV cache"
                )
            kv_cache = self._prefix_cache(
                k.reshape(k.shape[0], -1),
                v.reshape(v.shape[0], -1),
                x_offsets,
                max_seq_len,
                kv_caching_lengths,
                max_kv_caching_len,
                total_kv_caching_len,
            )
        out = self._output(attn, u, x, params)
        return STUOutput(out, attn_func, kv_cache)

    def _prefix_cache(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        offsets: torch.Tensor,
        max_seq_len: int,
        kv_caching_lengths: torch.Tensor,
        max_kv_caching_len: int,
        total_kv_caching_len: Optional[int],
    ) -> KVCache:
        """Keep the first ``kv_caching_lengths[b]`` rows of k and v of each sample."""
        batch = offsets.numel() - 1
        if kv_caching_lengths.dim() != 1 or kv_caching_lengths.numel() != batch:
            raise ValueError(
                f"kv_caching_lengths must have shape [B] = [{batch}] (from the offsets), "
                f"got {tuple(kv_caching_lengths.shape)}"
            )
        if total_kv_caching_len is None:
            # from the host copy: none to read when the lengths came with to_device, else
            # one read shared with every later layer and op that sees these lengths (and
            # read before the offsets below are derived, so that they get a copy too)
            total_kv_caching_len = host_copy(kv_caching_lengths).stat("sum", _sum)
        cache_offsets = mirror(offsets_from_lengths, kv_caching_lengths)
        rest_offsets = mirror(_difference, offsets, cache_offsets)
        total = k.shape[0]
        caches = []
        for t in (k, v):
            kept, _ = split_2D_jagged(
                max_seq_len=max_seq_len,
                values=t,
                total_len_left=total_kv_caching_len,
                total_len_right=total - total_kv_caching_len,
                max_len_left=None,
                max_len_right=None,
                offsets_left=cache_offsets,
                offsets_right=rest_offsets,
                backend=self._backend,
            )
            caches.append(kept)
        return KVCache(caches[0], caches[1], cache_offsets, max_kv_caching_len or max_seq_len)

    def construct_full_kv(
        self, kv_cache: KVCache, delta_k: torch.Tensor, delta_v: torch.Tensor
    ) -> KVCache:
        """Append Δ new rows per sample to the cache: ``[cache_b ; delta_b]``.

        Args:
            kv_cache: the cache, B samples.
            delta_k: [B * Δ, H * A]. delta_v: [B * Δ, H * V].

        Returns:
            KVCache over ``n_b + Δ`` tokens per sample, ``max_len + Δ``.
        """
        batch = kv_cache.offsets.numel() - 1
        delta = delta_k.shape[0] // batch
        full = [
            concat_2D_jagged(
                values_left=cached,
                values_right=new,
                max_len_left=kv_cache.max_len,
                max_len_right=delta,
                offsets_left=kv_cache.offsets,
                offsets_right=None,
                backend=self._backend,
            )
            for cached, new in ((kv_cache.k, delta_k), (kv_cache.v, delta_v))
        ]
        offsets = mirror(_extended_offsets, kv_cache.offsets, delta)
        return KVCache(full[0], full[1], offsets, kv_cache.max_len + delta)

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
        """Run Δ new tokens per sample against ``kv_cache`` (forward only, inference).

        The new tokens are the last Δ tokens of each sample; they attend to the cache and,
        causally, to each other (or, when ``target_aware`` and they are targets, to the
        cache and themselves). SLA masks and truncation are not available here.

        Attention reads the cache where it lies and the Δ new keys/values from the UVQK
        projection (the split form of ``delta_hstu_mha``), so scoring costs one read of the
        cache per layer. ``update_cache=True`` also builds the returned cache
        ``[cache ; delta]``: a copy of the whole cache per layer (one more read and one
        write of it), which only decoding that rolls the cache forward needs.

        Args:
            delta_x (torch.Tensor): [B * Δ, E], Δ new tokens for each of the B samples.
            kv_cache (KVCache): this layer's cache for the same B samples.
            num_targets (torch.Tensor | None): [B] how many of the Δ tokens are targets.
            kv_caching_lengths (torch.Tensor | None): [B]; if given, the returned cache
                keeps only the first ``kv_caching_lengths[b]`` tokens of ``[cache ; delta]``.
            max_kv_caching_len (int): upper bound on ``kv_caching_lengths``; 0: full length.
            total_kv_caching_len (int | None): their sum; None takes it from their host copy
                (see "Sync-free steps" in the class docstring).
            update_cache (bool): build and return the extended cache. False (scoring
                candidates against a fixed history, the usual ranking case) returns None
                instead and never builds the extended cache. Default: True.

        Returns:
            (out [B * Δ, E], cache): ``cache`` is ``[cache ; delta]`` (or its trimmed prefix),
            or None when ``update_cache`` is False. Keep passing the old cache to score
            further tokens against the same history.
        """
        batch = kv_cache.offsets.numel() - 1
        if delta_x.dim() != 2 or delta_x.shape[-1] != self.embedding_dim:
            raise ValueError(
                f"delta_x must be [B * delta, embedding_dim={self.embedding_dim}], "
                f"got {tuple(delta_x.shape)}"
            )
        if batch <= 0 or delta_x.shape[0] % batch != 0:
            raise ValueError(
                f"delta_x.shape[0] ({delta_x.shape[0]}) must be a multiple of the cache's "
                f"batch size B ({batch}): every sample gets the same number of new tokens"
            )
        if self.uses_sla:
            raise NotImplementedError("cached_forward does not support SLA (sla_k1/sla_k2)")
        if self.scaling_seqlen == -1 and not tracing():
            warnings.warn(
                "STULayer.cached_forward with scaling_seqlen=-1 divides attention by the "
                "cache's max_len plus the new tokens, which is the full forward's divisor only "
                "when that forward's max_seq_len is exactly this; set scaling_seqlen (the "
                "models and a transducer built with max_uih_len do) for cached == full",
                stacklevel=2,
            )
        if num_targets is not None and num_targets.shape != (batch,):
            raise ValueError(
                f"num_targets must have shape [B] = [{batch}], got {tuple(num_targets.shape)}"
            )
        if kv_caching_lengths is not None and not update_cache:
            raise ValueError(
                "kv_caching_lengths trims the returned cache, but update_cache=False returns "
                "none; pass update_cache=True or leave kv_caching_lengths None"
            )
        params = self._params(delta_x.dtype)
        u, q, k, v = hstu_compute_uqvk(
            x=delta_x,
            norm_weight=params[2],
            norm_bias=params[3],
            norm_eps=_NORM_EPS,
            num_heads=self.num_heads,
            attn_dim=self.attention_dim,
            hidden_dim=self.hidden_dim,
            uvqk_weight=params[0],
            uvqk_bias=params[1],
            recompute_normed_x_in_backward=False,
            recompute_uvqk_in_backward=False,
            backend=self._backend,
        )
        rows = delta_x.shape[0]
        # the new keys/values as the cache stores them (no copy when the dtypes agree)
        new_k = k.to(kv_cache.k.dtype)
        new_v = v.to(kv_cache.v.dtype)
        attn = delta_hstu_mha(
            max_seq_len=kv_cache.max_len + rows // batch,
            alpha=self.attn_alpha,
            delta_q=q,
            k=kv_cache.k.view(-1, self.num_heads, self.attention_dim).to(q.dtype),
            v=kv_cache.v.view(-1, self.num_heads, self.hidden_dim).to(q.dtype),
            seq_offsets=kv_cache.offsets,
            num_targets=num_targets if self.target_aware else None,
            max_attn_len=self.max_attn_len,
            contextual_seq_len=self._contextual_seq_len,
            scaling_seqlen=self.scaling_seqlen,
            delta_k=new_k.to(q.dtype),
            delta_v=new_v.to(q.dtype),
            backend=self._backend,
        )
        out = self._output(attn.reshape(rows, -1), u, delta_x, params)
        if not update_cache:
            return out, None
        full = self.construct_full_kv(kv_cache, new_k.reshape(rows, -1), new_v.reshape(rows, -1))
        if kv_caching_lengths is not None:
            full = self._prefix_cache(
                full.k,
                full.v,
                full.offsets,
                full.max_len,
                kv_caching_lengths,
                max_kv_caching_len,
                total_kv_caching_len,
            )
        return out, full

    def _check_input(
        self,
        x: torch.Tensor,
        x_offsets: torch.Tensor,
        num_targets: Optional[torch.Tensor],
    ) -> None:
        if x.dim() != 2 or x.shape[1] != self.embedding_dim:
            raise ValueError(
                f"x must be [L, embedding_dim={self.embedding_dim}], got {tuple(x.shape)}"
            )
        if x_offsets.dim() != 1 or x_offsets.numel() < 1:
            raise ValueError(f"x_offsets must be [B + 1], got shape {tuple(x_offsets.shape)}")
        batch = x_offsets.numel() - 1
        if num_targets is not None and num_targets.shape != (batch,):
            raise ValueError(
                f"num_targets must have shape [B] = [{batch}] (B from x_offsets), "
                f"got {tuple(num_targets.shape)}"
            )


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
