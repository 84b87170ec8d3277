"""hstu_mha / delta_hstu_mha: the pytorch reference backend against the independent float64
oracle (tzrec_ops.testing.attention_oracle), plus argument checks, chunking, dropout,
gradcheck, torch.compile and torch.export."""

from __future__ import annotations

import math
from typing import Dict, List, Optional, Sequence

import pytest
import torch
from _delta_split import split_cached
from hypothesis import given, settings
from hypothesis import strategies as st

from tzrec_ops.backends.pytorch import hstu_attention as reference
from tzrec_ops.ops.hstu_attention import delta_hstu_mha, hstu_mha
from tzrec_ops.ops.hstu_attention_utils import build_sla_func_tensor
from tzrec_ops.registry import Backend, BackendError, reset_registry
from tzrec_ops.testing import tolerances
from tzrec_ops.testing.attention_oracle import (
    delta_hstu_mha_oracle,
    hstu_mha_oracle,
    is_visible,
)
from tzrec_ops.testing.generators import (
    AttentionInputs,
    JaggedCase,
    jagged_cases,
    make_attention_inputs,
)

SETTINGS = settings(max_examples=40, deadline=None, derandomize=True)
FEW = settings(max_examples=20, deadline=None, derandomize=True)
DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


@pytest.fixture(autouse=True)
def _default_knobs():
    yield
    reference.set_chunk_elements(None)
    reference.set_use_fbgemm(None)


def _call(inp: AttentionInputs, alpha: float, fn=hstu_mha, **kw) -> torch.Tensor:
    kw.setdefault("num_targets", inp.num_targets)
    return fn(inp.max_seq_len, alpha, inp.q, inp.k, inp.v, inp.seq_offsets, backend="pytorch", **kw)


def _oracle(inp: AttentionInputs, alpha: float, **kw) -> torch.Tensor:
    kw.setdefault("num_targets", inp.num_targets)
    return hstu_mha_oracle(inp.max_seq_len, alpha, inp.q, inp.k, inp.v, inp.seq_offsets, **kw)


def _grads(
    out: torch.Tensor, inputs: Sequence[torch.Tensor], dout: torch.Tensor
) -> List[torch.Tensor]:
    """Gradients of ``sum(out * dout)``; inputs the output does not touch get zeros."""
    if out.numel() == 0 or not out.requires_grad:
        return [torch.zeros_like(t) for t in inputs]
    got = torch.autograd.grad((out * dout.to(out.dtype)).sum(), inputs, allow_unused=True)
    return [torch.zeros_like(t) if g is None else g for t, g in zip(inputs, got)]


def _inputs(
    case: JaggedCase, dtype: torch.dtype, heads: int, a: int, v: int, slack: int, seed: int
):
    return make_attention_inputs(
        case.lengths,
        heads,
        a,
        v,
        dtype,
        seed=seed,
        layout=case.layout,
        num_targets=case.num_targets,
        offsets_dtype=case.offsets_dtype,
        max_seq_len=max([1, *case.lengths]) + slack,
    )


options = st.fixed_dictionaries(
    {
        "causal": st.booleans(),
        # windows shorter and longer than the sequences (max_len 12)
        "max_attn_len": st.sampled_from([0, 1, 3, 20]),
        # prefixes shorter and longer than the sequences
        "contextual_seq_len": st.sampled_from([0, 1, 3, 20]),
        "min_full_attn_seq_len": st.sampled_from([0, 2]),
        "scaling_seqlen": st.sampled_from([-1, 7, 64]),
    }
)
dims = st.sampled_from([(1, 4, 4), (2, 8, 4), (2, 3, 5)])  # (H, A, V), incl. odd sizes


# ---------------------------------------------------------------------------- mask semantics


def test_mask_matches_the_docstring_drawing():
    drawn = [
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [1, 1, 1, 0, 0],
        [1, 1, 1, 1, 0],
        [1, 1, 1, 0, 1],
    ]
    oracle = [[int(is_visible(i, j, 5, num_targets=2)) for j in range(5)] for i in range(5)]
    backend = reference._fixed_mask(
        torch.arange(5)[None],
        torch.tensor([5]),
        torch.tensor([2]),
        None,
        max_len=5,
        causal=True,
        max_attn_len=0,
        contextual_seq_len=0,
        min_full_attn_seq_len=0,
    )
    assert oracle == drawn
    assert backend[0].int().tolist() == drawn


def test_oracle_mask_semantics():
    """The oracle's rules give the behaviour stated in spec §1.2 (C=2, U=6, T=3, w=2)."""
    n, targets, prefix, window = 11, 3, 2, 2
    see = lambda i, j: is_visible(i, j, n, targets, prefix, window)  # noqa: E731
    uih = range(prefix, n - targets)
    tgt = range(n - targets, n)
    for i in tgt:  # targets: themselves, never other targets
        assert [j for j in tgt if see(i, j)] == [i]
    for i in range(n - targets):  # no non-target sees a target
        assert not any(see(i, j) for j in tgt)
    for i in range(prefix):  # prefix: whole prefix + whole history, window ignored
        assert all(see(i, j) for j in range(n - targets))
    far = prefix + window + 1  # history row further than w from the prefix
    assert not see(far, 0) and not see(far, 1)
    assert see(prefix, 0)  # first history token sees the prefix
    last = n - 1  # window for targets measured from the history end
    assert [j for j in uih if see(last, j)] == [n - targets - 2, n - targets - 1]
    assert not is_visible(1, 2, 5, causal=True) and is_visible(1, 2, 5, causal=False)


# ---------------------------------------------------------------------------- vs the oracle


@SETTINGS
@given(
    case=jagged_cases(max_batch=4, max_len=12),
    dtype=st.sampled_from(DTYPES),
    opts=options,
    hav=dims,
    slack=st.integers(0, 3),
    seed=st.integers(0, 2**16),
)
def test_forward_matches_oracle(case, dtype, opts, hav, slack, seed):
    inp = _inputs(case, dtype, *hav, slack, seed)
    alpha = 1.0 / math.sqrt(hav[1])
    out = _call(inp, alpha, **opts)
    assert out.dtype == dtype and out.shape == (inp.q.shape[0], hav[0], hav[2])
    tolerances.assert_close(out, _oracle(inp, alpha, **opts), name="out")


@FEW
@given(
    case=jagged_cases(max_batch=3, max_len=10),
    dtype=st.sampled_from(DTYPES),
    opts=options,
    hav=dims,
    seed=st.integers(0, 2**16),
)
def test_backward_matches_oracle(case, dtype, opts, hav, seed):
    inp = _inputs(case, dtype, *hav, 1, seed)
    alpha = 1.0 / math.sqrt(hav[1])
    leaves = inp.to(dtype, requires_grad=True)
    exact = inp.to(torch.float64, requires_grad=True)
    out = _call(leaves, alpha, **opts)
    dout = torch.randn(
        out.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64
    )
    got = _grads(out, leaves.tensors(), dout)
    want = _grads(_oracle(exact, alpha, **opts), exact.tensors(), dout)
    for name, g, w in zip("qkv", got, want):
        assert g.dtype == dtype
        tolerances.assert_close(g, w, dtype, grad=True, name=f"d{name}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_inputs_are_computed_in_float32(dtype):
    inp = make_attention_inputs([9, 4, 12], 2, 8, 8, dtype, seed=3, num_targets=[2, 0, 4])
    got = _call(inp, 0.3, max_attn_len=3, contextual_seq_len=1)
    upcast = _call(inp.to(torch.float32), 0.3, max_attn_len=3, contextual_seq_len=1)
    assert torch.equal(got, upcast.to(dtype))


def test_float64_inputs_are_computed_in_float64():
    inp = make_attention_inputs([7, 5], 2, 4, 4, torch.float64, seed=1)
    torch.testing.assert_close(_call(inp, 0.5), _oracle(inp, 0.5), atol=1e-13, rtol=1e-12)


def test_strided_last_dim_and_fused_views():
    for layout in ("strided", "fused"):
        inp = make_attention_inputs(
            [6, 0, 1, 8], 2, 4, 6, layout=layout, seed=5, num_targets=[6, 0, 1, 2]
        )
        assert not inp.q.is_contiguous()
        contiguous = AttentionInputs(
            *(t.contiguous() for t in inp.tensors()),
            inp.seq_offsets,
            inp.num_targets,
            inp.lengths,
            inp.max_seq_len,
        )
        assert torch.equal(_call(inp, 0.5), _call(contiguous, 0.5))
        tolerances.assert_close(_call(inp, 0.5), _oracle(inp, 0.5), name=layout)


def test_empty_batch_and_zero_tokens():
    for lengths in ([], [0, 0]):
        inp = make_attention_inputs(lengths, 2, 4, 3)
        out = _call(inp, 0.5)
        assert out.shape == (0, 2, 3)
    inp = make_attention_inputs([], 2, 4, 3).to(torch.float32, requires_grad=True)
    _call(inp, 0.5).sum().backward()
    assert inp.q.grad is not None and inp.q.grad.shape == (0, 2, 4)


# ---------------------------------------------------------------------------- attn_func


def _random_func(lengths: Sequence[int], heads: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    cols = []
    for n in lengths:
        for _ in range(n):
            cmax0, cmin0, cmax1 = (torch.randint(0, n + 2, (heads,), generator=g) for _ in range(3))
            cols.append(torch.stack([cmax0, cmin0, cmax1], dim=1))  # [H, 3]
    if not cols:
        return torch.zeros(heads, 3, 0, dtype=torch.int32)
    return torch.stack(cols, dim=-1).to(torch.int32)


@FEW
@given(case=jagged_cases(max_batch=3, max_len=10, targets=False), seed=st.integers(0, 999))
def test_attn_func_matches_oracle(case, seed):
    inp = _inputs(case, torch.float32, 2, 4, 4, 1, seed)
    func = _random_func(case.lengths, 2, seed)
    out = _call(inp, 0.5, attn_func=func)
    tolerances.assert_close(out, _oracle(inp, 0.5, attn_func=func), name="out")
    leaves = inp.to(torch.float32, requires_grad=True)
    exact = inp.to(torch.float64, requires_grad=True)
    dout = torch.randn(out.shape, dtype=torch.float64)
    got = _grads(_call(leaves, 0.5, attn_func=func), leaves.tensors(), dout)
    want = _grads(_oracle(exact, 0.5, attn_func=func), exact.tensors(), dout)
    for g, w in zip(got, want):
        tolerances.assert_close(g, w, torch.float32, grad=True)


def test_attn_func_ignores_the_fixed_mask_options():
    inp = make_attention_inputs([7, 5], 2, 4, 4, seed=2, num_targets=[2, 1])
    func = _random_func(inp.lengths, 2, 0)
    plain = _call(inp, 0.5, attn_func=func, num_targets=None)
    loaded = _call(inp, 0.5, attn_func=func, causal=False, max_attn_len=2, contextual_seq_len=3)
    assert torch.equal(plain, loaded)


@pytest.mark.parametrize("k1_over_n", [0, 5])
def test_sla_with_wide_local_window_and_no_prefix_equals_causal(k1_over_n):
    inp = make_attention_inputs([9, 1, 0, 12], 2, 4, 4, seed=4, max_seq_len=12)
    func = build_sla_func_tensor(2, inp.max_seq_len + k1_over_n, 0, inp.seq_offsets, inp.q.shape[0])
    torch.testing.assert_close(_call(inp, 0.5, attn_func=func), _call(inp, 0.5), atol=0, rtol=0)


def test_sla_with_targets_matches_oracle():
    inp = make_attention_inputs([9, 6, 12], 2, 4, 4, seed=6, num_targets=[2, 6, 3])
    func = build_sla_func_tensor(2, 3, 2, inp.seq_offsets, inp.q.shape[0], inp.num_targets, 1)
    tolerances.assert_close(_call(inp, 0.5, attn_func=func), _oracle(inp, 0.5, attn_func=func))


# ---------------------------------------------------------------------------- gradcheck


GRADCHECK_CASES: List[Dict] = [
    {},
    {"num_targets": [2, 1, 0], "max_attn_len": 1, "contextual_seq_len": 1},
    {"causal": False, "max_attn_len": 2, "min_full_attn_seq_len": 1},
    {"scaling_seqlen": 3, "contextual_seq_len": 5},
]


@pytest.mark.parametrize("opts", GRADCHECK_CASES)
def test_gradcheck_float64(opts):
    targets = opts.pop("num_targets", None)
    inp = make_attention_inputs([4, 1, 3], 2, 3, 2, torch.float64, seed=9, num_targets=targets)

    def fn(q, k, v):
        return hstu_mha(
            inp.max_seq_len,
            0.7,
            q,
            k,
            v,
            inp.seq_offsets,
            num_targets=inp.num_targets,
            backend="pytorch",
            **opts,
        )

    assert torch.autograd.gradcheck(fn, inp.to(torch.float64, requires_grad=True).tensors())


def test_gradcheck_attn_func_and_dropout():
    inp = make_attention_inputs([4, 3], 1, 3, 2, torch.float64, seed=11)
    func = _random_func(inp.lengths, 1, 3)

    def fn(q, k, v):
        torch.manual_seed(0)  # the same dropout mask on every evaluation
        return hstu_mha(
            inp.max_seq_len,
            0.7,
            q,
            k,
            v,
            inp.seq_offsets,
            dropout_pr=0.3,
            attn_func=func,
            backend="pytorch",
        )

    assert torch.autograd.gradcheck(fn, inp.to(torch.float64, requires_grad=True).tensors())


# ---------------------------------------------------------------------------- dropout


def _one_hot_values(inp: AttentionInputs) -> AttentionInputs:
    """v[token, h] = one-hot of the token's position: out[i, h, j] is then weight a_ij."""
    rows = [torch.eye(inp.max_seq_len, dtype=torch.float64)[:n] for n in inp.lengths]
    v = torch.cat(rows)[:, None, :].expand(-1, inp.q.shape[1], -1).contiguous()
    return AttentionInputs(
        inp.q, inp.k, v, inp.seq_offsets, inp.num_targets, inp.lengths, inp.max_seq_len
    )


def test_dropout_zeroes_weights_and_rescales_the_rest():
    p = 0.3
    inp = _one_hot_values(make_attention_inputs([24, 17, 30], 4, 4, 1, torch.float64, seed=12))
    weights = _oracle(inp, 0.5)
    torch.manual_seed(123)
    dropped = _call(inp, 0.5, dropout_pr=p, training=True)
    live = weights != 0
    kept = dropped[live] != 0
    torch.testing.assert_close(dropped[live][kept], weights[live][kept] / (1 - p))
    assert torch.all(dropped[~live] == 0)
    # ~2300 live weights: the dropped fraction is within 5 standard deviations of p
    frac = 1.0 - kept.double().mean().item()
    assert abs(frac - p) < 5 * math.sqrt(p * (1 - p) / live.sum().item())
    torch.manual_seed(123)
    assert torch.equal(_call(inp, 0.5, dropout_pr=p, training=True), dropped)
    assert torch.equal(_call(inp, 0.5, dropout_pr=p, training=False), _call(inp, 0.5))


# ---------------------------------------------------------------------------- chunking


@pytest.mark.parametrize("elements", [1, 37, 200, 10_000])
def test_chunked_equals_unchunked(elements):
    inp = make_attention_inputs(
        [9, 0, 1, 12, 5], 2, 4, 4, torch.float64, seed=13, num_targets=[3, 0, 1, 12, 0]
    )
    kw = dict(max_attn_len=3, contextual_seq_len=2, min_full_attn_seq_len=1)
    dout = torch.randn(inp.q.shape[0], 2, 4, dtype=torch.float64)
    whole = inp.to(torch.float64, requires_grad=True)
    out = _call(whole, 0.5, **kw)
    grads = _grads(out, whole.tensors(), dout)
    reference.set_chunk_elements(elements)
    parts = inp.to(torch.float64, requires_grad=True)
    out_c = _call(parts, 0.5, **kw)
    grads_c = _grads(out_c, parts.tensors(), dout)
    # float64 matmuls of different batch sizes may sum in another order: 1e-13, not bitwise
    torch.testing.assert_close(out_c, out, atol=1e-13, rtol=1e-12)
    for g_c, g in zip(grads_c, grads):
        torch.testing.assert_close(g_c, g, atol=1e-13, rtol=1e-12)


def test_chunk_sizes_respect_the_budget():
    # H = 2, N = 16, A + V = 8: one sequence's upcast k, v take 2 * 16 * 8 = 256 elements
    reference.set_chunk_elements(1000)
    seqs, rows = reference._chunk_sizes(batch=8, rows=16, heads=2, max_len=16, kv_dim=8)
    assert seqs * 2 * 16 * (rows + 8) <= 1000 and (seqs, rows) == (1, 16)
    reference.set_chunk_elements(356)  # 256 for k, v leaves room for 3 query rows
    assert reference._chunk_sizes(8, 16, 2, 16, 8) == (1, 3)
    reference.set_chunk_elements(20_000)  # few rows (cached attention): many sequences
    assert reference._chunk_sizes(64, 2, 2, 16, 8) == (62, 2)
    reference.set_chunk_elements(1)  # one sequence and one query row is the floor
    assert reference._chunk_sizes(8, 16, 2, 16, 8) == (1, 1)


def test_multi_chunk_backward_recomputes_instead_of_saving_scores():
    """With >1 chunk each chunk runs under checkpoint: autograd keeps no [.., r, N] score
    tensor. With one chunk (the control) it does, which shows the probe sees them."""

    def saved_shapes(budget: Optional[int]) -> List[tuple]:
        reference.set_chunk_elements(budget)
        inp = make_attention_inputs([12, 12], 2, 4, 4, seed=14).to(
            torch.float32, requires_grad=True
        )
        shapes: List[tuple] = []
        with torch.autograd.graph.saved_tensors_hooks(
            lambda t: shapes.append(tuple(t.shape)) or t, lambda t: t
        ):
            _call(inp, 0.5)
        return shapes

    assert any(s[-2:] == (12, 12) for s in saved_shapes(None))
    chunked = saved_shapes(2 * 12 * (12 + 8))  # one sequence, all 12 rows, per chunk
    assert chunked and not any(s[-2:] == (12, 12) for s in chunked), chunked


def test_chunk_env_knob(monkeypatch):
    monkeypatch.setenv(reference.CHUNK_ENV, "123")
    assert reference.chunk_elements() == 123
    monkeypatch.setenv(reference.CHUNK_ENV, "lots")
    with pytest.raises(
        ValueError, match="TZREC_OPS_PYTORCH_ATTN_CHUNK must be a positive integer, got 'lots'"
    ):
        reference.chunk_elements()
    monkeypatch.setenv(reference.CHUNK_ENV, "0")
    with pytest.raises(ValueError, match="must be a positive integer, got '0'"):
        reference.chunk_elements()
    with pytest.raises(ValueError, match="elements must be >= 1, got 0"):
        reference.set_chunk_elements(0)


def test_fbgemm_conversions():
    """fbgemm-gpu is not installed in CPU CI: then the plain-torch path must be the one used
    and forcing fbgemm must fail clearly. Where it is installed, both paths must agree."""
    try:
        import fbgemm_gpu  # noqa: F401
    except Exception:
        installed = False
    else:
        installed = hasattr(torch.ops.fbgemm, "jagged_to_padded_dense")
    inp = make_attention_inputs([6, 0, 9], 2, 4, 4, seed=15, num_targets=[1, 0, 2])
    if installed:
        assert reference.fbgemm_enabled()
        with_fbgemm = _call(inp, 0.5)
        reference.set_use_fbgemm(False)
        assert torch.equal(_call(inp, 0.5), with_fbgemm)
    else:
        assert not reference.fbgemm_enabled()
        reference.set_use_fbgemm(True)
        with pytest.raises(
            RuntimeError, match=r"set_use_fbgemm\(True\) but fbgemm-gpu is not installed"
        ):
            _call(inp, 0.5)


# ---------------------------------------------------------------------------- delta


@FEW
@given(
    case=jagged_cases(max_batch=3, max_len=10, layouts=("contiguous", "fused")),
    dtype=st.sampled_from(DTYPES),
    opts=options,
    delta=st.integers(0, 3),
    seed=st.integers(0, 999),
)
def test_delta_matches_oracle_and_full_attention(case, dtype, opts, delta, seed):
    lengths = tuple(max(n, delta) for n in case.lengths)
    targets = (
        None
        if case.num_targets is None
        else tuple(min(t, n) for t, n in zip(case.num_targets, lengths))
    )
    case = JaggedCase(lengths, targets, case.offsets_dtype, case.layout)
    inp = _inputs(case, dtype, 2, 4, 4, 0, seed)
    kw = {k: opts[k] for k in ("max_attn_len", "contextual_seq_len", "scaling_seqlen")}
    last = [
        o + n - delta + d for o, n in zip(inp.seq_offsets.tolist(), lengths) for d in range(delta)
    ]
    delta_q = inp.q[last]
    out = delta_hstu_mha(
        inp.max_seq_len,
        0.5,
        delta_q,
        inp.k,
        inp.v,
        inp.seq_offsets,
        inp.num_targets,
        backend="pytorch",
        **kw,
    )
    assert out.dtype == dtype and out.shape == (len(last), 2, 4) and not out.requires_grad
    want = delta_hstu_mha_oracle(
        inp.max_seq_len, 0.5, delta_q, inp.k, inp.v, inp.seq_offsets, inp.num_targets, **kw
    )
    tolerances.assert_close(out, want, name="delta out")
    full = _call(inp, 0.5, **kw)[last]
    tolerances.assert_close(out, full.double(), dtype, name="delta vs full rows")


def test_delta_is_forward_only():
    inp = make_attention_inputs([5, 6], 2, 4, 4, seed=16).to(torch.float32, requires_grad=True)
    out = delta_hstu_mha(
        inp.max_seq_len, 0.5, inp.q[:4], inp.k, inp.v, inp.seq_offsets, backend="pytorch"
    )
    assert not out.requires_grad


def test_delta_empty_batch():
    k = torch.zeros(0, 2, 4)
    out = delta_hstu_mha(
        4,
        0.5,
        torch.zeros(0, 2, 4),
        k,
        torch.zeros(0, 2, 3),
        torch.zeros(1, dtype=torch.int64),
        backend="pytorch",
    )
    assert out.shape == (0, 2, 3)


@FEW
@given(
    case=jagged_cases(max_batch=3, max_len=10, layouts=("contiguous", "fused")),
    dtype=st.sampled_from(DTYPES),
    opts=options,
    delta=st.integers(0, 3),
    seed=st.integers(0, 999),
)
def test_delta_split_form_equals_concatenated_form(case, dtype, opts, delta, seed):
    """Cache in place + new keys from a second tensor == the concatenated call, bit for bit
    (the reference builds the concatenation), and == the independent oracle."""
    lengths = tuple(max(n, delta) for n in case.lengths)
    targets = (
        None
        if case.num_targets is None
        else tuple(min(t, n) for t, n in zip(case.num_targets, lengths))
    )
    case = JaggedCase(lengths, targets, case.offsets_dtype, case.layout)
    inp = _inputs(case, dtype, 2, 4, 4, 0, seed)
    kw = {k: opts[k] for k in ("max_attn_len", "contextual_seq_len", "scaling_seqlen")}
    delta_q, cache_k, cache_v, cache_offsets, delta_k, delta_v, _ = split_cached(inp, delta)
    assert delta_k.stride(0) == 2 * (2 * 4 + 4)  # H * (2A + V): a view into the fused buffer
    split = delta_hstu_mha(
        inp.max_seq_len,
        0.5,
        delta_q,
        cache_k,
        cache_v,
        cache_offsets,
        inp.num_targets,
        delta_k=delta_k,
        delta_v=delta_v,
        backend="pytorch",
        **kw,
    )
    concatenated = delta_hstu_mha(
        inp.max_seq_len,
        0.5,
        delta_q,
        inp.k,
        inp.v,
        inp.seq_offsets,
        inp.num_targets,
        backend="pytorch",
        **kw,
    )
    assert split.dtype == dtype and not split.requires_grad
    assert torch.equal(split, concatenated)
    want = delta_hstu_mha_oracle(
        inp.max_seq_len, 0.5, delta_q, inp.k, inp.v, inp.seq_offsets, inp.num_targets, **kw
    )
    tolerances.assert_close(split, want, name="split delta out")


SPLIT_CASES = {
    # (full lengths, D, targets, contextual prefix, window, offsets dtype)
    "empty_cache": ((2, 2, 2), 2, None, 0, 0, torch.int64),
    "delta_one": ((5, 1, 9), 1, (1, 1, 0), 0, 0, torch.int64),
    "targets_within_delta": ((7, 4), 3, (2, 3), 2, 0, torch.int32),
    "targets_reach_the_cache": ((9, 6), 2, (5, 4), 0, 0, torch.int64),
    "window_prefix_targets": ((11, 3, 8), 3, (1, 3, 2), 2, 2, torch.int32),
}


@pytest.mark.parametrize("name", sorted(SPLIT_CASES))
def test_delta_split_form_edge_cases_float64(name):
    lengths, delta, targets, ctx, window, offsets_dtype = SPLIT_CASES[name]
    inp = make_attention_inputs(
        lengths,
        2,
        3,
        5,
        torch.float64,
        seed=31,
        num_targets=targets,
        offsets_dtype=offsets_dtype,
        max_seq_len=max(lengths) + 2,
    )
    kw = dict(num_targets=inp.num_targets, max_attn_len=window, contextual_seq_len=ctx)
    delta_q, cache_k, cache_v, cache_offsets, delta_k, delta_v, rows = split_cached(inp, delta)
    got = delta_hstu_mha(
        inp.max_seq_len,
        0.7,
        delta_q,
        cache_k,
        cache_v,
        cache_offsets,
        delta_k=delta_k,
        delta_v=delta_v,
        backend="pytorch",
        **kw,
    )
    full = _call(inp, 0.7, max_attn_len=window, contextual_seq_len=ctx)[rows]
    tolerances.assert_close(got, full, name=f"{name}: split delta vs full forward rows")


def test_delta_split_form_empty_batch():
    out = delta_hstu_mha(
        4,
        0.5,
        torch.zeros(0, 2, 4),
        torch.zeros(0, 2, 4),
        torch.zeros(0, 2, 3),
        torch.zeros(1, dtype=torch.int64),
        delta_k=torch.zeros(0, 2, 4),
        delta_v=torch.zeros(0, 2, 3),
        backend="pytorch",
    )
    assert out.shape == (0, 2, 3)


# ---------------------------------------------------------------------------- compile / export


def _small_call(q, k, v, offsets, targets):
    return hstu_mha(
        16,
        0.5,
        q,
        k,
        v,
        offsets,
        num_targets=targets,
        max_attn_len=3,
        contextual_seq_len=2,
        backend="pytorch",
    )


def test_torch_compile_fullgraph_forward_and_backward():
    torch._dynamo.reset()
    inp = make_attention_inputs([9, 0, 14, 3], 2, 4, 4, seed=17, num_targets=[2, 0, 3, 3])
    reference.set_chunk_elements(2 * 16 * 16)  # several chunks: checkpoint inside the graph
    eager = inp.to(torch.float32, requires_grad=True)
    compiled = inp.to(torch.float32, requires_grad=True)
    out = _small_call(*eager.tensors(), inp.seq_offsets, inp.num_targets)
    out_c = torch.compile(_small_call, fullgraph=True)(
        *compiled.tensors(), inp.seq_offsets, inp.num_targets
    )
    tolerances.assert_close(out_c, out.double(), torch.float32)
    dout = torch.randn(out.shape)
    for g_c, g in zip(_grads(out_c, compiled.tensors(), dout), _grads(out, eager.tensors(), dout)):
        tolerances.assert_close(g_c, g.double(), torch.float32, grad=True)


def test_torch_export():
    class Attention(torch.nn.Module):
        def forward(self, q, k, v, offsets, targets):
            return _small_call(q, k, v, offsets, targets)

    inp = make_attention_inputs([9, 0, 14, 3], 2, 4, 4, seed=18, num_targets=[2, 0, 3, 3])
    args = (*inp.tensors(), inp.seq_offsets, inp.num_targets)
    exported = torch.export.export(Attention(), args)
    assert torch.equal(exported.module()(*args), _small_call(*args))
    other = make_attention_inputs([9, 2, 14, 1], 2, 4, 4, seed=19, num_targets=[1, 1, 0, 1])
    args2 = (*other.tensors(), other.seq_offsets, other.num_targets)
    assert torch.equal(exported.module()(*args2), _small_call(*args2))


# ---------------------------------------------------------------------------- errors


def _good(**over):
    inp = make_attention_inputs([3, 5], 2, 4, 6, seed=20, num_targets=[1, 2])
    args = dict(
        max_seq_len=8,
        alpha=0.5,
        q=inp.q,
        k=inp.k,
        v=inp.v,
        seq_offsets=inp.seq_offsets,
        num_targets=inp.num_targets,
    )
    args.update(over)
    return args


Q = torch.zeros(8, 2, 4)
ERRORS = [
    (dict(max_seq_len=0), ValueError, r"max_seq_len must be > 0, got 0"),
    (dict(max_seq_len=8.0), TypeError, r"max_seq_len must be an int, got float"),
    (dict(max_attn_len=-1), ValueError, r"max_attn_len must be >= 0, got -1"),
    (dict(contextual_seq_len=-2), ValueError, r"contextual_seq_len must be >= 0, got -2"),
    (dict(min_full_attn_seq_len=-1), ValueError, r"min_full_attn_seq_len must be >= 0, got -1"),
    (
        dict(scaling_seqlen=0),
        ValueError,
        r"scaling_seqlen must be -1 \(use max_seq_len\) or > 0, got 0",
    ),
    (dict(dropout_pr=1.5), ValueError, r"dropout_pr must be in \[0, 1\], got 1.5"),
    (dict(q=Q[:, 0]), ValueError, r"q must be 3-D, got 2-D with shape \(8, 4\)"),
    (
        dict(q=Q.int()),
        TypeError,
        r"q must be float32 or bfloat16 or float16 or float64, got torch.int32",
    ),
    (dict(k=torch.zeros(8, 2, 5)), ValueError, r"k.shape\[2\] \(5\) must equal q.shape\[2\] \(4\)"),
    (dict(k=torch.zeros(7, 2, 4)), ValueError, r"k.shape\[0\] \(7\) must equal q.shape\[0\] \(8\)"),
    (dict(v=torch.zeros(7, 2, 6)), ValueError, r"v.shape\[0\] \(7\) must equal q.shape\[0\] \(8\)"),
    (dict(v=torch.zeros(8, 3, 6)), ValueError, r"v.shape\[1\] \(3\) must equal q.shape\[1\] \(2\)"),
    (dict(v=torch.zeros(8, 2)), ValueError, r"v must be 3-D, got 2-D"),
    (
        dict(k=Q.half()),
        TypeError,
        r"k has dtype torch.float16 but q has torch.float32; they must match",
    ),
    (dict(v=torch.zeros(8, 2, 6, device="meta")), ValueError, r"v is on meta but q is on cpu"),
    (
        dict(num_targets=torch.tensor([1, 2], device="meta")),
        ValueError,
        r"num_targets is on meta but q is on cpu",
    ),
    (
        dict(seq_offsets=torch.tensor([0.0, 3.0, 8.0])),
        TypeError,
        r"seq_offsets must be int32 or int64, got torch.float32",
    ),
    (dict(seq_offsets=torch.tensor([[0, 3, 8]])), ValueError, r"seq_offsets must be 1-D, got 2-D"),
    (dict(seq_offsets=torch.tensor([1, 3, 8])), ValueError, r"seq_offsets\[0\] must be 0"),
    (
        dict(seq_offsets=torch.tensor([0, 5, 3, 8]), num_targets=None),
        ValueError,
        r"seq_offsets must be non-decreasing, got seq_offsets\[2\] = 3 < seq_offsets\[1\] = 5",
    ),
    (
        dict(seq_offsets=torch.tensor([0, 3, 7])),
        ValueError,
        r"seq_offsets\[-1\] must equal the token count q.shape\[0\] \(8\), got 7",
    ),
    (dict(max_seq_len=4), ValueError, r"every sequence length .* must be <= max_seq_len \(4\)"),
    (
        dict(num_targets=torch.tensor([1])),
        ValueError,
        r"num_targets must have B = 2 entries \(one per sequence\), got 1",
    ),
    (
        dict(num_targets=torch.tensor([1.0, 2.0])),
        TypeError,
        r"num_targets must be int32 or int64, got torch.float32",
    ),
    (dict(num_targets=torch.tensor([-1, 2])), ValueError, r"num_targets must be >= 0"),
    (
        dict(num_targets=torch.tensor([4, 2])),
        ValueError,
        r"num_targets\[b\] must be <= the length of sequence b",
    ),
    (
        dict(attn_func=torch.zeros(2, 3, 8, dtype=torch.int64)),
        TypeError,
        r"attn_func must be int32, got torch.int64",
    ),
    (
        dict(attn_func=torch.zeros(2, 3, 7, dtype=torch.int32)),
        ValueError,
        r"attn_func must have shape \(H, 3, L\) = \(2, 3, 8\), got \(2, 3, 7\)",
    ),
    (dict(attn_func=torch.zeros(3, 8, dtype=torch.int32)), ValueError, r"attn_func must be 3-D"),
]


@pytest.mark.parametrize("over,exc,match", ERRORS, ids=[m[:40] for _, _, m in ERRORS])
def test_hstu_mha_errors(over, exc, match):
    with pytest.raises(exc, match=match):
        hstu_mha(**_good(**over), backend="pytorch")


def _good_delta(**over):
    inp = make_attention_inputs([3, 5], 2, 4, 6, seed=21)
    args = dict(
        max_seq_len=8,
        alpha=0.5,
        delta_q=torch.zeros(4, 2, 4),
        k=inp.k,
        v=inp.v,
        seq_offsets=inp.seq_offsets,
    )
    args.update(over)
    return args


DELTA_ERRORS = [
    (dict(max_seq_len=-3), ValueError, r"max_seq_len must be > 0, got -3"),
    (dict(delta_q=torch.zeros(4, 8)), ValueError, r"delta_q must be 3-D"),
    (
        dict(delta_q=torch.zeros(4, 2, 4, dtype=torch.int64)),
        TypeError,
        r"delta_q must be float32 or",
    ),
    (
        dict(k=torch.zeros(8, 3, 4)),
        ValueError,
        r"k.shape\[1\] \(3\) must equal delta_q.shape\[1\] \(2\)",
    ),
    (
        dict(k=torch.zeros(8, 2, 5)),
        ValueError,
        r"k.shape\[2\] \(5\) must equal delta_q.shape\[2\] \(4\)",
    ),
    (dict(v=torch.zeros(7, 2, 6)), ValueError, r"v.shape\[0\] \(7\) must equal k.shape\[0\] \(8\)"),
    (
        dict(v=torch.zeros(8, 1, 6)),
        ValueError,
        r"v.shape\[1\] \(1\) must equal delta_q.shape\[1\] \(2\)",
    ),
    (
        dict(delta_q=torch.zeros(5, 2, 4)),
        ValueError,
        r"delta_q.shape\[0\] \(5\) must be a multiple of the batch size B \(2\)",
    ),
    (
        dict(delta_q=torch.zeros(8, 2, 4)),
        ValueError,
        r"every sequence length \(seq_offsets\[b \+ 1\] - seq_offsets\[b\]\) must be >= 4 "
        r"\(its D = 4 new queries, delta_q.shape\[0\] / B\), got 3 for sequence 0",
    ),
    (
        dict(v=torch.zeros(8, 2, 6, dtype=torch.float64)),
        TypeError,
        r"v has dtype torch.float64 but delta_q has torch.float32",
    ),
    (
        dict(k=torch.zeros(8, 2, 4, device="meta"), v=torch.zeros(8, 2, 6, device="meta")),
        ValueError,
        r"k is on meta but delta_q is on cpu",
    ),
    (
        dict(seq_offsets=torch.tensor([0, 3, 9])),
        ValueError,
        r"seq_offsets\[-1\] must equal the token count k.shape\[0\] \(8\), got 9",
    ),
    (
        dict(num_targets=torch.tensor([4, 0])),
        ValueError,
        r"num_targets\[b\] must be <= the length of sequence b",
    ),
    (dict(max_attn_len=-1), ValueError, r"max_attn_len must be >= 0, got -1"),
    (dict(contextual_seq_len=-1), ValueError, r"contextual_seq_len must be >= 0, got -1"),
]


@pytest.mark.parametrize("over,exc,match", DELTA_ERRORS, ids=[m[:40] for _, _, m in DELTA_ERRORS])
def test_delta_hstu_mha_errors(over, exc, match):
    with pytest.raises(exc, match=match):
        delta_hstu_mha(**_good_delta(**over), backend="pytorch")


def test_delta_empty_batch_needs_empty_queries():
    with pytest.raises(
        ValueError, match=r"delta_q.shape\[0\] \(2\) must be a multiple of the batch size B \(0\)"
    ):
        delta_hstu_mha(
            4,
            0.5,
            torch.zeros(2, 2, 4),
            torch.zeros(0, 2, 4),
            torch.zeros(0, 2, 3),
            torch.zeros(1, dtype=torch.int64),
            backend="pytorch",
        )


def _good_split(**over):
    """Cached prefixes of lengths 3 and 5 (k, v), D = 2 new tokens each: full lengths 5, 7."""
    args = _good_delta(delta_k=torch.zeros(4, 2, 4), delta_v=torch.zeros(4, 2, 6))
    args.update(over)
    return args


SPLIT_ERRORS = [
    (
        dict(delta_v=None),
        ValueError,
        r"delta_k and delta_v must be given together .*delta_k was given but delta_v is None",
    ),
    (
        dict(delta_k=None),
        ValueError,
        r"delta_k and delta_v must be given together .*delta_v was given but delta_k is None",
    ),
    (dict(delta_k=torch.zeros(4, 8)), ValueError, r"delta_k must be 3-D, got 2-D"),
    (dict(delta_v=torch.zeros(4, 2, 6, 1)), ValueError, r"delta_v must be 3-D, got 4-D"),
    (
        dict(delta_k="keys"),
        TypeError,
        r"delta_k must be a torch.Tensor, got str",
    ),
    (
        dict(delta_k=torch.zeros(6, 2, 4)),
        ValueError,
        r"delta_k.shape\[0\] \(6\) must equal delta_q.shape\[0\] \(4\)",
    ),
    (
        dict(delta_k=torch.zeros(4, 1, 4)),
        ValueError,
        r"delta_k.shape\[1\] \(1\) must equal delta_q.shape\[1\] \(2\)",
    ),
    (
        dict(delta_k=torch.zeros(4, 2, 5)),
        ValueError,
        r"delta_k.shape\[2\] \(5\) must equal delta_q.shape\[2\] \(4\)",
    ),
    (
        dict(delta_v=torch.zeros(2, 2, 6)),
        ValueError,
        r"delta_v.shape\[0\] \(2\) must equal delta_q.shape\[0\] \(4\)",
    ),
    (
        dict(delta_v=torch.zeros(4, 3, 6)),
        ValueError,
        r"delta_v.shape\[1\] \(3\) must equal delta_q.shape\[1\] \(2\)",
    ),
    (
        dict(delta_v=torch.zeros(4, 2, 4)),
        ValueError,
        r"delta_v.shape\[2\] \(4\) must equal v.shape\[2\] \(6\)",
    ),
    (
        dict(delta_k=torch.zeros(4, 2, 4, dtype=torch.float16)),
        TypeError,
        r"delta_k has dtype torch.float16 but delta_q has torch.float32",
    ),
    (
        dict(delta_v=torch.zeros(4, 2, 6, dtype=torch.float64)),
        TypeError,
        r"delta_v has dtype torch.float64 but delta_q has torch.float32",
    ),
    (
        dict(delta_k=torch.zeros(4, 2, 4, device="meta")),
        ValueError,
        r"delta_k is on meta but delta_q is on cpu",
    ),
    (
        dict(delta_v=torch.zeros(4, 2, 6, device="meta")),
        ValueError,
        r"delta_v is on meta but delta_q is on cpu",
    ),
    (
        dict(max_seq_len=6),
        ValueError,
        r"every sequence length \(seq_offsets\[b \+ 1\] - seq_offsets\[b\] \+ 2 new tokens\) "
        r"must be <= max_seq_len \(6\), got 7 for sequence 1",
    ),
    (
        dict(num_targets=torch.tensor([6, 1])),
        ValueError,
        r"num_targets\[b\] must be <= the length of sequence b",
    ),
    (
        dict(seq_offsets=torch.tensor([0, 3, 9])),
        ValueError,
        r"seq_offsets\[-1\] must equal the token count k.shape\[0\] \(8\), got 9",
    ),
]


@pytest.mark.parametrize("over,exc,match", SPLIT_ERRORS, ids=[m[:40] for _, _, m in SPLIT_ERRORS])
def test_delta_split_form_errors(over, exc, match):
    with pytest.raises(exc, match=match):
        delta_hstu_mha(**_good_split(**over), backend="pytorch")


def test_delta_split_form_counts_targets_in_the_full_length():
    """num_targets may exceed the cached length: it is bounded by cache + D."""
    out = delta_hstu_mha(**_good_split(num_targets=torch.tensor([5, 7])), backend="pytorch")
    assert out.shape == (4, 2, 6)


# ---------------------------------------------------------------------------- backend routing


@pytest.fixture
def fresh_registry():
    reset_registry()
    yield
    reset_registry()


def test_explicit_triton_on_cpu_lists_reasons(monkeypatch, fresh_registry):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(
        BackendError,
        match=(
            r"(?s)backend 'triton' \(requested by backend=\) cannot run hstu_mha: "
            r".*candidates:.*pytorch: accepts this call"
        ),
    ):
        hstu_mha(**_good(), backend="triton")
    with pytest.raises(BackendError, match=r"(?s)backend 'triton' .* cannot run delta_hstu_mha"):
        delta_hstu_mha(**_good_delta(), backend="triton")


@pytest.mark.parametrize(
    "over,reason",
    [
        (dict(dropout_pr=0.1), r"dropout_pr=0.1 is not supported \(needs 0.0\)"),
        (
            dict(min_full_attn_seq_len=2, max_attn_len=1),
            r"min_full_attn_seq_len=2 is not supported",
        ),
        (
            dict(attn_func=torch.zeros(2, 3, 8, dtype=torch.int32)),
            r"attn_func \(arbitrary masks\) is not supported",
        ),
        (
            dict(
                q=torch.zeros(8, 2, 4, dtype=torch.float64),
                k=torch.zeros(8, 2, 4, dtype=torch.float64),
                v=torch.zeros(8, 2, 6, dtype=torch.float64),
            ),
            r"dtype torch.float64 is not supported",
        ),
    ],
)
def test_triton_rejects_unsupported_options(monkeypatch, fresh_registry, over, reason):
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(BackendError, match=reason):
        hstu_mha(**_good(**over), backend="triton")


def _no_split_backend() -> Backend:
    """A backend whose ``supports`` rejects the split cached form (as one that predates it
    should); its implementation is the reference one."""

    def supports(op, call):
        return "split_kv (delta_k/delta_v) is not supported" if call.get("split_kv") else None

    return Backend(
        "no_split",
        0,
        {"delta_hstu_mha": "tzrec_ops.backends.pytorch.hstu_attention:delta_hstu_mha"},
        supports=supports,
    )


def test_split_form_is_a_call_option_backends_can_reject():
    record = _no_split_backend()
    # the concatenated form runs on it
    assert delta_hstu_mha(**_good_delta(), backend=record).shape == (4, 2, 6)
    with pytest.raises(
        BackendError,
        match=(
            r"(?s)backend 'no_split' \(requested by backend=\) cannot run delta_hstu_mha: "
            r"split_kv \(delta_k/delta_v\) is not supported.*call: .*split_kv=True"
        ),
    ):
        delta_hstu_mha(**_good_split(), backend=record)


def test_split_kv_option_says_which_form(monkeypatch, fresh_registry):
    """Both forms pass ``split_kv`` (its declared call key), False for the concatenated one,
    and the implementation gets every declared argument by keyword (None when not given)."""
    from tzrec_ops import registry

    seen = []
    real = registry._choose

    def spy(op, backend, call):
        seen.append(dict(call))
        return real(op, backend, call)

    monkeypatch.setattr(registry, "_choose", spy)
    delta_hstu_mha(**_good_delta(), backend="pytorch")
    delta_hstu_mha(**_good_split(), backend="pytorch")
    assert seen[0]["split_kv"] is False and seen[1]["split_kv"] is True


def test_triton_accepts_the_split_form():
    pytest.importorskip("triton")
    from tzrec_ops.backends.triton.refusals import call_rejection, tma_call_rejection

    call = {"dtype": torch.bfloat16, "split_kv": True}
    assert call_rejection("delta_hstu_mha", call) is None
    assert tma_call_rejection("delta_hstu_mha", call) is None


def test_dropout_in_eval_mode_is_not_a_triton_rejection(monkeypatch, fresh_registry):
    """training=False turns dropout off, so the call the backends see has dropout_pr=0."""
    from tzrec_ops import registry

    seen = {}
    real = registry._choose

    def spy(op, backend, call):
        seen.update(call)
        return real(op, backend, call)

    monkeypatch.setattr(registry, "_choose", spy)
    hstu_mha(**_good(dropout_pr=0.4, training=False), backend="pytorch")
    assert seen["dropout_pr"] == 0.0 and seen["attn_func"] is False and seen["num_targets"] is True


def test_unknown_backend():
    with pytest.raises(
        BackendError, match=r"unknown backend 'nope'; registered backends: .*pytorch"
    ):
        hstu_mha(**_good(), backend="nope")
