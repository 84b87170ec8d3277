"""Reference HSTU attention in plain torch: exact, differentiable, memory-bounded.

Legend: B = batch, L = total tokens, H = heads, A = q/k dim, V = value dim, N =
``max_seq_len``, R = query rows per sequence (N, or the delta size D for cached attention).

How it works:

1. q, k, v are padded from jagged ``[L, H, *]`` to ``[B, N, H, *]`` (fbgemm's
   ``jagged_to_padded_dense`` when ``torch.ops.fbgemm`` has it, else a gather) in the input
   dtype; padding is O(B N H D), never O(N^2).
2. The batch is processed in chunks of sequences and query rows so that one chunk's float32
   working set, its scores ``[b, H, r, N]`` plus its upcast keys and values
   ``[b, N, H, A + V]``, holds at most :func:`chunk_elements` entries. Each chunk upcasts to
   float32 (float64 for float64 input), computes ``SiLU(alpha q.k) / S``, applies the mask
   (and dropout), multiplies by v and casts the result back to the input dtype.
3. When autograd records the call and there is more than one chunk, each chunk runs under
   ``torch.utils.checkpoint`` so backward also keeps one chunk's scores alive at a time.
4. The padded output is turned back into jagged ``[L, H, V]``.

Traced with a symbolic batch size (``torch.export`` with a dynamic batch dim, bounded or
not), the chunking guards on no size: the whole batch is one chunk when the batch dim's
bound proves it fits; otherwise the graph loops over the sequences, one per chunk, with
torch's ``map`` operator (no checkpoint inside it; map's backward recomputes per sequence).
So the exported graph keeps the memory bound for every batch size it accepts.

Knobs (read at call time; under ``torch.compile``/``torch.export`` read once, while tracing):
``TZREC_OPS_PYTORCH_ATTN_CHUNK`` (max working-set elements per chunk, default ``2**28``,
i.e. 1 GiB of float32 per score-sized temporary) or :func:`set_chunk_elements`;
:func:`set_use_fbgemm` (``None`` = use fbgemm when it is installed).
"""

from __future__ import annotations

import functools
import os
from typing import Callable, Iterable, List, Optional, Tuple, Union

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from tzrec_ops.backends.pytorch._common import (
    HAS_FBGEMM,
    compute_dtype,
    jagged_to_padded,
    padded_to_jagged,
)
from tzrec_ops.backends.pytorch.jagged_2d import concat_2D_jagged
from tzrec_ops.jagged import lengths_from_offsets
from tzrec_ops.registry import assume_constant_result

__all__ = [
    "CHUNK_ENV",
    "chunk_elements",
    "delta_hstu_mha",
    "fbgemm_enabled",
    "hstu_mha",
    "set_chunk_elements",
    "set_use_fbgemm",
]

CHUNK_ENV = "TZREC_OPS_PYTORCH_ATTN_CHUNK"
DEFAULT_CHUNK_ELEMENTS = 1 << 28
# stands in for a symbolic size in _chunk_sizes: more than any chunk holds
_UNBOUNDED = 1 << 62

_chunk_elements_override: Optional[int] = None
_use_fbgemm_override: Optional[bool] = None


def set_chunk_elements(elements: Optional[int]) -> None:
    """Cap one chunk's working set at ``elements`` entries (``None``: env or default)."""
    global _chunk_elements_override
    if elements is not None and int(elements) < 1:
        raise ValueError(f"elements must be >= 1, got {elements}")
    _chunk_elements_override = None if elements is None else int(elements)


def set_use_fbgemm(enabled: Optional[bool]) -> None:
    """Force (``True``), forbid (``False``) or auto-detect (``None``) the fbgemm conversions."""
    global _use_fbgemm_override
    _use_fbgemm_override = enabled


@assume_constant_result
def chunk_elements() -> int:
    """The current cap on working-set elements (scores + upcast k, v) per chunk."""
    if _chunk_elements_override is not None:
        return _chunk_elements_override
    raw = os.environ.get(CHUNK_ENV, "")
    if not raw:
        return DEFAULT_CHUNK_ELEMENTS
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{CHUNK_ENV} must be a positive integer, got {raw!r}") from None
    if value < 1:
        raise ValueError(f"{CHUNK_ENV} must be a positive integer, got {raw!r}")
    return value


@assume_constant_result
def fbgemm_enabled() -> bool:
    """True when the fbgemm jagged/padded conversions will be used."""
    if _use_fbgemm_override is False:
        return False
    # decided once at import (a failed import of fbgemm_gpu is not cached by Python: trying
    # it on every call cost ~0.6 ms per attention call on the CPU)
    available = HAS_FBGEMM and hasattr(torch.ops.fbgemm, "dense_to_jagged")
    if _use_fbgemm_override and not available:
        raise RuntimeError("set_use_fbgemm(True) but fbgemm-gpu is not installed")
    return available


# ------------------------------------------------------------------------------------------
# masks
# ------------------------------------------------------------------------------------------


def _fixed_mask(
    rows: torch.Tensor,
    lengths: torch.Tensor,
    num_targets: Optional[torch.Tensor],
    func: Optional[torch.Tensor],
    *,
    max_len: int,
    causal: bool,
    max_attn_len: int,
    contextual_seq_len: int,
    min_full_attn_seq_len: int,
) -> torch.Tensor:
    """Valid ``[b, r, N]`` mask for query positions ``rows`` ``[b, r]`` of sequences of
    ``lengths`` ``[b]`` (spec §1.2 rules; ``func`` is unused)."""
    n = lengths[:, None, None]
    row = rows[:, :, None]
    col = torch.arange(max_len, device=rows.device)[None, None, :]
    row_id, col_id = row, col
    bound = n
    if contextual_seq_len > 0:
        row_id = torch.clamp(row - (contextual_seq_len - 1), min=0)
        col_id = torch.clamp(col - (contextual_seq_len - 1), min=0)
        bound = bound - (contextual_seq_len - 1)
    if num_targets is not None:
        bound = bound - num_targets[:, None, None]
        row_id = torch.minimum(row_id, bound)
        col_id = torch.minimum(col_id, bound)
    dist = row_id - col_id
    if not causal:
        dist = dist.abs()
    valid = (row == col) | (dist > 0)
    if max_attn_len > 0:
        in_window = dist <= max_attn_len
        if min_full_attn_seq_len > 0:
            in_window = in_window | (row_id >= bound - min_full_attn_seq_len)
        valid = valid & in_window
    if contextual_seq_len > 0:
        valid = valid | ((row_id == 0) & (col_id < bound))
    return valid & (col < n) & (row < n) & (row >= 0)


def _func_mask(
    rows: torch.Tensor,
    lengths: torch.Tensor,
    num_targets: Optional[torch.Tensor],
    func: torch.Tensor,
    *,
    max_len: int,
) -> torch.Tensor:
    """Valid ``[b, H, r, N]`` mask from padded ``attn_func`` rows ``[b, r, H, 3]`` (keys in
    ``[0, cmax0)`` or ``[cmin0, cmax1)``; ``num_targets`` is unused)."""
    n = lengths[:, None, None, None]
    bounds = func.permute(0, 2, 1, 3)[..., None, :].to(torch.int64)  # [b, H, r, 1, 3]
    col = torch.arange(max_len, device=func.device)[None, None, None, :]
    cmax0, cmin0, cmax1 = bounds[..., 0], bounds[..., 1], bounds[..., 2]
    visible = (col < cmax0) | ((col >= cmin0) & (col < cmax1))
    row_ok = (rows < lengths[:, None])[:, None, :, None]
    return visible & (col < n) & row_ok


# ------------------------------------------------------------------------------------------
# chunked attention
# ------------------------------------------------------------------------------------------


def _attend_chunk(
    mask_fn: Callable[..., torch.Tensor],
    alpha: float,
    scale: float,
    dropout_pr: float,
    training: bool,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    rows: torch.Tensor,
    lengths: torch.Tensor,
    num_targets: Optional[torch.Tensor],
    func: Optional[torch.Tensor],
) -> torch.Tensor:
    """One chunk: q ``[b, r, H, A]``, k ``[b, N, H, A]``, v ``[b, N, H, V]`` -> ``[b, r, H, V]``."""
    compute = compute_dtype(q.dtype)
    qc = q.to(compute).permute(0, 2, 1, 3)
    kc = k.to(compute).permute(0, 2, 3, 1)
    vc = v.to(compute).permute(0, 2, 1, 3)
    scores = torch.matmul(qc, kc) * alpha  # [b, H, r, N]
    valid = mask_fn(rows, lengths, num_targets, func)
    if valid.dim() == 3:
        valid = valid[:, None]
    weights = torch.where(valid, F.silu(scores), 0.0) / scale
    if dropout_pr > 0.0:
        weights = F.dropout(weights, p=dropout_pr, training=training)
    out = torch.matmul(weights, vc)  # [b, H, r, V]
    return out.permute(0, 2, 1, 3).to(v.dtype)


def _chunk_sizes(batch: int, rows: int, heads: int, max_len: int, kv_dim: int) -> Tuple[int, int]:
    """(sequences b, query rows r) per chunk so that ``b * H * N * (r + kv_dim)``, the scores
    plus the upcast keys and values (``kv_dim = A + V``), stays within chunk_elements().

    ``batch`` and ``rows`` cap the result; for a symbolic size (traced graph) the caller
    passes ``_UNBOUNDED``, since comparing with the symbol would guard on it."""
    budget = chunk_elements()
    per_row = max(1, heads * max_len)
    per_seq = per_row * kv_dim
    rows_per_chunk = max(1, min(rows, (budget - per_seq) // per_row))
    seqs_per_chunk = max(1, min(batch, budget // (per_seq + per_row * rows_per_chunk)))
    return seqs_per_chunk, rows_per_chunk


def _fits(size: Union[int, torch.SymInt], limit: int) -> bool:
    """True when ``size`` is at most ``limit`` for every value it can take: a plain compare
    in eager; for a traced size, true only if its bounds prove it, so no guard is added."""
    if isinstance(size, int):
        return size <= limit
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    return statically_known_true(size <= limit)


def _split(
    t: Optional[torch.Tensor], size: int, dim: int, count: int
) -> List[Optional[torch.Tensor]]:
    """``torch.split`` that yields ``count`` ``None``s for a missing tensor."""
    return [None] * count if t is None else list(torch.split(t, size, dim=dim))


def _attend_rows(
    body: Callable[..., torch.Tensor],
    row_block: int,
    recompute: bool,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    rows: torch.Tensor,
    lengths: torch.Tensor,
    num_targets: Optional[torch.Tensor],
    func: Optional[torch.Tensor],
) -> torch.Tensor:
    """``body`` over blocks of ``row_block`` query rows of one chunk of sequences, each block
    under ``checkpoint`` when ``recompute``."""
    if _fits(q.shape[1], row_block):
        blocks: Iterable[Tuple[Optional[torch.Tensor], ...]] = [(q, rows, func)]
    else:
        count = -(-q.shape[1] // row_block)  # ceil
        blocks = zip(*(_split(t, row_block, 1, count) for t in (q, rows, func)))
    pieces = []
    for q_r, rows_r, func_r in blocks:
        args = (q_r, k, v, rows_r, lengths, num_targets, func_r)
        pieces.append(checkpoint(body, *args, use_reentrant=False) if recompute else body(*args))
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=1)


def _map_over_sequences(
    attend: Callable[..., torch.Tensor], tensors: List[Optional[torch.Tensor]]
) -> torch.Tensor:
    """``attend`` one sequence at a time, for a traced graph whose batch size B is symbolic.

    Such a graph cannot loop a number of times that depends on B, so the sequences run under
    torch's ``map`` operator, a loop inside the graph (AOTInductor turns it into a while
    loop). A chunk is one sequence: any other chunk count would be a new size that export
    guards on (``count == 1`` when the example batch fits in one chunk)."""
    from torch._higher_order_ops.map import map_impl

    present = [i for i, t in enumerate(tensors) if t is not None]

    def attend_one(*xs: torch.Tensor) -> Tuple[torch.Tensor]:
        # map passes tensors only, without their batch dim: restore both
        args: List[Optional[torch.Tensor]] = [None] * len(tensors)
        for i, x in zip(present, xs):
            args[i] = x[None]
        # a tuple, so that map returns a sequence of outputs however it is traced
        return (attend(*args)[0],)

    return map_impl(attend_one, [tensors[i] for i in present], [])[0]


def _chunked_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    rows: torch.Tensor,
    lengths: torch.Tensor,
    num_targets: Optional[torch.Tensor],
    func: Optional[torch.Tensor],
    mask_fn: Callable[..., torch.Tensor],
    alpha: float,
    scale: float,
    dropout_pr: float,
    training: bool,
) -> torch.Tensor:
    """Padded attention ``[B, R, H, V]`` from q ``[B, R, H, A]``, k/v ``[B, N, H, *]``, query
    positions ``rows`` ``[B, R]`` and optional padded ``func`` ``[B, R, H, 3]``.

    B, and R for cached attention, are symbolic in a graph traced with dynamic shapes: the
    chunk sizes are then computed without them and compared with them only where the
    bounds decide, since any other compare would guard (specialise) on the symbol."""
    batch, num_rows, heads = q.shape[0], q.shape[1], q.shape[2]
    static_batch, static_rows = isinstance(batch, int), isinstance(num_rows, int)
    seqs, row_block = _chunk_sizes(
        batch if static_batch else _UNBOUNDED,
        num_rows if static_rows else _UNBOUNDED,
        heads,
        k.shape[1],
        k.shape[3] + v.shape[3],
    )
    if not static_rows and not _fits(num_rows, row_block):
        raise ValueError(
            f"the pytorch backend cannot trace cached attention whose new tokens per sequence "
            f"({num_rows}) may be more than the {row_block} query rows one chunk holds "
            f"(chunk_elements() = {chunk_elements()}): bound the new-token dim so that it "
            f"proves at most {row_block} per sequence, or raise the chunk budget ({CHUNK_ENV} "
            "or set_chunk_elements)"
        )
    body = functools.partial(_attend_chunk, mask_fn, alpha, scale, dropout_pr, training)
    tensors = [q, k, v, rows, lengths, num_targets, func]
    one_chunk = _fits(batch, seqs)
    if not one_chunk and not static_batch:
        # no checkpoint inside map (it cannot trace one); map's backward recomputes each
        # sequence from its inputs anyway
        return _map_over_sequences(functools.partial(_attend_rows, body, row_block, False), tensors)
    recompute = (
        not (one_chunk and _fits(num_rows, row_block))
        and torch.is_grad_enabled()
        and (q.requires_grad or k.requires_grad or v.requires_grad)
    )
    attend = functools.partial(_attend_rows, body, row_block, recompute)
    if one_chunk:
        return attend(*tensors)
    count = -(-batch // seqs)  # ceil
    chunks = zip(*(_split(t, seqs, 0, count) for t in tensors))
    return torch.cat([attend(*chunk) for chunk in chunks], dim=0)


def _scale(max_seq_len: int, scaling_seqlen: int) -> float:
    return float(max_seq_len if scaling_seqlen == -1 else scaling_seqlen)


# ------------------------------------------------------------------------------------------
# ops
# ------------------------------------------------------------------------------------------


def hstu_mha(
    max_seq_len: int,
    alpha: float,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    seq_offsets: torch.Tensor,
    causal: bool = True,
    dropout_pr: float = 0.0,
    training: bool = True,
    num_targets: Optional[torch.Tensor] = None,
    max_attn_len: int = 0,
    contextual_seq_len: int = 0,
    min_full_attn_seq_len: int = 0,
    sort_by_length: bool = False,
    attn_func: Optional[torch.Tensor] = None,
    scaling_seqlen: int = -1,
) -> torch.Tensor:
    """Jagged HSTU attention ``[L, H, V]`` (arguments as :func:`tzrec_ops.ops.hstu_attention.
    hstu_mha`; already validated). ``sort_by_length`` is ignored."""
    total = q.shape[0]
    lengths = lengths_from_offsets(seq_offsets).to(torch.int64)
    batch = lengths.shape[0]
    fbgemm = fbgemm_enabled()
    qp, kp, vp = (jagged_to_padded(t, seq_offsets, max_seq_len, fbgemm) for t in (q, k, v))
    rows = torch.arange(max_seq_len, device=q.device).expand(batch, max_seq_len)
    func = None
    if attn_func is not None:
        func = jagged_to_padded(attn_func.permute(2, 0, 1), seq_offsets, max_seq_len, fbgemm)
        mask_fn: Callable[..., torch.Tensor] = functools.partial(_func_mask, max_len=max_seq_len)
    else:
        mask_fn = functools.partial(
            _fixed_mask,
            max_len=max_seq_len,
            causal=causal,
            max_attn_len=max_attn_len,
            contextual_seq_len=contextual_seq_len,
            min_full_attn_seq_len=min_full_attn_seq_len,
        )
    targets = None if num_targets is None or attn_func is not None else num_targets.to(torch.int64)
    out = _chunked_attention(
        qp,
        kp,
        vp,
        rows,
        lengths,
        targets,
        func,
        mask_fn,
        alpha,
        _scale(max_seq_len, scaling_seqlen),
        dropout_pr,
        training,
    )
    return padded_to_jagged(out, seq_offsets, total, fbgemm)


def _append_new_tokens(
    cached: torch.Tensor, new: torch.Tensor, seq_offsets: torch.Tensor, delta: int
) -> torch.Tensor:
    """``[L, H, *]`` cached rows and ``[B * D, H, *]`` new rows -> ``[L + B * D, H, *]``, each
    sequence's cached rows followed by its D new rows."""
    rest = cached.shape[1:]
    full = concat_2D_jagged(
        cached.flatten(1),
        new.flatten(1),
        0,
        delta,
        offsets_left=seq_offsets,
    )
    return full.reshape(full.shape[0], *rest)


def delta_hstu_mha(
    max_seq_len: int,
    alpha: float,
    delta_q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    seq_offsets: torch.Tensor,
    num_targets: Optional[torch.Tensor] = None,
    max_attn_len: int = 0,
    contextual_seq_len: int = 0,
    scaling_seqlen: int = -1,
    *,
    delta_k: Optional[torch.Tensor] = None,
    delta_v: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Cached attention ``[B * D, H, V]`` for the last D positions of each sequence.

    With ``delta_k``/``delta_v`` (the split form) the full keys and values are built here
    by appending each sequence's D new rows to its cached rows: this backend is the oracle,
    so it computes the split form exactly as the concatenated one.

    Forward-only: it runs under ``torch.no_grad()``, so its output never requires grad.
    """
    with torch.no_grad():
        batch = seq_offsets.shape[0] - 1
        heads = delta_q.shape[1]
        if batch == 0:
            return v.new_zeros(0, heads, v.shape[2])
        delta = delta_q.shape[0] // batch
        if delta_k is not None and delta_v is not None:
            k = _append_new_tokens(k, delta_k, seq_offsets, delta)
            v = _append_new_tokens(v, delta_v, seq_offsets, delta)
            steps = torch.arange(batch + 1, device=seq_offsets.device, dtype=seq_offsets.dtype)
            seq_offsets = seq_offsets + steps * delta
        lengths = lengths_from_offsets(seq_offsets).to(torch.int64)
        qd = delta_q.reshape(batch, delta, heads, delta_q.shape[2])
        kp, vp = (jagged_to_padded(t, seq_offsets, max_seq_len, fbgemm_enabled()) for t in (k, v))
        rows = lengths[:, None] - delta + torch.arange(delta, device=k.device)[None, :]
        mask_fn = functools.partial(
            _fixed_mask,
            max_len=max_seq_len,
            causal=True,
            max_attn_len=max_attn_len,
            contextual_seq_len=contextual_seq_len,
            min_full_attn_seq_len=0,
        )
        targets = None if num_targets is None else num_targets.to(torch.int64)
        out = _chunked_attention(
            qd,
            kp,
            vp,
            rows,
            lengths,
            targets,
            None,
            mask_fn,
            alpha,
            _scale(max_seq_len, scaling_seqlen),
            0.0,
            False,
        )
        return out.reshape(batch * delta, heads, v.shape[2])
