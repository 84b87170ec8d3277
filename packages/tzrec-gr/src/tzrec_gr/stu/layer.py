"""One STU layer: :class:`STULayer`, its full, truncated and cached (KV cache) forwards.

Shapes use the legend of :mod:`tzrec_gr.stu`.
"""

from __future__ import annotations

import math
import warnings
from typing import Optional, Tuple

import torch
from torch import nn

from tzrec_gr._backend import BackendArg, resolve_module_backend
from tzrec_gr.stu.interface import STU, STUOutput
from tzrec_gr.stu.kv_cache import KVCache, append_to_kv_cache, prefix_kv_cache
from tzrec_ops import (
    STUTruncationPlan,
    apply_stu_truncation_plan,
    build_sla_func_tensor,
    compute_stu_truncation_plan,
    delta_hstu_mha,
    hstu_compute_output,
    hstu_compute_uqvk,
    hstu_preprocess_and_attention,
)
from tzrec_ops.jagged import tracing

__all__ = ["STULayer"]

_NORM_EPS = 1e-6
_LAYER_OPS = (
    "hstu_compute_uqvk",
    "hstu_mha",
    "hstu_compute_output",
    "delta_hstu_mha",
    "split_2D_jagged",
    "concat_2D_jagged",
)


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
            kv_cache = prefix_kv_cache(
                k.reshape(k.shape[0], -1),
                v.reshape(v.shape[0], -1),
                x_offsets,
                max_seq_len,
                kv_caching_lengths,
                max_kv_caching_len,
                total_kv_caching_len,
                self._backend,
            )
        out = self._output(attn, u, x, params)
        return STUOutput(out, attn_func, kv_cache)

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
        full = append_to_kv_cache(
            kv_cache, new_k.reshape(rows, -1), new_v.reshape(rows, -1), self._backend
        )
        if kv_caching_lengths is not None:
            full = prefix_kv_cache(
                full.k,
                full.v,
                full.offsets,
                full.max_len,
                kv_caching_lengths,
                max_kv_caching_len,
                total_kv_caching_len,
                self._backend,
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
