"""torch.export of the pytorch attention with a dynamic batch size, bounded or not.

Regression: the chunking compared the symbolic batch size with the chunk size (Python
``min``), a guard that ``Dim("B", max=64)`` violates ("Constraints violated (B)") and that
``Dim.AUTO`` silently turned into a program for the example's batch size only. Now the whole
batch is one chunk when its bound proves that it fits, and otherwise the graph maps over
the sequences; either way it accepts every batch size in the dim's range.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence, Tuple

import pytest
import torch
from _delta_split import split_cached
from torch.export import Dim

from tzrec_ops.backends.pytorch import hstu_attention as reference
from tzrec_ops.ops.hstu_attention import delta_hstu_mha, hstu_mha
from tzrec_ops.testing.generators import make_attention_inputs

MAX_LEN = 16
# H = 2, N = 16, A + V = 8: one sequence's upcast k, v take 256 elements, each query row 32;
# this budget holds one sequence and a few rows per chunk
ONE_SEQUENCE = 400
# one sequence and 64 query rows: new tokens bounded by 64 per batch fit one chunk
ONE_SEQUENCE_64_ROWS = 256 + 32 * 64
EXAMPLE = [9, 0, 14, 3]
OTHERS = [[5, 16], [1, 2, 3, 4, 5, 6, 7], [16] * 9]

Args = Tuple[torch.Tensor, ...]


@pytest.fixture(autouse=True)
def _default_budget():
    yield
    reference.set_chunk_elements(None)


class _Attention(torch.nn.Module):
    def forward(self, q, k, v, seq_offsets, num_targets):  # type: ignore[no-untyped-def]
        return hstu_mha(
            MAX_LEN,
            0.5,
            q,
            k,
            v,
            seq_offsets,
            num_targets=num_targets,
            max_attn_len=3,
            contextual_seq_len=2,
            backend="pytorch",
        )


class _DeltaAttention(torch.nn.Module):
    def forward(self, delta_q, k, v, seq_offsets, delta_k, delta_v):  # type: ignore[no-untyped-def]
        return delta_hstu_mha(
            MAX_LEN,
            0.5,
            delta_q,
            k,
            v,
            seq_offsets,
            delta_k=delta_k,
            delta_v=delta_v,
            backend="pytorch",
        )


def _args(lengths: Sequence[int], seed: int = 0) -> Args:
    inp = make_attention_inputs(
        lengths, 2, 4, 4, seed=seed, max_seq_len=MAX_LEN, num_targets=[n // 3 for n in lengths]
    )
    return (*inp.tensors(), inp.seq_offsets, inp.num_targets)


def _delta_args(lengths: Sequence[int], seed: int = 0) -> Args:
    inp = make_attention_inputs(lengths, 2, 4, 4, seed=seed, max_seq_len=MAX_LEN)
    return split_cached(inp, 2)[:6]


def _dims(kind: str) -> Tuple[Any, Any]:
    """(batch, tokens) dims of this kind."""
    if kind == "bounded":
        return Dim("batch", min=1, max=64), Dim("tokens", max=64 * MAX_LEN)
    unbounded = Dim.DYNAMIC if kind == "dynamic" else Dim.AUTO
    return unbounded, unbounded


def _shapes(kind: str) -> Tuple[Any, ...]:
    batch, tokens = _dims(kind)
    offsets = batch + 1 if kind == "bounded" else batch
    return ({0: tokens}, {0: tokens}, {0: tokens}, {0: offsets}, {0: batch})


def _maps(program: torch.export.ExportedProgram) -> bool:
    return any(node.target is torch.ops.higher_order.map_impl for node in program.graph.nodes)


@pytest.mark.parametrize("budget", [None, ONE_SEQUENCE], ids=["default", "one-sequence"])
@pytest.mark.parametrize("kind", ["bounded", "dynamic", "auto"])
def test_hstu_mha_exports_with_a_dynamic_batch(kind: str, budget: Optional[int]):
    reference.set_chunk_elements(budget)
    program = torch.export.export(_Attention(), _args(EXAMPLE), dynamic_shapes=_shapes(kind))
    # a bounded batch that fits one chunk needs no loop; any other batch does
    assert _maps(program) == (budget is not None or kind != "bounded")
    others = OTHERS + [[7]] if kind == "bounded" else OTHERS  # DYNAMIC / AUTO assume B >= 2
    for seed, lengths in enumerate(others):
        args = _args(lengths, seed)
        torch.testing.assert_close(program.module()(*args), _Attention()(*args))


def test_mapped_program_saves_and_loads(tmp_path):
    reference.set_chunk_elements(ONE_SEQUENCE)
    program = torch.export.export(_Attention(), _args(EXAMPLE), dynamic_shapes=_shapes("dynamic"))
    torch.export.save(program, str(tmp_path / "attention.pt2"))
    loaded = torch.export.load(str(tmp_path / "attention.pt2"))
    args = _args(OTHERS[1], seed=3)
    torch.testing.assert_close(loaded.module()(*args), _Attention()(*args))


def test_delta_hstu_mha_exports_with_a_dynamic_batch():
    """Cached attention: B and the new tokens per sequence (delta_q's rows // B) are both
    symbolic; the bounds prove that a sequence's new tokens fit one chunk."""
    reference.set_chunk_elements(ONE_SEQUENCE_64_ROWS)
    batch, cached = Dim("batch", min=1, max=64), Dim("cached", max=64 * MAX_LEN)
    new = Dim("new", max=64)
    shapes = ({0: new}, {0: cached}, {0: cached}, {0: batch + 1}, {0: new}, {0: new})
    example = _delta_args(EXAMPLE[:1] + EXAMPLE[2:])
    program = torch.export.export(_DeltaAttention(), example, dynamic_shapes=shapes)
    assert _maps(program)
    for seed, lengths in enumerate([[2, 16], [3, 4, 5, 6, 7, 8, 9]]):
        args = _delta_args(lengths, seed)
        torch.testing.assert_close(program.module()(*args), _DeltaAttention()(*args))


def test_delta_export_with_unbounded_new_tokens_is_a_clear_error():
    batch, tokens = _dims("dynamic")
    shapes = ({0: tokens}, {0: tokens}, {0: tokens}, {0: batch}, {0: tokens}, {0: tokens})
    with pytest.raises(ValueError, match="cannot trace cached attention whose new tokens per"):
        torch.export.export(_DeltaAttention(), _delta_args([5, 3, 9]), dynamic_shapes=shapes)
