"""Random jagged batches for tests, and hypothesis strategies that cover their edge cases.

Legend: B = batch, L = total tokens (sum of lengths), H = heads, A = attention (q/k) dim,
V = value dim.

Layouts of the generated value tensors (``layout=``):

* ``"contiguous"``: a plain contiguous tensor;
* ``"fused"``: q, k and v are slices of one ``[L, H, 2A + V]`` buffer (row and head strides
  larger than the shape, last dimension contiguous), as an STU layer produces them;
* ``"strided"``: the last dimension is not contiguous (``stride(-1) > 1``), built as a
  transposed view of a ``[L, D, H]`` buffer.

Everything here is deterministic given ``seed``; the generators run on the CPU and then move
the tensors to ``device`` so a seed gives the same data on every device.
"""

from __future__ import annotations

import dataclasses
from typing import Any, List, Optional, Sequence, Tuple

import torch

from tzrec_ops.jagged import offsets_from_lengths

LAYOUTS = ("contiguous", "fused", "strided")
OFFSET_DTYPES = (torch.int32, torch.int64)


def random_lengths(batch: int, max_len: int, seed: int = 0, min_len: int = 0) -> List[int]:
    """``batch`` lengths uniform in ``[min_len, max_len]``."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(min_len, max_len + 1, (batch,), generator=g).tolist()


def random_num_targets(
    lengths: Sequence[int], max_targets: int, seed: int = 0, min_targets: int = 0
) -> List[int]:
    """Per-sequence target counts in ``[min_targets, max_targets]``, each capped at its length."""
    g = torch.Generator().manual_seed(seed + 7919)
    out = []
    for n in lengths:
        hi = min(max_targets, n)
        lo = min(min_targets, hi)
        out.append(int(torch.randint(lo, hi + 1, (1,), generator=g)))
    return out


def random_values(
    total: int,
    trailing: Sequence[int],
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    device: torch.device | str = "cpu",
    layout: str = "contiguous",
    scale: float = 1.0,
) -> torch.Tensor:
    """A ``[total, *trailing]`` tensor of ``scale * N(0, 1)`` values, in the given layout.

    ``"fused"`` returns a slice of a wider buffer along the last dimension; ``"strided"``
    (needs a 2-D ``trailing``) returns a view whose last dimension has stride > 1.
    """
    _check_layout(layout)
    g = torch.Generator().manual_seed(seed)
    shape = (total, *trailing)
    if layout == "strided" and len(trailing) < 2:
        raise ValueError(f"layout 'strided' needs >= 2 trailing dims, got {tuple(trailing)}")
    if layout == "contiguous":
        return _draw(shape, g, scale, dtype, device)
    if layout == "fused":
        wide = _draw((*shape[:-1], shape[-1] + 3), g, scale, dtype, device)
        return wide[..., 1 : 1 + shape[-1]]
    swapped = (*shape[:-2], shape[-1], shape[-2])
    return _draw(swapped, g, scale, dtype, device).transpose(-1, -2)


def _draw(
    shape: Sequence[int],
    g: torch.Generator,
    scale: float,
    dtype: torch.dtype,
    device: torch.device | str,
) -> torch.Tensor:
    """A contiguous ``scale * N(0, 1)`` tensor drawn in float64 on the CPU, then cast."""
    x = torch.randn(tuple(shape), generator=g, dtype=torch.float64) * scale
    return x.to(device=device, dtype=dtype)


def _check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")


@dataclasses.dataclass
class AttentionInputs:
    """One jagged attention batch: q, k ``[L, H, A]``, v ``[L, H, V]``, offsets ``[B + 1]``."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    seq_offsets: torch.Tensor
    num_targets: Optional[torch.Tensor]
    lengths: List[int]
    max_seq_len: int

    def tensors(self) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.q, self.k, self.v

    def to(self, dtype: torch.dtype, requires_grad: bool = False) -> "AttentionInputs":
        """Copies of q, k, v in ``dtype`` (e.g. float64 for the oracle), same offsets."""
        q, k, v = (
            t.detach().to(dtype).requires_grad_(requires_grad) for t in (self.q, self.k, self.v)
        )
        return dataclasses.replace(self, q=q, k=k, v=v)


def make_attention_inputs(
    lengths: Sequence[int],
    heads: int,
    attn_dim: int,
    hidden_dim: int,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    device: torch.device | str = "cpu",
    layout: str = "contiguous",
    num_targets: Optional[Sequence[int]] = None,
    offsets_dtype: torch.dtype = torch.int64,
    max_seq_len: Optional[int] = None,
    scale: float = 1.0,
) -> AttentionInputs:
    """Random q, k, v for the jagged batch of ``lengths``.

    ``layout="fused"`` slices q, k, v out of one ``[L, H, 2A + V]`` buffer; ``"strided"``
    gives each a non-contiguous last dimension. ``max_seq_len`` defaults to
    ``max(1, max(lengths))``.
    """
    _check_layout(layout)
    if num_targets is not None:
        if len(num_targets) != len(lengths):
            raise ValueError(
                f"num_targets has {len(num_targets)} entries but lengths has {len(lengths)}"
            )
        for n, t in zip(lengths, num_targets):
            if not 0 <= t <= n:
                raise ValueError(
                    f"num_targets {list(num_targets)} must lie in [0, lengths {list(lengths)}]"
                )
    total = int(sum(lengths))
    if layout == "fused":
        g = torch.Generator().manual_seed(seed)
        buf = _draw((total, heads, 2 * attn_dim + hidden_dim), g, scale, dtype, device)
        q, k, v = torch.split(buf, [attn_dim, attn_dim, hidden_dim], dim=-1)
    else:
        q = random_values(total, (heads, attn_dim), dtype, seed, device, layout, scale)
        k = random_values(total, (heads, attn_dim), dtype, seed + 1, device, layout, scale)
        v = random_values(total, (heads, hidden_dim), dtype, seed + 2, device, layout, scale)
    targets = (
        None
        if num_targets is None
        else torch.as_tensor(list(num_targets), dtype=offsets_dtype, device=device)
    )
    if max_seq_len is None:
        max_seq_len = max([1, *lengths])
    return AttentionInputs(
        q=q,
        k=k,
        v=v,
        seq_offsets=offsets_from_lengths(lengths, offsets_dtype).to(device),
        num_targets=targets,
        lengths=list(lengths),
        max_seq_len=max_seq_len,
    )


# --------------------------------------------------------------------------------------------
# hypothesis strategies (hypothesis is a test dependency: imported only when these are called)
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class JaggedCase:
    """A drawn jagged batch shape: lengths, optional targets, offsets dtype and layout."""

    lengths: Tuple[int, ...]
    num_targets: Optional[Tuple[int, ...]]
    offsets_dtype: torch.dtype
    layout: str


def lengths_strategy(max_batch: int = 4, max_len: int = 16, min_batch: int = 1) -> Any:
    """Lists of lengths, each often 0 or 1 (the edge cases), otherwise in ``[0, max_len]``."""
    from hypothesis import strategies as st

    one = st.one_of(st.sampled_from([0, 1, max_len]), st.integers(0, max_len))
    return st.lists(one, min_size=min_batch, max_size=max_batch)


def num_targets_strategy(lengths: Sequence[int]) -> Any:
    """Per-sequence target counts in ``[0, n]``, often exactly ``n`` (all targets) or 1."""
    from hypothesis import strategies as st

    per_seq = [st.one_of(st.just(n), st.just(min(1, n)), st.integers(0, n)) for n in lengths]
    return st.tuples(*per_seq)


def jagged_cases(
    max_batch: int = 4,
    max_len: int = 16,
    min_batch: int = 1,
    targets: Optional[bool] = None,
    layouts: Sequence[str] = LAYOUTS,
) -> Any:
    """:class:`JaggedCase` draws: edge-case lengths, targets (``None`` = sometimes), offsets
    dtype int32 or int64, and one of ``layouts``."""
    from hypothesis import strategies as st

    for layout in layouts:
        _check_layout(layout)

    @st.composite
    def draw_case(draw: Any) -> JaggedCase:
        lengths = tuple(draw(lengths_strategy(max_batch, max_len, min_batch)))
        with_targets = draw(st.booleans()) if targets is None else targets
        nt = tuple(draw(num_targets_strategy(lengths))) if with_targets else None
        return JaggedCase(
            lengths=lengths,
            num_targets=nt,
            offsets_dtype=draw(st.sampled_from(OFFSET_DTYPES)),
            layout=draw(st.sampled_from(list(layouts))),
        )

    return draw_case()


def float_dtypes_strategy(
    dtypes: Sequence[torch.dtype] = (torch.float32, torch.bfloat16, torch.float16),
) -> Any:
    """One of ``dtypes`` (fp32, bf16, fp16 by default)."""
    from hypothesis import strategies as st

    return st.sampled_from(list(dtypes))
