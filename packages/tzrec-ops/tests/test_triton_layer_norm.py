"""Triton norms (layer, RMS, swish, norm-mul-dropout, group variant) against the float64 oracle.

The oracle is the pytorch backend on float64 copies. CPU runs use the Triton interpreter at
small shapes; ``pytest -m gpu`` repeats them at real sizes. Dropout cannot match another
backend's mask, so it is checked by its contract: a seed replays the same mask, the keep rate
is about 1 - p, kept entries equal the no-dropout value / (1 - p), and gradients flow only
through kept entries.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
else:
    # correctness does not depend on the tile config; tuning every GEMM key costs minutes
    os.environ.setdefault("TZREC_OPS_TRITON_AUTOTUNE", "0")

import pytest  # noqa: E402

from tzrec_ops.ops import layer_norm as N  # noqa: E402
from tzrec_ops.testing.tolerances import assert_close  # noqa: E402

pytest.importorskip("triton")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _inputs(shapes, dtype, seed, fp32_params=()):
    """Float64 base tensors -> (backend inputs in dtype, float64 oracle of the same values)."""
    g = torch.Generator().manual_seed(seed)
    base = [
        None if s is None else torch.randn(*s, generator=g, dtype=torch.float64) for s in shapes
    ]
    got, ref = [], []
    for i, t in enumerate(base):
        if t is None:
            got.append(None)
            ref.append(None)
            continue
        dt = torch.float32 if i in fp32_params else dtype
        got.append(t.to(DEVICE, dt).requires_grad_())
        ref.append(t.to(dt).to(DEVICE, torch.float64).requires_grad_())
    return got, ref, g


def _compare(fn, shapes, dtype, seed=0, fp32_params=()):
    got, ref, g = _inputs(shapes, dtype, seed, fp32_params)
    out = fn(*got, backend="triton")
    expected = fn(*ref, backend="pytorch")
    assert out.dtype == dtype
    assert_close(out, expected, dtype, name="y")
    dy = (
        torch.randn(out.shape, generator=g, dtype=torch.float64).to(dtype).to(DEVICE, torch.float64)
    )
    out.backward(dy.to(dtype))
    expected.backward(dy)
    for i, (a, b) in enumerate(zip(got, ref)):
        if a is not None:
            assert a.grad.dtype == a.dtype
            assert_close(
                a.grad,
                b.grad,
                a.dtype if a.dtype != torch.float32 else dtype,
                grad=True,
                name=f"grad of input {i}",
            )


SHAPES = [(13, 40), (1, 64), (0, 24), (6, 7)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,dim", SHAPES)
@pytest.mark.parametrize("affine", ["both", "weight", "none"])
def test_layer_norm(rows, dim, affine, dtype):
    shapes = [
        (rows, dim),
        (dim,) if affine != "none" else None,
        (dim,) if affine == "both" else None,
    ]
    _compare(
        lambda x, w, b, backend: N.layer_norm(x, w, b, 1e-5, backend=backend),
        shapes,
        dtype,
        fp32_params=(1, 2),
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,dim", SHAPES)
def test_rms_norm(rows, dim, dtype):
    _compare(
        lambda x, w, backend: N.rms_norm(x, w, 1e-6, backend=backend),
        [(rows, dim), (dim,)],
        dtype,
        fp32_params=(1,),
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,dim", SHAPES)
def test_swish_layer_norm(rows, dim, dtype):
    _compare(
        lambda x, w, b, backend: N.swish_layer_norm(x, w, b, 1e-5, backend=backend),
        [(rows, dim), (dim,), (dim,)],
        dtype,
        fp32_params=(1, 2),
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("concat_ux", [False, True])
@pytest.mark.parametrize("rows,heads,dim", [(11, 1, 40), (9, 4, 12), (0, 2, 8), (5, 3, 5)])
def test_norm_mul_without_dropout(rows, heads, dim, concat_ux, dtype):
    d = heads * dim

    def layer(x, u, w, b, backend):
        return N.layer_norm_mul_dropout(x, u, w, b, 1e-5, 0.3, False, concat_ux, backend=backend)

    def group(x, u, w, b, backend):
        return N.group_norm_mul_dropout(
            x, u, w, b, 1e-5, 0.3, False, heads, concat_ux, backend=backend
        )

    _compare(layer, [(rows, d), (rows, d), (d,), (d,)], dtype)
    _compare(group, [(rows, d), (rows, d), (heads,), (heads,)], dtype, seed=1)


def _dropout_call(kind, x, u, w, b, p, seed, concat_ux, heads, backend="triton"):
    if kind == "layer":
        return N.layer_norm_mul_dropout(x, u, w, b, 1e-5, p, True, concat_ux, seed, backend=backend)
    return N.group_norm_mul_dropout(
        x, u, w, b, 1e-5, p, True, heads, concat_ux, seed, backend=backend
    )


@pytest.mark.parametrize("kind", ["layer", "group"])
@pytest.mark.parametrize("concat_ux", [False, True])
def test_dropout_contract(kind, concat_ux):
    rows, heads, dim, p = 48, 2, 32, 0.25
    d = heads * dim
    wshape = (d,) if kind == "layer" else (heads,)
    got, ref, g = _inputs([(rows, d), (rows, d), wshape, wshape], torch.float32, 3)
    out = _dropout_call(kind, *got, p, 1234, concat_ux, heads)
    again = _dropout_call(kind, *[t.detach() for t in got], p, 1234, concat_ux, heads)
    other = _dropout_call(kind, *[t.detach() for t in got], p, 99, concat_ux, heads)
    assert torch.equal(out, again)
    assert not torch.equal(out, other)
    plain = _dropout_call(kind, *ref, 0.0, None, concat_ux, heads, backend="pytorch")
    kept = out.detach() != 0
    rate = kept.double().mean().item()
    assert abs(rate - (1 - p)) < 0.03, rate
    expected = torch.where(kept, plain / (1 - p), torch.zeros_like(plain))
    assert_close(out, expected, torch.float32, name="dropped y")
    dy = torch.randn(out.shape, generator=g, dtype=torch.float64).to(DEVICE)
    out.backward(dy.float())
    expected.backward(dy)
    for i, (a, b) in enumerate(zip(got, ref)):
        assert_close(a.grad, b.grad, torch.float32, grad=True, name=f"grad of input {i}")


def test_dropout_seed_none_draws_from_torch_generator():
    got, _, _ = _inputs([(8, 16), (8, 16), (16,), (16,)], torch.float32, 0)
    got = [t.detach() for t in got]
    torch.manual_seed(7)
    first = _dropout_call("layer", *got, 0.5, None, False, 1)
    torch.manual_seed(7)
    second = _dropout_call("layer", *got, 0.5, None, False, 1)
    assert torch.equal(first, second)
    assert (first == 0).any()


def test_feature_dim_too_large_raises_before_launch():
    x = torch.randn(1, 20000, device=DEVICE)
    with pytest.raises(ValueError, match="feature dim 20000 is too large"):
        N.layer_norm(x, None, None, backend="triton")


def test_bad_weight_shape_names_argument():
    x = torch.randn(3, 8, device=DEVICE)
    with pytest.raises(ValueError, match=r"weight.shape\[0\] \(4\) must equal x.shape\[1\] \(8\)"):
        N.layer_norm(x, torch.ones(4, device=DEVICE), None, backend="triton")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_norms_gpu_real_sizes(dtype):
    rows = 20011
    for dim in (512, 200):
        _compare(
            lambda x, w, b, backend: N.layer_norm(x, w, b, 1e-6, backend=backend),
            [(rows, dim), (dim,), (dim,)],
            dtype,
            fp32_params=(1, 2),
        )
        _compare(
            lambda x, w, backend: N.rms_norm(x, w, 1e-6, backend=backend),
            [(rows, dim), (dim,)],
            dtype,
            fp32_params=(1,),
        )
        _compare(
            lambda x, w, b, backend: N.swish_layer_norm(x, w, b, 1e-6, backend=backend),
            [(rows, dim), (dim,), (dim,)],
            dtype,
            fp32_params=(1, 2),
        )
    for concat_ux in (False, True):
        _compare(
            lambda x, u, w, b, backend, c=concat_ux: N.layer_norm_mul_dropout(
                x, u, w, b, 1e-5, 0.0, True, c, backend=backend
            ),
            [(rows, 512), (rows, 512), (512,), (512,)],
            dtype,
        )
        _compare(
            lambda x, u, w, b, backend, c=concat_ux: N.group_norm_mul_dropout(
                x, u, w, b, 1e-5, 0.0, True, 4, c, backend=backend
            ),
            [(rows, 512), (rows, 512), (4,), (4,)],
            dtype,
        )


@pytest.mark.gpu
def test_norms_gpu_compile_and_opcheck():
    from tzrec_ops.backends.triton.layer_norm import layer_norm_op, norm_mul_dropout_op

    x = torch.randn(300, 96, device="cuda", requires_grad=True)
    u = torch.randn(300, 96, device="cuda", requires_grad=True)
    w = torch.randn(96, device="cuda", requires_grad=True)
    b = torch.randn(96, device="cuda", requires_grad=True)

    def f(x, u, w, b):
        y = N.layer_norm(x, w, b, backend="triton")
        return N.layer_norm_mul_dropout(y, u, w, b, 1e-5, 0.1, True, True, 5, backend="triton")

    out = torch.compile(f, fullgraph=True)(x, u, w, b)
    out.sum().backward()
    torch.testing.assert_close(out, f(x, u, w, b))
    torch.library.opcheck(layer_norm_op.op, (x, w, b, 1e-5))
    torch.library.opcheck(norm_mul_dropout_op.op, (x, u, w, b, 1e-5, 0, True, 0.1, 5))
