"""Independent float64 oracles for every non-attention op (addmm, norms, jagged, position,
hstu_compute, truncation).

Written from the reference spec and deliberately unlike the pytorch backend: sequences are
walked one at a time with Python ints from the offsets, norms use explicit mean/variance,
and nothing is padded or gathered with computed index tensors. Inputs are converted to
float64; every tensor op is a float64 torch op, so ``torch.autograd`` differentiates the
oracle (use it for backward checks). Small shapes only.

Legend: B = batch, L = total rows, D = features, H = heads, A = q/k dim, V = value dim,
T = targets of a sequence, C = contextual prefix length.
"""

from __future__ import annotations

import math
from typing import List, Optional, Sequence, Tuple

import torch

F64 = torch.float64


def spans(offsets: torch.Tensor) -> List[Tuple[int, int]]:
    """``[(start, end)]`` of every sequence, as Python ints."""
    o = [int(v) for v in offsets.tolist()]
    return list(zip(o[:-1], o[1:]))


def dense_spans(batch: int, max_len: int) -> List[Tuple[int, int]]:
    """Spans of a dense side: ``max_len`` rows per sequence."""
    return [(b * max_len, (b + 1) * max_len) for b in range(batch)]


def _f64(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    return None if t is None else t.to(F64)


# ------------------------------------------------------------------------------ addmm, norms


def addmm(input: torch.Tensor, mat1: torch.Tensor, mat2: torch.Tensor) -> torch.Tensor:
    """Row by row: ``out[i] = input(+[i]) + sum_k mat1[i, k] * mat2[k]``."""
    a, b, c = _f64(mat1), _f64(mat2), _f64(input)
    rows = [(a[i].unsqueeze(1) * b).sum(0) for i in range(a.shape[0])]
    prod = torch.stack(rows) if rows else a.new_zeros(0, b.shape[1])
    return prod + c


def _standardize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """(x - mean) / sqrt(biased var + eps) along the last dim."""
    mean = x.sum(-1, keepdim=True) / x.shape[-1]
    centered = x - mean
    var = (centered * centered).sum(-1, keepdim=True) / x.shape[-1]
    return centered / torch.sqrt(var + eps)


def layer_norm(
    x: torch.Tensor,
    weight: Optional[torch.Tensor] = None,
    bias: Optional[torch.Tensor] = None,
    eps: float = 1e-5,
) -> torch.Tensor:
    y = _standardize(_f64(x), eps)
    if weight is not None:
        y = y * _f64(weight)
    if bias is not None:
        y = y + _f64(bias)
    return y


def rms_norm(
    x: torch.Tensor, weight: Optional[torch.Tensor] = None, eps: float = 1e-5
) -> torch.Tensor:
    x = _f64(x)
    y = x / torch.sqrt((x * x).sum(-1, keepdim=True) / x.shape[-1] + eps)
    return y if weight is None else y * _f64(weight)


def swish_layer_norm(
    x: torch.Tensor,
    weight: Optional[torch.Tensor] = None,
    bias: Optional[torch.Tensor] = None,
    eps: float = 1e-5,
) -> torch.Tensor:
    normed = layer_norm(x, weight, bias, eps)
    return _f64(x) / (1.0 + torch.exp(-normed))


def norm_mul(
    x: torch.Tensor,
    u: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    eps: float,
    concat_ux: bool = False,
    num_heads: Optional[int] = None,
) -> torch.Tensor:
    """``u * norm(x)`` (``[u | x | u * norm(x)]`` with concat_ux), without dropout.

    ``num_heads`` set: each head's V = D / H features are normalised on their own and scaled
    by that head's scalar weight and bias.
    """
    x, u = _f64(x), _f64(u)
    if num_heads is None:
        normed = layer_norm(x, weight, bias, eps)
    else:
        v = x.shape[1] // num_heads
        w, b = _f64(weight), _f64(bias)
        heads = [
            _standardize(x[:, h * v : (h + 1) * v], eps) * w[h] + b[h] for h in range(num_heads)
        ]
        normed = torch.cat(heads, dim=1)
    y = u * normed
    return torch.cat([u, x, y], dim=1) if concat_ux else y


# ------------------------------------------------------------------------------ jagged


def concat_2D_jagged(
    values_left: torch.Tensor,
    values_right: torch.Tensor,
    spans_left: Sequence[Tuple[int, int]],
    spans_right: Sequence[Tuple[int, int]],
) -> torch.Tensor:
    """Sequence by sequence: its left rows, then its right rows."""
    parts = []
    for (ls, le), (rs, re) in zip(spans_left, spans_right):
        parts += [values_left[ls:le], values_right[rs:re]]
    if not parts:
        return torch.cat([values_left, values_right])
    return torch.cat(parts)


def split_2D_jagged(
    values: torch.Tensor, lengths_left: Sequence[int], lengths_right: Sequence[int]
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Walk the rows: each sequence gives its first ``lengths_left[b]`` rows to the left."""
    left, right, row = [], [], 0
    for nl, nr in zip(lengths_left, lengths_right):
        left.append(values[row : row + nl])
        right.append(values[row + nl : row + nl + nr])
        row += nl + nr
    empty = values[:0]
    return torch.cat([empty, *left]), torch.cat([empty, *right])


def jagged_dense_bmm_broadcast_add(
    seq_offsets: torch.Tensor, jagged: torch.Tensor, dense: torch.Tensor, bias: torch.Tensor
) -> torch.Tensor:
    j, d, b = _f64(jagged), _f64(dense), _f64(bias)
    outs = [j[s:e] @ d[i] + b[i] for i, (s, e) in enumerate(spans(seq_offsets))]
    return torch.cat([j.new_zeros(0, d.shape[2]), *outs])


# ------------------------------------------------------------------------------ position


def _history_end(n: int, targets: Optional[int], interleave: bool) -> int:
    if targets is None:
        return n
    return n - targets * (2 if interleave else 1)


def add_positional_embeddings(
    alpha: float,
    table: torch.Tensor,
    seq_offsets: torch.Tensor,
    x: torch.Tensor,
    num_targets: Optional[Sequence[int]],
    interleave_targets: bool,
) -> torch.Tensor:
    """Token p of a sequence gets row ``min(p, history end, K - 1)``."""
    x, table = _f64(x), _f64(table)
    rows = []
    for b, (s, e) in enumerate(spans(seq_offsets)):
        t = None if num_targets is None else int(num_targets[b])
        high = min(_history_end(e - s, t, interleave_targets), table.shape[0] - 1)
        for p in range(e - s):
            rows.append(alpha * x[s + p] + table[min(p, high)])
    return torch.stack(rows) if rows else alpha * x[:0] + table[:0]


def timestamp_bucket(query_time: float, ts: float, fn: str, increments: float, top: int) -> int:
    """Python-math bucket of one token."""
    g = max(query_time - ts, 1e-6) / increments
    g = math.sqrt(g) if fn == "sqrt" else math.log(g)
    return int(min(max(g, 0.0), float(top)))


def timestamp_position(p: int, high: int, contextual: int, rows: int) -> int:
    """Position row of token p: p in the prefix, else counted back from the history end."""
    pos = p if p < contextual else high - min(p, high) + contextual
    return min(pos, rows - 1)


def add_timestamp_positional_embeddings(
    alpha: float,
    max_contextual_seq_len: int,
    pos_table: torch.Tensor,
    ts_table: torch.Tensor,
    seq_offsets: torch.Tensor,
    x: torch.Tensor,
    timestamps: torch.Tensor,
    num_targets: Optional[Sequence[int]],
    interleave_targets: bool,
    time_bucket_fn: str,
    time_bucket_increments: float,
    query_time: Optional[Sequence[float]] = None,
) -> torch.Tensor:
    x, pos_table, ts_table = _f64(x), _f64(pos_table), _f64(ts_table)
    ts = timestamps.tolist()
    rows = []
    for b, (s, e) in enumerate(spans(seq_offsets)):
        t = None if num_targets is None else int(num_targets[b])
        high = _history_end(e - s, t, interleave_targets)
        for p in range(e - s):
            qt = ts[e - 1] if query_time is None else query_time[b]
            pos = timestamp_position(p, high, max_contextual_seq_len, pos_table.shape[0])
            bucket = timestamp_bucket(
                qt, ts[s + p], time_bucket_fn, time_bucket_increments, ts_table.shape[0] - 1
            )
            rows.append(alpha * x[s + p] + pos_table[pos] + ts_table[bucket])
    return torch.stack(rows) if rows else alpha * x[:0] + pos_table[:0] + ts_table[:0]


# ------------------------------------------------------------------------------ hstu_compute


def hstu_compute_uqvk(
    x: torch.Tensor,
    norm_weight: torch.Tensor,
    norm_bias: torch.Tensor,
    norm_eps: float,
    num_heads: int,
    attn_dim: int,
    hidden_dim: int,
    uvqk_weight: torch.Tensor,
    uvqk_bias: torch.Tensor,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(SiLU(u) [L, HV], q [L, H, A], k [L, H, A], v [L, H, V]) from columns [u | v | q | k]."""
    normed = layer_norm(x, norm_weight, norm_bias, norm_eps)
    uvqk = addmm(uvqk_bias, normed, uvqk_weight)
    hv, ha = num_heads * hidden_dim, num_heads * attn_dim
    u = uvqk[:, :hv]
    u = u / (1.0 + torch.exp(-u))
    v = uvqk[:, hv : 2 * hv].reshape(-1, num_heads, hidden_dim)
    q = uvqk[:, 2 * hv : 2 * hv + ha].reshape(-1, num_heads, attn_dim)
    k = uvqk[:, 2 * hv + ha :].reshape(-1, num_heads, attn_dim)
    return u, q, k, v


def hstu_compute_output(
    attn: torch.Tensor,
    u: torch.Tensor,
    x: torch.Tensor,
    norm_weight: torch.Tensor,
    norm_bias: torch.Tensor,
    norm_eps: float,
    output_weight: torch.Tensor,
    num_heads: int,
    concat_ux: bool,
    group_norm: bool,
) -> torch.Tensor:
    """``x + norm_mul(attn, u) @ W`` without dropout."""
    y = norm_mul(
        attn, u, norm_weight, norm_bias, norm_eps, concat_ux, num_heads if group_norm else None
    )
    return addmm(x, y, output_weight)


# ------------------------------------------------------------------------------ truncation


def reference_stu_truncation(
    lengths: Sequence[int],
    num_targets: Optional[Sequence[int]],
    contextual_seq_len: int,
    truncate_tail_len: int,
) -> Tuple[List[int], List[int]]:
    """(new lengths, kept row indices of the flat batch) for the truncation rule.

    Per sequence ``[C | history | targets]``: keep the prefix, the newest
    ``truncate_tail_len`` history rows and every target.
    """
    new_lengths, kept, start = [], [], 0
    for b, n in enumerate(lengths):
        t = 0 if num_targets is None else num_targets[b]
        history = n - contextual_seq_len - t
        keep_from = contextual_seq_len + max(history - truncate_tail_len, 0)
        rows = list(range(start, start + contextual_seq_len)) + list(
            range(start + keep_from, start + n)
        )
        kept += rows
        new_lengths.append(len(rows))
        start += n
    return new_lengths, kept


# ------------------------------------------------------------------------------ comparison


def f64_copies(*tensors: Optional[torch.Tensor]) -> List[Optional[torch.Tensor]]:
    """Detached float64 copies that require grad (``None`` stays ``None``)."""
    return [None if t is None else t.detach().to(F64).requires_grad_(True) for t in tensors]


def assert_fwd_bwd(
    out: torch.Tensor,
    expected: torch.Tensor,
    inputs: Sequence[torch.Tensor],
    oracle_inputs: Sequence[torch.Tensor],
    names: Sequence[str],
    dtype: torch.dtype,
    seed: int = 0,
) -> None:
    """Forward and gradients of a backend run in ``dtype`` vs the float64 oracle.

    The same random upstream gradient (drawn in ``out``'s dtype) is fed to both; the
    tolerances are :mod:`tzrec_ops.testing.tolerances`' for ``dtype``.
    """
    from tzrec_ops.testing.tolerances import assert_close

    assert_close(out, expected, dtype=dtype, name="forward")
    # offset the seed: a dout drawn like an input (same seed) can sit in the op's null space
    g = torch.Generator().manual_seed(seed + 1_000_003)
    dout = torch.randn(out.shape, generator=g, dtype=F64).to(out.dtype)
    grads = torch.autograd.grad(out, inputs, dout, allow_unused=True, materialize_grads=True)
    ref = torch.autograd.grad(
        expected, oracle_inputs, dout.to(F64), allow_unused=True, materialize_grads=True
    )
    for name, got, want in zip(names, grads, ref):
        # a gradient stored in a coarser dtype than ``dtype`` (fp32 weights of a float64
        # run, bf16 weights of an fp32 run) is held to that dtype's tolerance
        coarser = got.dtype if torch.finfo(got.dtype).eps > torch.finfo(dtype).eps else dtype
        assert_close(got, want, dtype=coarser, grad=True, name=f"d{name}")
