"""STU building blocks: uqvk, output projection and preprocess+attention vs the float64
oracles; remat bitwise parity; dropout; backend pass-through; gradcheck, compile/export and
argument errors."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tzrec_ops.ops.hstu_compute import (
    hstu_compute_output,
    hstu_compute_uqvk,
    hstu_preprocess_and_attention,
)
from tzrec_ops.registry import Backend, BackendError
from tzrec_ops.testing import ops_oracle as oracle
from tzrec_ops.testing.attention_oracle import hstu_mha_oracle
from tzrec_ops.testing.generators import offsets_from_lengths, random_values

SETTINGS = settings(max_examples=20, deadline=None, derandomize=True)
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
PT = "pytorch"
REMAT = [(False, False), (True, False), (False, True), (True, True)]


def _uqvk_inputs(rows, emb, heads, attn_dim, hidden_dim, dtype, seed=0):
    width = 2 * heads * (hidden_dim + attn_dim)
    x = random_values(rows, (emb,), dtype, seed)
    nw = random_values(emb, (), torch.float32, seed + 1, scale=0.2) + 1.0
    nb = random_values(emb, (), torch.float32, seed + 2, scale=0.2)
    w = random_values(emb, (width,), dtype, seed + 3, scale=emb**-0.5)
    b = random_values(width, (), dtype, seed + 4, scale=0.1)
    return [t.detach().requires_grad_() for t in (x, nw, nb, w, b)]


def _flat(*ts):
    return torch.cat([t.reshape(-1) for t in ts])


def _check_uqvk(rows, emb, heads, a, v, dtype, remat=(False, False), seed=0):
    inputs = _uqvk_inputs(rows, emb, heads, a, v, dtype, seed)
    x, nw, nb, w, b = inputs
    u, q, k, vv = hstu_compute_uqvk(x, nw, nb, 1e-5, heads, a, v, w, b, *remat, backend=PT)
    assert (
        u.shape == (rows, heads * v)
        and q.shape == (rows, heads, a)
        and vv.shape == (rows, heads, v)
    )
    assert all(t.dtype == dtype for t in (u, q, k, vv))
    ref_in = oracle.f64_copies(*inputs)
    ru, rq, rk, rv = oracle.hstu_compute_uqvk(
        ref_in[0], ref_in[1], ref_in[2], 1e-5, heads, a, v, ref_in[3], ref_in[4]
    )
    oracle.assert_fwd_bwd(
        _flat(u, q, k, vv),
        _flat(ru, rq, rk, rv),
        inputs,
        ref_in,
        ["x", "norm_weight", "norm_bias", "uvqk_weight", "uvqk_bias"],
        dtype,
        seed,
    )
    return q


@pytest.mark.parametrize("dtype", DTYPES)
def test_uqvk_matches_oracle(dtype):
    q = _check_uqvk(23, 12, 2, 4, 3, dtype)
    if dtype in (torch.float32, torch.float64):
        assert not q.is_contiguous()  # a strided view of the projection, no copy


@SETTINGS
@given(
    rows=st.integers(0, 20),
    emb=st.integers(3, 12),
    heads=st.integers(1, 3),
    a=st.integers(1, 5),
    v=st.integers(1, 5),
    dtype=st.sampled_from(DTYPES[:3]),
    remat=st.sampled_from(REMAT),
    seed=st.integers(0, 1000),
)
def test_uqvk_sweep(rows, emb, heads, a, v, dtype, remat, seed):
    _check_uqvk(rows, emb, heads, a, v, dtype, remat, seed)


def _grads(outputs, inputs, seed=3):
    g = torch.Generator().manual_seed(seed)
    douts = [torch.randn(o.shape, generator=g).to(o.dtype) for o in outputs]
    return torch.autograd.grad(outputs, inputs, douts)


@pytest.mark.parametrize("remat", REMAT[1:])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_uqvk_remat_bitwise(remat, dtype):
    inputs = _uqvk_inputs(31, 16, 2, 8, 8, dtype)
    plain = hstu_compute_uqvk(
        inputs[0], inputs[1], inputs[2], 1e-5, 2, 8, 8, inputs[3], inputs[4], backend=PT
    )
    remat_out = hstu_compute_uqvk(
        inputs[0], inputs[1], inputs[2], 1e-5, 2, 8, 8, inputs[3], inputs[4], *remat, backend=PT
    )
    for p, r in zip(plain, remat_out):
        torch.testing.assert_close(r, p, atol=0, rtol=0)
    for p, r in zip(_grads(plain, inputs), _grads(remat_out, inputs)):
        torch.testing.assert_close(r, p, atol=0, rtol=0)
    with torch.no_grad():  # remat is inactive without grad, same values
        for p, r in zip(
            plain, hstu_compute_uqvk(*inputs[:3], 1e-5, 2, 8, 8, *inputs[3:], *remat, backend=PT)
        ):
            torch.testing.assert_close(r, p, atol=0, rtol=0)


def _output_inputs(rows, emb, heads, v, dtype, concat_ux, group_norm, seed=0):
    hv = heads * v
    attn = random_values(rows, (hv,), dtype, seed)
    u = random_values(rows, (hv,), dtype, seed + 1)
    x = random_values(rows, (emb,), dtype, seed + 2)
    n = heads if group_norm else hv
    nw = random_values(n, (), torch.float32, seed + 3, scale=0.2) + 1.0
    nb = random_values(n, (), torch.float32, seed + 4, scale=0.2)
    w = random_values(hv * (3 if concat_ux else 1), (emb,), dtype, seed + 5, scale=hv**-0.5)
    return [t.detach().requires_grad_() for t in (attn, u, x, nw, nb, w)]


def _run_output(inputs, heads, v, p, training, concat_ux, group_norm, recompute):
    attn, u, x, nw, nb, w = inputs
    return hstu_compute_output(
        attn,
        u,
        x,
        nw,
        nb,
        1e-5,
        w,
        heads,
        v,
        p,
        training,
        concat_ux,
        group_norm,
        recompute,
        backend=PT,
    )


def _check_output(rows, emb, heads, v, dtype, concat_ux, group_norm, recompute=False, seed=0):
    inputs = _output_inputs(rows, emb, heads, v, dtype, concat_ux, group_norm, seed)
    out = _run_output(inputs, heads, v, 0.3, False, concat_ux, group_norm, recompute)
    assert out.dtype == dtype and out.shape == (rows, emb)
    ref_in = oracle.f64_copies(*inputs)
    expected = oracle.hstu_compute_output(
        *ref_in[:5], 1e-5, ref_in[5], heads, concat_ux, group_norm
    )
    oracle.assert_fwd_bwd(
        out,
        expected,
        inputs,
        ref_in,
        ["attn", "u", "x", "norm_weight", "norm_bias", "output_weight"],
        dtype,
        seed,
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("concat_ux", [False, True])
@pytest.mark.parametrize("group_norm", [False, True])
def test_output_matches_oracle(dtype, concat_ux, group_norm):
    _check_output(19, 10, 2, 4, dtype, concat_ux, group_norm)


@SETTINGS
@given(
    rows=st.integers(0, 20),
    emb=st.integers(1, 10),
    heads=st.integers(1, 3),
    v=st.integers(3, 6),
    dtype=st.sampled_from(DTYPES[:3]),
    concat_ux=st.booleans(),
    group_norm=st.booleans(),
    recompute=st.booleans(),
    seed=st.integers(0, 1000),
)
def test_output_sweep(rows, emb, heads, v, dtype, concat_ux, group_norm, recompute, seed):
    _check_output(rows, emb, heads, v, dtype, concat_ux, group_norm, recompute, seed)


@pytest.mark.parametrize("group_norm", [False, True])
def test_output_dropout_and_recompute_y_bitwise(group_norm):
    inputs = _output_inputs(40, 8, 2, 4, torch.float32, True, group_norm)
    eval_out = _run_output(inputs, 2, 4, 0.5, False, True, group_norm, False)
    torch.manual_seed(11)
    plain = _run_output(inputs, 2, 4, 0.5, True, True, group_norm, False)
    plain_grads = _grads([plain], inputs)
    torch.manual_seed(11)
    remat = _run_output(inputs, 2, 4, 0.5, True, True, group_norm, True)
    torch.manual_seed(99)  # recompute must replay the forward's mask, not draw a new one
    remat_grads = _grads([remat], inputs)
    assert not torch.equal(plain, eval_out)
    torch.testing.assert_close(remat, plain, atol=0, rtol=0)
    for r, p in zip(remat_grads, plain_grads):
        torch.testing.assert_close(r, p, atol=0, rtol=0)


def _pa_inputs(lengths, heads, a, v, emb, dtype, seed=0):
    return _uqvk_inputs(sum(lengths), emb, heads, a, v, dtype, seed)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("remat", [(False, False), (True, True)])
def test_preprocess_and_attention_matches_oracle(dtype, remat):
    lengths, targets, heads, a, v = [5, 0, 7, 1], [1, 0, 2, 1], 2, 4, 3
    inputs = _pa_inputs(lengths, heads, a, v, 8, dtype)
    offsets = offsets_from_lengths(lengths)
    nt = torch.tensor(targets)
    u, attn, k, vv = hstu_preprocess_and_attention(
        inputs[0],
        inputs[1],
        inputs[2],
        1e-5,
        heads,
        a,
        v,
        inputs[3],
        inputs[4],
        8,
        offsets,
        0.5,
        True,
        nt,
        3,
        1,
        remat[1],
        remat[0],
        False,
        backend=PT,
    )
    total = sum(lengths)
    assert (
        attn.shape == (total, heads * v)
        and k.shape == (total, heads, a)
        and vv.shape == (total, heads, v)
    )
    ref_in = oracle.f64_copies(*inputs)
    ru, rq, rk, rv = oracle.hstu_compute_uqvk(
        ref_in[0], ref_in[1], ref_in[2], 1e-5, heads, a, v, ref_in[3], ref_in[4]
    )
    rattn = hstu_mha_oracle(8, 0.5, rq, rk, rv, offsets, True, nt, 3, 1).reshape(total, heads * v)
    oracle.assert_fwd_bwd(
        _flat(u, attn),
        _flat(ru, rattn),
        inputs,
        ref_in,
        ["x", "norm_weight", "norm_bias", "uvqk_weight", "uvqk_bias"],
        dtype,
    )
    from tzrec_ops.testing.tolerances import assert_close

    assert_close(k, rk, dtype=dtype, name="k")
    assert_close(vv, rv, dtype=dtype, name="v")


def test_preprocess_and_attention_backend_resolution():
    """A backend with a fused op runs it unless prefill; the unfused path keeps the request."""
    calls = []
    fake = Backend(
        name="fake_fused", priority=-100, ops={"hstu_preprocess_and_attention": "unused:unused"}
    )
    fake._cache["impl:hstu_preprocess_and_attention"] = lambda **args: (
        calls.append(len(args)) or "fused"
    )
    inputs = [t.detach() for t in _pa_inputs([3, 2], 1, 2, 2, 4, torch.float32)]
    args = (
        *inputs[:3],
        1e-5,
        1,
        2,
        2,
        *inputs[3:],
        3,
        offsets_from_lengths([3, 2]),
        1.0,
        True,
        None,
        0,
        0,
        False,
        False,
        False,
    )
    assert hstu_preprocess_and_attention(*args, backend=fake) == "fused" and calls == [22]
    with pytest.raises(
        BackendError,
        match=r"backend 'fake_fused' \(requested by backend=\) cannot run hstu_compute_uqvk",
    ):
        hstu_preprocess_and_attention(*args, prefill=True, backend=fake)
    with pytest.raises(BackendError, match=r"unknown backend 'nope'"):
        hstu_preprocess_and_attention(*args, backend="nope")
    # with the reference backend, prefill and non-prefill both run unfused and agree
    a = hstu_preprocess_and_attention(*args, backend=PT)
    b = hstu_preprocess_and_attention(*args, prefill=True, backend=PT)
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, atol=0, rtol=0)


def test_gradcheck():
    inputs = _uqvk_inputs(4, 3, 1, 2, 2, torch.float64)
    inputs[1], inputs[2] = (t.detach().double().requires_grad_() for t in inputs[1:3])
    assert torch.autograd.gradcheck(
        lambda x, nw, nb, w, b: hstu_compute_uqvk(
            x, nw, nb, 1e-5, 1, 2, 2, w, b, True, False, backend=PT
        ),
        inputs,
    )
    for group_norm in (False, True):
        out_in = _output_inputs(4, 3, 2, 3, torch.float64, True, group_norm)
        out_in[3], out_in[4] = (t.detach().double().requires_grad_() for t in out_in[3:5])
        assert torch.autograd.gradcheck(
            lambda *t, g=group_norm: _run_output(list(t), 2, 3, 0.0, False, True, g, False), out_in
        )


def test_compile_and_export():
    inputs = [t.detach() for t in _uqvk_inputs(9, 8, 2, 4, 4, torch.float32)]
    out_w = random_values(8, (8,), torch.float32, 7)
    nw, nb = torch.ones(8), torch.zeros(8)

    def fn(x, norm_w, norm_b, w, b):
        u, q, k, v = hstu_compute_uqvk(x, norm_w, norm_b, 1e-5, 2, 4, 4, w, b, backend=PT)
        attn = (q * k).sum(-1, keepdim=True) * v
        return hstu_compute_output(
            attn.reshape(9, 8),
            u,
            x,
            nw,
            nb,
            1e-5,
            out_w,
            2,
            4,
            0.1,
            False,
            False,
            False,
            False,
            backend=PT,
        )

    expected = fn(*inputs)
    torch.testing.assert_close(torch.compile(fn, fullgraph=True)(*inputs), expected)

    class Model(torch.nn.Module):
        def forward(self, *args):
            return fn(*args)

    torch.testing.assert_close(
        torch.export.export(Model(), tuple(inputs)).module()(*inputs), expected
    )


def _uqvk_args():
    x, nw, nb, w, b = (t.detach() for t in _uqvk_inputs(5, 4, 2, 3, 2, torch.float32))
    return dict(
        x=x,
        norm_weight=nw,
        norm_bias=nb,
        norm_eps=1e-5,
        num_heads=2,
        attn_dim=3,
        hidden_dim=2,
        uvqk_weight=w,
        uvqk_bias=b,
    )


@pytest.mark.parametrize(
    "change, error, match",
    [
        (dict(x=torch.randn(5)), ValueError, r"x must be 2-D, got 1-D"),
        (dict(num_heads=0), ValueError, r"num_heads must be > 0, got 0"),
        (dict(attn_dim=-1), ValueError, r"attn_dim must be > 0, got -1"),
        (
            dict(norm_weight=torch.ones(3)),
            ValueError,
            r"norm_weight.shape\[0\] \(3\) must equal x.shape\[1\] \(4\)",
        ),
        (
            dict(uvqk_weight=torch.randn(3, 20)),
            ValueError,
            r"uvqk_weight.shape\[0\] \(3\) must equal x.shape\[1\] \(4\)",
        ),
        (
            dict(uvqk_weight=torch.randn(4, 21)),
            ValueError,
            r"uvqk_weight.shape\[1\] \(21\) must equal 2 \* num_heads \* \(hidden_dim \+ attn_dim\) \(20\)",  # noqa: E501
        ),
        (
            dict(uvqk_bias=torch.randn(19)),
            ValueError,
            r"uvqk_bias.shape\[0\] \(19\) must equal 2 \* num_heads",
        ),
        (
            dict(uvqk_weight=torch.randn(4, 20).double()),
            TypeError,
            r"uvqk_weight has dtype torch.float64 but x has torch.float32",
        ),
        (
            dict(uvqk_bias=torch.randn(20, device="meta")),
            ValueError,
            r"uvqk_bias is on meta but x is on cpu",
        ),
        (dict(norm_eps=-1e-5), ValueError, r"eps must be >= 0, got -1e-05"),
    ],
)
def test_uqvk_errors(change, error, match):
    args = _uqvk_args()
    args.update(change)
    with pytest.raises(error, match=match):
        hstu_compute_uqvk(**args)


def test_preprocess_and_attention_errors():
    args = _uqvk_args()
    rest = dict(
        seq_offsets=torch.tensor([0, 2, 5]),
        attn_alpha=1.0,
        causal=True,
        num_targets=None,
        max_attn_len=0,
        contextual_seq_len=0,
        recompute_uvqk_in_backward=False,
        recompute_normed_x_in_backward=False,
        sort_by_length=False,
    )
    with pytest.raises(ValueError, match=r"max_seq_len must be > 0, got 0"):
        hstu_preprocess_and_attention(**args, max_seq_len=0, **rest)
    args["x"] = torch.randn(5, 3)
    with pytest.raises(
        ValueError, match=r"norm_weight.shape\[0\] \(4\) must equal x.shape\[1\] \(3\)"
    ):
        hstu_preprocess_and_attention(**args, max_seq_len=5, **rest)


def _output_args():
    attn, u, x, nw, nb, w = (
        t.detach() for t in _output_inputs(5, 3, 2, 2, torch.float32, False, False)
    )
    return dict(
        attn=attn,
        u=u,
        x=x,
        norm_weight=nw,
        norm_bias=nb,
        norm_eps=1e-5,
        output_weight=w,
        num_heads=2,
        linear_dim=2,
        dropout_ratio=0.0,
        training=False,
        concat_ux=False,
        group_norm=False,
        recompute_y_in_backward=False,
    )


@pytest.mark.parametrize(
    "change, error, match",
    [
        (
            dict(linear_dim=3),
            ValueError,
            r"attn.shape\[1\] \(4\) must equal num_heads \* linear_dim \(6\)",
        ),
        (dict(linear_dim=0), ValueError, r"linear_dim must be > 0, got 0"),
        (dict(u=torch.randn(4, 4)), ValueError, r"u must have attn's shape \[5, 4\], got \[4, 4\]"),
        (
            dict(x=torch.randn(4, 3)),
            ValueError,
            r"x.shape\[0\] \(4\) must equal attn.shape\[0\] \(5\)",
        ),
        (
            dict(group_norm=True),
            ValueError,
            r"norm_weight.shape\[0\] \(4\) must equal num_heads \(2\)",
        ),
        (
            dict(concat_ux=True),
            ValueError,
            r"output_weight.shape\[0\] \(4\) must equal 3 \* num_heads \* linear_dim \(concat_ux\) \(12\)",  # noqa: E501
        ),
        (
            dict(output_weight=torch.randn(4, 2)),
            ValueError,
            r"output_weight.shape\[1\] \(2\) must equal x.shape\[1\] \(3\)",
        ),
        (
            dict(output_weight=torch.randn(4, 3).half()),
            TypeError,
            r"output_weight has dtype torch.float16 but x has torch.float32",
        ),
        (dict(dropout_ratio=1.5), ValueError, r"dropout_ratio must be in \[0, 1\), got 1.5"),
        (
            dict(attn=torch.randn(5, 4).long()),
            TypeError,
            r"attn must be float16 .* got torch.int64",
        ),
    ],
)
def test_output_errors(change, error, match):
    args = _output_args()
    args.update(change)
    with pytest.raises(error, match=match):
        hstu_compute_output(**args)
