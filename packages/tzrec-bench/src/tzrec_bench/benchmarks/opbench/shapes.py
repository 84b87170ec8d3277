"""The benchmark batch of every op, and the FLOP formulas of architecture §6.

One :class:`Shape` describes an STU layer's batch: ``batch`` sequences with lengths uniform
in ``[0.9 N, N)`` (``N = max_seq_len``), ``num_targets`` uniform in ``[1, 20]`` (at most the
length), ``heads`` heads of query/key dim ``attn_dim`` and value dim ``hidden_dim``, and
``embedding`` wide token embeddings. Attention takes q, k, v from it; the other ops take the
tensors an STU layer hands them (``tokens x embedding`` inputs, the ``uvqk`` projection of
width ``heads * (2 attn_dim + 2 hidden_dim)``, ...).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict

import torch

from tzrec_ops.jagged import offsets_from_lengths


@dataclass(frozen=True)
class Shape:
    """The sizes of one benchmark point (see the module docstring)."""

    batch: int
    max_seq_len: int
    heads: int
    attn_dim: int
    hidden_dim: int
    embedding: int
    seed: int = 1001

    def describe(self) -> Dict[str, int]:
        """The sizes as CSV columns."""
        return {
            "batch": self.batch, "max_seq_len": self.max_seq_len, "heads": self.heads,
            "attn_dim": self.attn_dim, "hidden_dim": self.hidden_dim,
            "embedding": self.embedding,
        }


@dataclass(frozen=True)
class JaggedBatch:
    """Host (CPU) index tensors of one batch; move them with ``tzrec_ops.to_device``."""

    lengths: torch.Tensor  # [batch] int64
    num_targets: torch.Tensor  # [batch] int64, in [1, length]
    offsets: torch.Tensor  # [batch + 1] int64
    timestamps: torch.Tensor  # [tokens] int64, increasing within a sequence

    @property
    def tokens(self) -> int:
        return int(self.offsets[-1])


def jagged_batch(shape: Shape) -> JaggedBatch:
    """The lengths, targets, offsets and timestamps of ``shape``, seeded by ``shape.seed``."""
    g = torch.Generator().manual_seed(shape.seed)
    n = shape.max_seq_len
    lengths = torch.randint(int(0.9 * n), n, (shape.batch,), generator=g)  # needs n >= 2
    targets = torch.minimum(torch.randint(1, 21, (shape.batch,), generator=g), lengths)
    offsets = offsets_from_lengths(lengths)
    steps = torch.randint(0, 86400, (int(offsets[-1]),), generator=g)
    return JaggedBatch(lengths, targets, offsets, torch.cumsum(steps, 0))


def attention_flops(lengths: torch.Tensor, heads: int, attn_dim: int, hidden_dim: int,
                    mode: str) -> float:
    """Causal attention FLOPs over sequences of ``lengths``: per sequence of length ``n``,
    forward ``H (A + V) n^2``, backward ``H n^2 (3A + 2V)`` (architecture §6)."""
    squares = float((lengths.double() ** 2).sum())
    if mode == "fwd":
        return heads * (attn_dim + hidden_dim) * squares
    return heads * (3 * attn_dim + 2 * hidden_dim) * squares


def gemm_flops(rows: int, inner: int, cols: int, mode: str) -> float:
    """``[rows, inner] @ [inner, cols]``: ``2 rows inner cols`` forward, twice that backward
    (one GEMM for each input's gradient)."""
    forward = 2.0 * rows * inner * cols
    return forward if mode == "fwd" else 2.0 * forward
