"""Norms and norm-mul-dropout: pytorch backend vs the float64 oracle, dropout semantics,
gradcheck, compile/export and argument errors."""

from __future__ import annotations

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from tzrec_ops.ops.layer_norm import (
    group_norm_mul_dropout,
    layer_norm,
    layer_norm_mul_dropout,
    rms_norm,
    swish_layer_norm,
)
from tzrec_ops.testing import ops_oracle as oracle
from tzrec_ops.testing.generators import random_values

SETTINGS = settings(max_examples=25, deadline=None, derandomize=True)
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
PT = "pytorch"


def _degenerate(name: str, features: int) -> bool:
    """A layer norm over 2 features (or an RMS norm over 1) outputs ~+-1 whatever x: its dx
    is eps-sized cancellation that float32 rounding swamps, so the oracle comparison of
    gradients is meaningless there. The sweeps skip these shapes; the forward of them is
    checked in test_degenerate_dims_forward."""
    return features == (1 if name == "rms_norm" else 2)


def _x(rows, dim, dtype, seed=0, strided=False):
    if strided:  # last dimension not contiguous
        return random_values(dim, (rows,), dtype, seed).t().requires_grad_()
    return random_values(rows, (dim,), dtype, seed).requires_grad_()


def _params(dim, dtype, seed, present=(True, True)):
    w = random_values(dim, (), dtype, seed + 10, scale=0.5) + 1.0 if present[0] else None
    b = random_values(dim, (), dtype, seed + 11, scale=0.5) if present[1] else None
    return [None if t is None else t.detach().requires_grad_() for t in (w, b)]


NORMS = {
    "layer_norm": (lambda x, w, b, eps: layer_norm(x, w, b, eps, backend=PT), oracle.layer_norm),
    "swish_layer_norm": (
        lambda x, w, b, eps: swish_layer_norm(x, w, b, eps, backend=PT),
        oracle.swish_layer_norm,
    ),
    "rms_norm": (
        lambda x, w, b, eps: rms_norm(x, w, eps, backend=PT),
        lambda x, w, b, eps: oracle.rms_norm(x, w, eps),
    ),
}


def _check_norm(name, rows, dim, dtype, param_dtype, present, seed=0, strided=False, eps=1e-5):
    run, ref = NORMS[name]
    x = _x(rows, dim, dtype, seed, strided)
    w, b = _params(dim, param_dtype, seed, present)
    if name == "rms_norm":
        b = None
    out = run(x, w, b, eps)
    assert out.dtype == dtype and out.shape == (rows, dim)
    pairs = [(n, t) for n, t in (("x", x), ("weight", w), ("bias", b)) if t is not None]
    inputs = [t for _, t in pairs]
    ref_in = oracle.f64_copies(*inputs)
    by_name = dict(zip([n for n, _ in pairs], ref_in))
    expected = ref(by_name["x"], by_name.get("weight"), by_name.get("bias"), eps)
    oracle.assert_fwd_bwd(out, expected, inputs, ref_in, [n for n, _ in pairs], dtype, seed)


@pytest.mark.parametrize("name", list(NORMS))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, dim", [(37, 33), (0, 16), (1, 8)])
def test_norm_matches_oracle(name, dtype, rows, dim):
    # fp32 parameters with low-precision activations, as the STU uses them
    _check_norm(name, rows, dim, dtype, torch.float32, (True, True))


@SETTINGS
@given(
    name=st.sampled_from(list(NORMS)),
    rows=st.integers(0, 40),
    dim=st.integers(1, 48),
    dtype=st.sampled_from(DTYPES[:3]),
    same_param_dtype=st.booleans(),
    present=st.tuples(st.booleans(), st.booleans()),
    strided=st.booleans(),
    eps=st.sampled_from([1e-5, 1e-6]),
    seed=st.integers(0, 1000),
)
def test_norm_sweep(name, rows, dim, dtype, same_param_dtype, present, strided, eps, seed):
    assume(not _degenerate(name, dim))
    param_dtype = dtype if same_param_dtype else torch.float32
    _check_norm(name, rows, dim, dtype, param_dtype, present, seed, strided, eps)


def _mul_inputs(rows, heads, head_dim, dtype, group, seed=0, strided=False):
    dim = heads * head_dim
    x = _x(rows, dim, dtype, seed, strided)
    u = _x(rows, dim, dtype, seed + 1, strided)
    param_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    w, b = _params(heads if group else dim, param_dtype, seed, (True, True))
    return x, u, w, b


def _run_mul(x, u, w, b, group, heads, p, training, concat_ux, seed=None, eps=1e-5):
    if group:
        return group_norm_mul_dropout(
            x, u, w, b, eps, p, training, heads, concat_ux, seed, backend=PT
        )
    return layer_norm_mul_dropout(x, u, w, b, eps, p, training, concat_ux, seed, backend=PT)


def _check_mul(
    rows, heads, head_dim, dtype, group, concat_ux, seed=0, strided=False, p=0.0, training=False
):
    x, u, w, b = _mul_inputs(rows, heads, head_dim, dtype, group, seed, strided)
    out = _run_mul(x, u, w, b, group, heads, p, training, concat_ux, seed=seed)
    width = heads * head_dim * (3 if concat_ux else 1)
    assert out.dtype == dtype and out.shape == (rows, width)
    ref_in = oracle.f64_copies(x, u, w, b)
    expected = oracle.norm_mul(*ref_in, 1e-5, concat_ux, heads if group else None)
    if training and p > 0:
        keep = out.detach() != 0  # the oracle's values are non-zero almost surely
        expected = expected * keep / (1.0 - p)
    oracle.assert_fwd_bwd(
        out, expected, [x, u, w, b], ref_in, ["x", "u", "weight", "bias"], dtype, seed
    )


@pytest.mark.parametrize("group", [False, True])
@pytest.mark.parametrize("concat_ux", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_norm_mul_matches_oracle(group, concat_ux, dtype):
    _check_mul(29, 3, 8, dtype, group, concat_ux)


@SETTINGS
@given(
    rows=st.integers(0, 30),
    heads=st.integers(1, 4),
    head_dim=st.integers(1, 12),
    dtype=st.sampled_from(DTYPES[:3]),
    group=st.booleans(),
    concat_ux=st.booleans(),
    strided=st.booleans(),
    p=st.sampled_from([0.0, 0.2, 0.5]),
    training=st.booleans(),
    seed=st.integers(0, 1000),
)
def test_norm_mul_sweep(rows, heads, head_dim, dtype, group, concat_ux, strided, p, training, seed):
    assume(not _degenerate("layer_norm", head_dim if group else heads * head_dim))
    _check_mul(rows, heads, head_dim, dtype, group, concat_ux, seed, strided, p, training)


@pytest.mark.parametrize("name", list(NORMS))
@pytest.mark.parametrize("dim", [1, 2])
def test_degenerate_dims_forward(name, dim):
    run, ref = NORMS[name]
    x = random_values(5, (dim,), torch.float32)
    w, b = (t.detach() for t in _params(dim, torch.float32, 0))
    expected = ref(x, w, None if name == "rms_norm" else b, 1e-5)
    torch.testing.assert_close(run(x, w, b, 1e-5).double(), expected, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("group", [False, True])
def test_dropout_mask_statistics_and_seeds(group):
    p, heads = 0.3, 4
    x, u, w, b = (t.detach() for t in _mul_inputs(256, heads, 16, torch.float32, group))
    eval_out = _run_mul(x, u, w, b, group, heads, p, False, True)
    out = _run_mul(x, u, w, b, group, heads, p, True, True, seed=123)
    keep = out != 0
    # every element is dropped or scaled by 1 / (1 - p)
    torch.testing.assert_close(out, torch.where(keep, eval_out / (1 - p), 0.0))
    assert abs(keep.float().mean().item() - (1 - p)) < 0.02
    # the u, x and y parts have independent masks: they agree at rate p^2 + (1 - p)^2
    parts = keep.chunk(3, dim=1)
    for i, j in ((0, 1), (0, 2), (1, 2)):
        agree = (parts[i] == parts[j]).float().mean().item()
        assert abs(agree - (p**2 + (1 - p) ** 2)) < 0.02
    # the same seed replays the mask bitwise; another seed does not
    assert torch.equal(out, _run_mul(x, u, w, b, group, heads, p, True, True, seed=123))
    assert not torch.equal(keep, _run_mul(x, u, w, b, group, heads, p, True, True, seed=124) != 0)
    # seed=None draws from torch's default generator
    torch.manual_seed(5)
    first = _run_mul(x, u, w, b, group, heads, p, True, False)
    torch.manual_seed(5)
    assert torch.equal(first, _run_mul(x, u, w, b, group, heads, p, True, False))
    # not training: no dropout, whatever the ratio
    assert torch.equal(eval_out, _run_mul(x, u, w, b, group, heads, p, False, True, seed=123))


@pytest.mark.parametrize("name", list(NORMS))
def test_norm_gradcheck(name):
    run, _ = NORMS[name]
    x = _x(5, 6, torch.float64)
    w, b = _params(6, torch.float64, 0)
    assert torch.autograd.gradcheck(lambda x, w, b: run(x, w, b, 1e-5), (x, w, b))


@pytest.mark.parametrize("group", [False, True])
@pytest.mark.parametrize("p", [0.0, 0.4])
def test_norm_mul_gradcheck(group, p):
    x, u, w, b = _mul_inputs(4, 2, 3, torch.float64, group)
    fn = lambda x, u, w, b: _run_mul(x, u, w, b, group, 2, p, True, True, seed=7)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (x, u, w, b))


def test_compile_and_export():
    x = _x(11, 16, torch.float32).detach()
    u = _x(11, 16, torch.float32, 1).detach()
    w, b = (t.detach() for t in _params(16, torch.float32, 0))

    def fn(x, u, w, b):
        y = layer_norm(x, w, b, backend=PT) + swish_layer_norm(x, w, b, backend=PT)
        y = y + rms_norm(x, w, backend=PT)
        return y + layer_norm_mul_dropout(x, u, w, b, 1e-5, 0.1, False, backend=PT)

    expected = fn(x, u, w, b)
    torch.testing.assert_close(torch.compile(fn, fullgraph=True)(x, u, w, b), expected)

    class Model(torch.nn.Module):
        def forward(self, x, u, w, b):
            return fn(x, u, w, b)

    exported = torch.export.export(Model(), (x, u, w, b))
    torch.testing.assert_close(exported.module()(x, u, w, b), expected)


def _norm_args():
    x = torch.randn(4, 6)
    return x, torch.ones(6), torch.zeros(6)


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda x, w, b: layer_norm(x[0], w, b), ValueError, r"x must be 2-D, got 1-D"),
        (
            lambda x, w, b: layer_norm(x.int(), w, b),
            TypeError,
            r"x must be float16 or .* got torch.int32",
        ),
        (
            lambda x, w, b: layer_norm(x, w[:5], b),
            ValueError,
            r"weight.shape\[0\] \(5\) must equal x.shape\[1\] \(6\)",
        ),
        (lambda x, w, b: layer_norm(x, w, b[None]), ValueError, r"bias must be 1-D, got 2-D"),
        (
            lambda x, w, b: swish_layer_norm(x, w, b.to("meta")),
            ValueError,
            r"bias is on meta but x is on cpu",
        ),
        (lambda x, w, b: rms_norm(x, w, eps=-1.0), ValueError, r"eps must be >= 0, got -1.0"),
        (
            lambda x, w, b: rms_norm(x, w.long()),
            TypeError,
            r"weight must be float16 .* got torch.int64",
        ),
        (
            lambda x, w, b: layer_norm_mul_dropout(x, x, None, b, 1e-5, 0.0, False),
            TypeError,
            r"weight must be a torch.Tensor, got None",
        ),
        (
            lambda x, w, b: layer_norm_mul_dropout(x, x[:3], w, b, 1e-5, 0.0, False),
            ValueError,
            r"u must have x's shape \[4, 6\], got \[3, 6\]",
        ),
        (
            lambda x, w, b: layer_norm_mul_dropout(x, x.double(), w, b, 1e-5, 0.0, False),
            TypeError,
            r"u has dtype torch.float64 but x has torch.float32",
        ),
        (
            lambda x, w, b: layer_norm_mul_dropout(x, x, w, b, 1e-5, 1.0, True),
            ValueError,
            r"dropout_ratio must be in \[0, 1\), got 1.0",
        ),
        (
            lambda x, w, b: layer_norm_mul_dropout(x, x, w, b, 1e-5, -0.1, True),
            ValueError,
            r"dropout_ratio must be in \[0, 1\), got -0.1",
        ),
        (
            lambda x, w, b: layer_norm_mul_dropout(x, x, w, b, 1e-5, 0.1, True, seed=-1),
            ValueError,
            r"seed must be None or an int in \[0, 2\*\*63\), got -1",
        ),
        (
            lambda x, w, b: layer_norm_mul_dropout(x, x, w, b, 1e-5, 0.1, True, seed=1.5),
            ValueError,
            r"seed must be None or an int .* got 1.5",
        ),
        (
            lambda x, w, b: group_norm_mul_dropout(x, x, w[:2], b[:2], 1e-5, 0.0, False, 4),
            ValueError,
            r"x.shape\[1\] \(6\) must be a multiple of num_heads \(4\)",
        ),
        (
            lambda x, w, b: group_norm_mul_dropout(x, x, w, b, 1e-5, 0.0, False, 0),
            ValueError,
            r"num_heads must be > 0, got 0",
        ),
        (
            lambda x, w, b: group_norm_mul_dropout(x, x, w, b, 1e-5, 0.0, False, 2),
            ValueError,
            r"weight.shape\[0\] \(6\) must equal num_heads \(2\)",
        ),
    ],
)
def test_errors(call, error, match):
    with pytest.raises(error, match=match):
        call(*_norm_args())
