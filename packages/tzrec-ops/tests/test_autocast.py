"""``torch.autocast``: the matrix-product ops run in the autocast dtype on every backend.

Under ``torch.autocast("cpu", dtype=torch.bfloat16)`` each op gets float32 inputs and must
return what it computes from their bfloat16 roundings (checked against the float64 oracle,
the pytorch backend on float64 copies, with the bfloat16 tolerance), with gradients reaching
the float32 leaves in float32. Outside autocast, and for float64 inputs, nothing is cast.
"""

from __future__ import annotations

import importlib.util
from typing import Any, Callable, Dict, Tuple

import pytest
import torch

from tzrec_ops.jagged import offsets_from_lengths
from tzrec_ops.ops.hstu_attention import delta_hstu_mha, hstu_mha
from tzrec_ops.ops.hstu_compute import (
    hstu_compute_output,
    hstu_compute_uqvk,
    hstu_preprocess_and_attention,
)
from tzrec_ops.ops.jagged_2d import jagged_dense_bmm_broadcast_add
from tzrec_ops.ops.mm import addmm
from tzrec_ops.testing.tolerances import assert_close

LOW = torch.bfloat16
LENGTHS = [3, 5]
TOTAL = sum(LENGTHS)
H, A, V, E = 2, 4, 4, 8

# serving-only op: no autograd formula
NO_GRADIENT = {"delta_hstu_mha"}
BACKENDS = ["pytorch"] + (["triton"] if importlib.util.find_spec("triton") else [])


def _floats(seed: int, **shapes: Tuple[int, ...]) -> Dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {name: torch.randn(*shape, generator=g) * 0.5 for name, shape in shapes.items()}


def _offsets() -> torch.Tensor:
    return offsets_from_lengths(LENGTHS)


def _attention_options() -> Dict[str, Any]:
    return dict(max_seq_len=max(LENGTHS), alpha=0.5, seq_offsets=_offsets(), num_targets=None)


# op name -> (call(kwargs, backend), float inputs)
CASES: Dict[str, Tuple[Callable[..., Any], Callable[[], Dict[str, torch.Tensor]]]] = {
    "addmm": (
        lambda kw, backend: addmm(**kw, backend=backend),
        lambda: _floats(0, input=(5,), mat1=(7, 6), mat2=(6, 5)),
    ),
    "hstu_mha": (
        lambda kw, backend: hstu_mha(**kw, **_attention_options(), backend=backend),
        lambda: _floats(1, q=(TOTAL, H, A), k=(TOTAL, H, A), v=(TOTAL, H, V)),
    ),
    "delta_hstu_mha": (
        lambda kw, backend: delta_hstu_mha(
            **kw, **{**_attention_options(), "max_seq_len": max(LENGTHS) + 1}, backend=backend
        ),
        lambda: _floats(
            2, delta_q=(2, H, A), k=(TOTAL, H, A), v=(TOTAL, H, V), delta_k=(2, H, A),
            delta_v=(2, H, V),
        ),
    ),
    "jagged_dense_bmm_broadcast_add": (
        lambda kw, backend: jagged_dense_bmm_broadcast_add(
            max_seq_len=max(LENGTHS), seq_offsets=_offsets(), **kw, backend=backend
        ),
        lambda: _floats(3, jagged=(TOTAL, 4), dense=(2, 4, 3), bias=(2, 3)),
    ),
    "hstu_compute_uqvk": (
        lambda kw, backend: hstu_compute_uqvk(
            norm_eps=1e-5, num_heads=H, attn_dim=A, hidden_dim=V, **kw, backend=backend
        ),
        lambda: _floats(
            4, x=(TOTAL, E), norm_weight=(E,), norm_bias=(E,), uvqk_weight=(E, 2 * H * (A + V)),
            uvqk_bias=(2 * H * (A + V),),
        ),
    ),
    "hstu_compute_output": (
        lambda kw, backend: hstu_compute_output(
            norm_eps=1e-5, num_heads=H, linear_dim=V, dropout_ratio=0.0, training=False,
            concat_ux=False, group_norm=False, recompute_y_in_backward=False, **kw,
            backend=backend,
        ),
        lambda: _floats(
            5, attn=(TOTAL, H * V), u=(TOTAL, H * V), x=(TOTAL, E), norm_weight=(H * V,),
            norm_bias=(H * V,), output_weight=(H * V, E),
        ),
    ),
    "hstu_preprocess_and_attention": (
        lambda kw, backend: hstu_preprocess_and_attention(
            norm_eps=1e-5, num_heads=H, attn_dim=A, hidden_dim=V, max_seq_len=max(LENGTHS),
            seq_offsets=_offsets(), attn_alpha=0.5, causal=True, num_targets=None,
            max_attn_len=0, contextual_seq_len=0, recompute_uvqk_in_backward=False,
            recompute_normed_x_in_backward=False, sort_by_length=False, **kw, backend=backend,
        ),
        lambda: _floats(
            6, x=(TOTAL, E), norm_weight=(E,), norm_bias=(E,), uvqk_weight=(E, 2 * H * (A + V)),
            uvqk_bias=(2 * H * (A + V),),
        ),
    ),
}


def _tensors(out: Any) -> Tuple[torch.Tensor, ...]:
    items = out if isinstance(out, tuple) else (out,)
    return tuple(t for t in items if isinstance(t, torch.Tensor))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("op", list(CASES))
def test_autocast_computes_in_the_autocast_dtype(op: str, backend: str) -> None:
    call, make = CASES[op]
    leaves = {name: t.requires_grad_() for name, t in make().items()}
    with torch.autocast("cpu", dtype=LOW):
        got = _tensors(call(leaves, backend))
    oracle = _tensors(call({n: t.detach().to(LOW).double() for n, t in leaves.items()}, "pytorch"))
    for i, (actual, expected) in enumerate(zip(got, oracle)):
        assert actual.dtype == LOW, f"{op} output {i} is {actual.dtype} under autocast"
        assert_close(actual, expected, LOW, name=f"{op} output {i}")
    if op in NO_GRADIENT:
        return
    sum(t.float().sum() for t in got).backward()
    for name, leaf in leaves.items():
        assert leaf.grad is not None, f"{op}: no gradient reached {name}"
        assert leaf.grad.dtype == torch.float32, f"{op}: {name}.grad is {leaf.grad.dtype}"


@pytest.mark.parametrize("op", list(CASES))
def test_nothing_is_cast_outside_autocast_or_for_float64(op: str) -> None:
    call, make = CASES[op]
    inputs = make()
    assert {t.dtype for t in _tensors(call(inputs, "pytorch"))} == {torch.float32}
    doubles = {n: t.double() for n, t in inputs.items()}
    with torch.autocast("cpu", dtype=LOW):
        assert {t.dtype for t in _tensors(call(doubles, "pytorch"))} == {torch.float64}
