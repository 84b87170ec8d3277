"""Per op: the inputs of one benchmark point and the public op called on a named backend.

Each builder takes a :class:`Inputs` (the point's sizes, index tensors and a seeded random
source) and a backend name, and returns a :class:`Case`. Every op is called through its
public function (``tzrec_ops.<op>``, value checks as set by the caller) with its index tensors
moved by ``tzrec_ops.to_device``, as a user calls it. Random inputs are small (``randn * 0.1``
or uniform in ``[-0.01, 0.01]`` for attention), so no op overflows in bf16.

:data:`CASES` maps every op name to its builder; ``sdpa`` (torch's
``scaled_dot_product_attention``) is the outside reference for attention, built by
:func:`sdpa_case` on a dense batch of the same token count.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Dict, List, Optional

import torch

import tzrec_ops
from tzrec_bench.benchmarks.opbench.shapes import JaggedBatch, Shape, attention_flops, gemm_flops

#: new tokens per sequence of ``delta_hstu_mha`` (the serving benchmarks' default)
DELTA_TOKENS = 8
#: right-hand rows per sequence of ``concat_2D_jagged`` / ``split_2D_jagged`` (candidates)
RIGHT_TOKENS = 16
#: the reference provider of the attention ops
SDPA = "sdpa"
ATTENTION_OPS = ("hstu_mha",)
#: ops without a backward (``delta_hstu_mha`` serves from a KV cache)
FORWARD_ONLY = ("delta_hstu_mha",)


@dataclass
class Case:
    """One op call ready to time.

    Attributes:
        call: ``call(*inputs)`` runs the op; returns a tensor or a tuple of tensors.
        inputs: the differentiable inputs (leaf tensors); the backward's gradients are theirs.
        flops: FLOPs of a mode (``"fwd"`` / ``"bwd"``), or ``None`` for a memory-bound op,
            reported in GB/s of its tensors instead.
        context: entered around every call (SDPA's kernel choice).
    """

    call: Callable[..., Any]
    inputs: List[torch.Tensor]
    flops: Optional[Callable[[str], float]] = None
    context: Callable[[], ContextManager] = field(default=contextlib.nullcontext)


class Inputs:
    """The sizes, device index tensors and seeded random tensors of one point."""

    def __init__(self, shape: Shape, batch: JaggedBatch, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.shape, self.host, self.dtype, self.device = shape, batch, dtype, device
        self.tokens = batch.tokens
        self.offsets = tzrec_ops.to_device(batch.offsets, device)
        self.lengths = tzrec_ops.to_device(batch.lengths, device)
        self.num_targets = tzrec_ops.to_device(batch.num_targets, device)
        self.timestamps = batch.timestamps.to(device)
        self.generator = torch.Generator(device).manual_seed(shape.seed)

    def rand(self, *size: int, grad: bool = True) -> torch.Tensor:
        """``randn * 0.1`` in the point's dtype, a leaf that requires grad."""
        t = torch.randn(*size, generator=self.generator, device=self.device, dtype=self.dtype) * 0.1
        return t.requires_grad_(grad)

    @property
    def uvqk_width(self) -> int:
        s = self.shape
        return s.heads * (2 * s.attn_dim + 2 * s.hidden_dim)


Builder = Callable[[Inputs, str], Case]


def _hstu_mha(x: Inputs, backend: str) -> Case:
    s = x.shape
    # q, k, v are leaf views of one fused buffer, as the STU layer's uvqk projection gives them
    buf = torch.empty(x.tokens, s.heads, 2 * s.attn_dim + s.hidden_dim, dtype=x.dtype,
                      device=x.device)
    buf.uniform_(-0.01, 0.01, generator=x.generator)
    q, k, v = (t.detach().requires_grad_() for t in torch.split(
        buf, [s.attn_dim, s.attn_dim, s.hidden_dim], dim=-1))

    def call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return tzrec_ops.hstu_mha(s.max_seq_len, 1.0 / s.attn_dim, q, k, v, x.offsets,
                                  num_targets=x.num_targets, sort_by_length=True,
                                  backend=backend)

    return Case(call, [q, k, v], lambda mode: attention_flops(
        x.host.lengths, s.heads, s.attn_dim, s.hidden_dim, mode))


def _delta_hstu_mha(x: Inputs, backend: str) -> Case:
    # the point's sequences are the caches; DELTA_TOKENS new queries (and keys/values) each
    s, d = x.shape, DELTA_TOKENS
    q = x.rand(s.batch * d, s.heads, s.attn_dim, grad=False)
    new_k = x.rand(s.batch * d, s.heads, s.attn_dim, grad=False)
    new_v = x.rand(s.batch * d, s.heads, s.hidden_dim, grad=False)
    k = x.rand(x.tokens, s.heads, s.attn_dim, grad=False)
    v = x.rand(x.tokens, s.heads, s.hidden_dim, grad=False)

    def call() -> torch.Tensor:
        return tzrec_ops.delta_hstu_mha(s.max_seq_len + d, 1.0 / s.attn_dim, q, k, v,
                                        x.offsets, delta_k=new_k, delta_v=new_v,
                                        backend=backend)

    # each new query attends to its cache and (causally) to the new tokens: ~ d (n + d) keys
    keys = float((x.host.lengths.double() + d).sum()) * d
    return Case(call, [], lambda mode: 2.0 * s.heads * (s.attn_dim + s.hidden_dim) * keys)


def _hstu_compute_uqvk(x: Inputs, backend: str) -> Case:
    s, w = x.shape, x.uvqk_width
    inputs = [x.rand(x.tokens, s.embedding), x.rand(s.embedding), x.rand(s.embedding),
              x.rand(s.embedding, w), x.rand(w)]

    def call(xs, nw, nb, uw, ub):  # type: ignore[no-untyped-def]
        return tzrec_ops.hstu_compute_uqvk(xs, nw, nb, 1e-5, s.heads, s.attn_dim,
                                           s.hidden_dim, uw, ub, backend=backend)

    return Case(call, inputs, lambda mode: gemm_flops(x.tokens, s.embedding, w, mode))


def _hstu_preprocess_and_attention(x: Inputs, backend: str) -> Case:
    s, w = x.shape, x.uvqk_width
    inputs = [x.rand(x.tokens, s.embedding), x.rand(s.embedding), x.rand(s.embedding),
              x.rand(s.embedding, w), x.rand(w)]

    def call(xs, nw, nb, uw, ub):  # type: ignore[no-untyped-def]
        return tzrec_ops.hstu_preprocess_and_attention(
            xs, nw, nb, 1e-5, s.heads, s.attn_dim, s.hidden_dim, uw, ub, s.max_seq_len,
            x.offsets, 1.0 / s.attn_dim, True, x.num_targets, 0, 0, False, False, True,
            backend=backend)

    return Case(call, inputs, lambda mode: gemm_flops(x.tokens, s.embedding, w, mode)
                + attention_flops(x.host.lengths, s.heads, s.attn_dim, s.hidden_dim, mode))


def _hstu_compute_output(x: Inputs, backend: str) -> Case:
    s = x.shape
    hv = s.heads * s.hidden_dim
    inputs = [x.rand(x.tokens, hv), x.rand(x.tokens, hv), x.rand(x.tokens, s.embedding),
              x.rand(hv), x.rand(hv), x.rand(hv, s.embedding)]

    def call(attn, u, xs, nw, nb, ow):  # type: ignore[no-untyped-def]
        return tzrec_ops.hstu_compute_output(attn, u, xs, nw, nb, 1e-5, ow, s.heads,
                                             s.hidden_dim, 0.1, True, False, False, False,
                                             backend=backend)

    return Case(call, inputs, lambda mode: gemm_flops(x.tokens, hv, s.embedding, mode))


def _addmm(x: Inputs, backend: str) -> Case:
    # the STU layer's uvqk projection: bias + tokens x embedding @ embedding x uvqk width
    s, w = x.shape, x.uvqk_width
    inputs = [x.rand(w), x.rand(x.tokens, s.embedding), x.rand(s.embedding, w)]
    return Case(lambda b, m1, m2: tzrec_ops.addmm(b, m1, m2, backend=backend), inputs,
                lambda mode: gemm_flops(x.tokens, s.embedding, w, mode))


def _jagged_dense_bmm_broadcast_add(x: Inputs, backend: str) -> Case:
    s = x.shape
    inputs = [x.rand(x.tokens, s.embedding), x.rand(s.batch, s.embedding, s.embedding),
              x.rand(s.batch, s.embedding)]

    def call(j, d, b):  # type: ignore[no-untyped-def]
        return tzrec_ops.jagged_dense_bmm_broadcast_add(s.max_seq_len, x.offsets, j, d, b,
                                                        backend=backend)

    return Case(call, inputs, lambda mode: gemm_flops(x.tokens, s.embedding, s.embedding, mode))


def _norm(op: str, params: int) -> Builder:
    """``layer_norm`` / ``swish_layer_norm`` (weight, bias) or ``rms_norm`` (weight)."""

    def build(x: Inputs, backend: str) -> Case:
        e = x.shape.embedding
        inputs = [x.rand(x.tokens, e)] + [x.rand(e) for _ in range(params)]
        fn = getattr(tzrec_ops, op)
        return Case(lambda *a: fn(*a, backend=backend), inputs)

    return build


def _layer_norm_mul_dropout(x: Inputs, backend: str) -> Case:
    hv = x.shape.heads * x.shape.hidden_dim
    inputs = [x.rand(x.tokens, hv), x.rand(x.tokens, hv), x.rand(hv), x.rand(hv)]
    return Case(lambda a, u, w, b: tzrec_ops.layer_norm_mul_dropout(
        a, u, w, b, 1e-5, 0.1, True, False, 7, backend=backend), inputs)


def _group_norm_mul_dropout(x: Inputs, backend: str) -> Case:
    s = x.shape
    hv = s.heads * s.hidden_dim
    inputs = [x.rand(x.tokens, hv), x.rand(x.tokens, hv), x.rand(s.heads), x.rand(s.heads)]
    return Case(lambda a, u, w, b: tzrec_ops.group_norm_mul_dropout(
        a, u, w, b, 1e-5, 0.1, True, s.heads, False, 7, backend=backend), inputs)


def _concat_2D_jagged(x: Inputs, backend: str) -> Case:
    s = x.shape
    inputs = [x.rand(x.tokens, s.embedding), x.rand(s.batch * RIGHT_TOKENS, s.embedding)]
    return Case(lambda a, b: tzrec_ops.concat_2D_jagged(
        a, b, s.max_seq_len, RIGHT_TOKENS, x.offsets, None, backend=backend), inputs)


def _split_2D_jagged(x: Inputs, backend: str) -> Case:
    s = x.shape
    inputs = [x.rand(x.tokens + s.batch * RIGHT_TOKENS, s.embedding)]
    return Case(lambda v: tzrec_ops.split_2D_jagged(
        s.max_seq_len + RIGHT_TOKENS, v, total_len_left=x.tokens, max_len_right=RIGHT_TOKENS,
        offsets_left=x.offsets, backend=backend), inputs)


def _add_positional_embeddings(x: Inputs, backend: str) -> Case:
    s = x.shape
    inputs = [x.rand(s.max_seq_len, s.embedding), x.rand(x.tokens, s.embedding)]
    return Case(lambda table, seq: tzrec_ops.add_positional_embeddings(
        0.5, s.max_seq_len, table, x.offsets, x.lengths, seq, x.num_targets, False,
        backend=backend), inputs)


def _add_timestamp_positional_embeddings(x: Inputs, backend: str) -> Case:
    s = x.shape
    inputs = [x.rand(s.max_seq_len + 1, s.embedding), x.rand(1001, s.embedding),
              x.rand(x.tokens, s.embedding)]
    return Case(lambda pos, time, seq: tzrec_ops.add_timestamp_positional_embeddings(
        0.5, s.max_seq_len, 0, pos, time, x.offsets, x.lengths, seq, x.timestamps,
        x.num_targets, False, "sqrt", 60.0, backend=backend), inputs)


CASES: Dict[str, Builder] = {
    "hstu_mha": _hstu_mha,
    "delta_hstu_mha": _delta_hstu_mha,
    "hstu_preprocess_and_attention": _hstu_preprocess_and_attention,
    "hstu_compute_uqvk": _hstu_compute_uqvk,
    "hstu_compute_output": _hstu_compute_output,
    "addmm": _addmm,
    "jagged_dense_bmm_broadcast_add": _jagged_dense_bmm_broadcast_add,
    "layer_norm": _norm("layer_norm", 2),
    "rms_norm": _norm("rms_norm", 1),
    "swish_layer_norm": _norm("swish_layer_norm", 2),
    "layer_norm_mul_dropout": _layer_norm_mul_dropout,
    "group_norm_mul_dropout": _group_norm_mul_dropout,
    "concat_2D_jagged": _concat_2D_jagged,
    "split_2D_jagged": _split_2D_jagged,
    "add_positional_embeddings": _add_positional_embeddings,
    "add_timestamp_positional_embeddings": _add_timestamp_positional_embeddings,
}
#: every op but attention: what an STU layer runs around it (``.ci/gpu-check`` times them
#: at the STU layer's shapes, B=64, N=2048)
STU_OPS = tuple(op for op in CASES if op not in ("hstu_mha", "delta_hstu_mha"))


def sdpa_case(x: Inputs) -> Case:
    """Causal ``scaled_dot_product_attention`` on ``round(tokens / N)`` dense sequences of
    length ``N``: the same token count as the jagged batch. On CUDA it is pinned to the flash
    kernel; elsewhere torch picks its kernel."""
    s = x.shape
    n = s.max_seq_len
    dense = max(1, round(x.tokens / n))
    q, k = (x.rand(dense, s.heads, n, s.attn_dim) for _ in range(2))
    v = x.rand(dense, s.heads, n, s.hidden_dim)
    context: Callable[[], ContextManager] = contextlib.nullcontext
    if x.device.type == "cuda":
        from torch.nn.attention import SDPBackend, sdpa_kernel

        def context() -> ContextManager:
            return sdpa_kernel([SDPBackend.FLASH_ATTENTION])

    def call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    lengths = torch.full((dense,), n)
    return Case(call, [q, k, v], lambda mode: attention_flops(
        lengths, s.heads, s.attn_dim, s.hidden_dim, mode), context=context)
