"""Triton HSTU attention (backends ``triton`` and ``triton_tma``) against the float64 oracle.

The oracle is the ``pytorch`` backend run on float64 copies of the same inputs, forward and
backward. On a CPU the kernels run in the Triton interpreter (``TRITON_INTERPRET=1``, set
below before triton is imported when no GPU is visible) at small shapes; the ``gpu`` tests
(``pytest -m gpu``) repeat the comparisons at real sizes and cover TMA, torch.compile,
torch.export and AOTInductor.
"""

from __future__ import annotations

import contextlib
import os

import torch

if not torch.cuda.is_available():
    # triton.jit decides at decoration time whether a kernel is interpreted
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from _delta_split import split_cached  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from tzrec_ops.ops.hstu_attention import delta_hstu_mha, hstu_mha  # noqa: E402
from tzrec_ops.registry import BackendError, reset_registry  # noqa: E402
from tzrec_ops.testing.aoti import run_package  # noqa: E402
from tzrec_ops.testing.generators import jagged_cases, make_attention_inputs  # noqa: E402
from tzrec_ops.testing.tolerances import TF32, assert_close  # noqa: E402

pytest.importorskip("triton")

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
CPU = pytest.mark.skipif(not INTERPRET, reason="CPU tests run in the Triton interpreter")
SETTINGS = settings(max_examples=30, deadline=None, derandomize=True)
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _tol_dtype(dtype):
    """fp32 on a GPU follows allow_tf32, which the TF32 tolerance covers."""
    if dtype == torch.float32 and not INTERPRET and torch.backends.cuda.matmul.allow_tf32:
        return None
    return dtype


def _compare(actual, expected, dtype, grad, name):
    tol_dtype = _tol_dtype(dtype)
    if tol_dtype is None:
        scale = float(expected.abs().max()) if expected.numel() else 1.0
        torch.testing.assert_close(
            actual.double(), expected, atol=TF32.atol * max(scale, 1e-30), rtol=TF32.rtol,
            msg=lambda m: f"{name} (tf32): {m}",
        )
    else:
        assert_close(actual, expected, dtype, grad=grad, name=name)


def check_against_oracle(
    inputs, backend, dtype, *, causal=True, max_attn_len=0, contextual_seq_len=0,
    scaling_seqlen=-1, sort_by_length=False, alpha=0.37, backward=True,
):
    """Forward (and backward) of ``backend`` in ``dtype`` vs the pytorch backend in float64."""
    ins = inputs.to(dtype, requires_grad=backward)
    if inputs.q.dtype == dtype:  # same dtype: the views (fused/strided layouts) are kept
        assert ins.q.stride() == inputs.q.stride()
    kwargs = dict(
        causal=causal, num_targets=inputs.num_targets, max_attn_len=max_attn_len,
        contextual_seq_len=contextual_seq_len, scaling_seqlen=scaling_seqlen,
    )
    out = hstu_mha(inputs.max_seq_len, alpha, ins.q, ins.k, ins.v, inputs.seq_offsets,
                   sort_by_length=sort_by_length, backend=backend, **kwargs)
    ref_in = inputs.to(torch.float64, requires_grad=backward)
    expected = hstu_mha(inputs.max_seq_len, alpha, ref_in.q, ref_in.k, ref_in.v,
                        inputs.seq_offsets, backend="pytorch", **kwargs)
    assert out.dtype == dtype and out.shape == expected.shape
    _compare(out, expected, dtype, False, "out")
    if not backward or out.numel() == 0:
        return
    dout = torch.randn(out.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    dout = dout.to(out.device)
    out.backward(dout.to(dtype))
    expected.backward(dout)
    for name, got, want in zip("qkv", (ins.q, ins.k, ins.v), (ref_in.q, ref_in.k, ref_in.v)):
        _compare(got.grad, want.grad, dtype, True, f"d{name}")


def _inputs(case, heads, attn_dim, hidden_dim, dtype, seed=0, extra_len=0):
    return make_attention_inputs(
        case.lengths, heads, attn_dim, hidden_dim, dtype=dtype, seed=seed,
        layout=case.layout, num_targets=case.num_targets, offsets_dtype=case.offsets_dtype,
        max_seq_len=max([1, *case.lengths]) + extra_len,
    )


# ------------------------------------------------------------------------------ CPU (interpreter)


@CPU
@SETTINGS
@given(
    case=jagged_cases(max_batch=3, max_len=40, layouts=("contiguous", "fused")),
    attn_dim=st.sampled_from([16, 24, 32]),
    hidden_dim=st.sampled_from([16, 24, 32]),
    causal=st.booleans(),
    max_attn_len=st.sampled_from([0, 0, 1, 5, 50]),
    contextual_seq_len=st.sampled_from([0, 0, 1, 3, 45]),
    scaling_seqlen=st.sampled_from([-1, 64]),
    extra_len=st.sampled_from([0, 7]),
    sort_by_length=st.booleans(),
    dtype=st.sampled_from(DTYPES),
)
def test_interpreter_matches_oracle(
    case, attn_dim, hidden_dim, causal, max_attn_len, contextual_seq_len, scaling_seqlen,
    extra_len, sort_by_length, dtype,
):
    inputs = _inputs(case, 2, attn_dim, hidden_dim, dtype, extra_len=extra_len)
    check_against_oracle(
        inputs, "triton", dtype, causal=causal, max_attn_len=max_attn_len,
        contextual_seq_len=contextual_seq_len, scaling_seqlen=scaling_seqlen,
        sort_by_length=sort_by_length,
    )


EDGE_CASES = {
    "empty_and_length_one": dict(lengths=(0, 1, 33, 0), num_targets=None),
    "targets_equal_length": dict(lengths=(5, 40, 17), num_targets=(5, 40, 2)),
    "contextual_longer_than_sequence": dict(lengths=(3, 37), num_targets=(1, 4), ctx=12),
    "window_with_targets_and_prefix": dict(lengths=(40, 21), num_targets=(6, 1), ctx=3, w=4),
    "all_empty": dict(lengths=(0, 0), num_targets=None),
}


@CPU
@pytest.mark.parametrize("name", sorted(EDGE_CASES))
@pytest.mark.parametrize("offsets_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("causal", [True, False])
def test_interpreter_edge_cases(name, offsets_dtype, causal):
    spec = EDGE_CASES[name]
    inputs = make_attention_inputs(
        spec["lengths"], 2, 16, 24, seed=3, layout="fused", num_targets=spec["num_targets"],
        offsets_dtype=offsets_dtype,
    )
    check_against_oracle(
        inputs, "triton", torch.float32, causal=causal, max_attn_len=spec.get("w", 0),
        contextual_seq_len=spec.get("ctx", 0),
    )


@CPU
def test_interpreter_strided_last_dim_is_made_contiguous():
    inputs = make_attention_inputs((9, 30), 2, 16, 16, seed=4, layout="strided")
    assert inputs.q.stride(-1) != 1
    check_against_oracle(inputs, "triton", torch.float32)


@CPU
@pytest.mark.parametrize("delta", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_interpreter_delta_matches_oracle_and_full_forward(delta, dtype):
    lengths, targets = (7, 40, 3), (2, 5, 3)
    inputs = make_attention_inputs(lengths, 2, 32, 16, seed=6, num_targets=targets,
                                   layout="fused", dtype=dtype)
    offsets = inputs.seq_offsets
    rows = torch.cat([torch.arange(int(offsets[b + 1]) - delta, int(offsets[b + 1]))
                      for b in range(len(lengths))])
    kwargs = dict(num_targets=inputs.num_targets, max_attn_len=6, contextual_seq_len=2)
    delta_q = inputs.q[rows]
    got = delta_hstu_mha(inputs.max_seq_len, 0.4, delta_q, inputs.k, inputs.v, offsets,
                         backend="triton", **kwargs)
    f64 = inputs.to(torch.float64)
    expected = delta_hstu_mha(inputs.max_seq_len, 0.4, f64.q[rows], f64.k, f64.v, offsets,
                              backend="pytorch", **kwargs)
    assert_close(got, expected, dtype, name="delta out")
    full = hstu_mha(inputs.max_seq_len, 0.4, inputs.q, inputs.k, inputs.v, offsets,
                    backend="triton", **kwargs)
    assert_close(got, full[rows].double(), dtype, name="delta vs full forward rows")


# split cached form: (full lengths, D, targets, contextual prefix, window)
SPLIT_CASES = {
    "empty_cache": ((3, 3, 3), 3, None, 0, 0),
    "delta_one": ((8, 41, 1), 1, (1, 0, 1), 0, 0),
    "targets_within_delta": ((15, 39), 6, (2, 6), 2, 0),
    "targets_reach_the_cache": ((26, 9), 4, (9, 4), 0, 0),
    "window_prefix_targets": ((45, 22, 5), 5, (3, 1, 5), 3, 4),
    "delta_spans_key_blocks": ((40, 37), 37, (10, 0), 1, 0),
}


@CPU
@pytest.mark.parametrize("name", sorted(SPLIT_CASES))
@pytest.mark.parametrize(
    "dtype,offsets_dtype", [(torch.float32, torch.int64), (torch.bfloat16, torch.int32)]
)
def test_interpreter_delta_split_form_matches_oracle(name, dtype, offsets_dtype):
    """Cache read in place + the new keys from strided views of a fused buffer, vs the
    float64 oracle of the concatenated call."""
    lengths, delta, targets, ctx, window = SPLIT_CASES[name]
    inputs = make_attention_inputs(lengths, 2, 32, 16, seed=11, num_targets=targets,
                                   layout="fused", dtype=dtype, offsets_dtype=offsets_dtype)
    delta_q, cache_k, cache_v, cache_offsets, delta_k, delta_v, rows = split_cached(inputs, delta)
    assert delta_k.stride(0) == 2 * (2 * 32 + 16) and cache_offsets.dtype == offsets_dtype
    kwargs = dict(num_targets=inputs.num_targets, max_attn_len=window, contextual_seq_len=ctx)
    got = delta_hstu_mha(inputs.max_seq_len, 0.3, delta_q, cache_k, cache_v, cache_offsets,
                         delta_k=delta_k, delta_v=delta_v, backend="triton", **kwargs)
    f64 = inputs.to(torch.float64)
    expected = delta_hstu_mha(inputs.max_seq_len, 0.3, f64.q[rows], f64.k, f64.v,
                              inputs.seq_offsets, backend="pytorch", **kwargs)
    assert got.dtype == dtype
    assert_close(got, expected, dtype, name=f"{name}: split delta out")


@CPU
@settings(max_examples=25, deadline=None, derandomize=True)
@given(
    case=jagged_cases(max_batch=3, max_len=40, layouts=("contiguous", "fused")),
    delta=st.integers(1, 20),
    max_attn_len=st.sampled_from([0, 0, 3, 50]),
    contextual_seq_len=st.sampled_from([0, 0, 2, 45]),
    dtype=st.sampled_from(DTYPES),
)
def test_interpreter_delta_split_form_sweep(case, delta, max_attn_len, contextual_seq_len,
                                            dtype):
    lengths = [n + delta for n in case.lengths]  # the drawn lengths are the cached ones
    targets = None if case.num_targets is None else list(case.num_targets)
    inputs = make_attention_inputs(lengths, 2, 16, 24, seed=12, num_targets=targets,
                                   layout=case.layout, dtype=dtype,
                                   offsets_dtype=case.offsets_dtype)
    delta_q, cache_k, cache_v, cache_offsets, delta_k, delta_v, rows = split_cached(inputs, delta)
    kwargs = dict(num_targets=inputs.num_targets, max_attn_len=max_attn_len,
                  contextual_seq_len=contextual_seq_len)
    got = delta_hstu_mha(inputs.max_seq_len, 0.3, delta_q, cache_k, cache_v, cache_offsets,
                         delta_k=delta_k, delta_v=delta_v, backend="triton", **kwargs)
    f64 = inputs.to(torch.float64)
    expected = delta_hstu_mha(inputs.max_seq_len, 0.3, f64.q[rows], f64.k, f64.v,
                              inputs.seq_offsets, backend="pytorch", **kwargs)
    assert_close(got, expected, dtype, name="split delta out")


# a forward config that runs the query block as two row halves (Q_SPLITS=2)
QUERY_HALVES = (32, 16, 4, 1, 2)


@contextlib.contextmanager
def _forward_tile(tile):
    """Run the Triton forward with the one config ``tile`` (see ``autotune.tile_config``)."""
    from tzrec_ops.backends.triton import autotune
    from tzrec_ops.backends.triton.hstu_attention import attention_kernels

    kernel = attention_kernels()[autotune.FWD]
    saved = kernel.configs
    kernel.configs = [autotune.tile_config(autotune.FWD, tile)]
    kernel.cache.clear()
    try:
        yield
    finally:
        kernel.configs = saved
        kernel.cache.clear()


@CPU
@SETTINGS
@given(
    case=jagged_cases(max_batch=3, max_len=40, layouts=("contiguous", "fused")),
    causal=st.booleans(),
    max_attn_len=st.sampled_from([0, 0, 1, 5, 50]),
    contextual_seq_len=st.sampled_from([0, 0, 1, 3, 45]),
    sort_by_length=st.booleans(),
    dtype=st.sampled_from(DTYPES),
)
def test_interpreter_query_halves_match_oracle(case, causal, max_attn_len, contextual_seq_len,
                                               sort_by_length, dtype):
    inputs = _inputs(case, 2, 16, 24, dtype)
    with _forward_tile(QUERY_HALVES):
        check_against_oracle(
            inputs, "triton", dtype, causal=causal, max_attn_len=max_attn_len,
            contextual_seq_len=contextual_seq_len, sort_by_length=sort_by_length,
            backward=False,
        )


@CPU
@pytest.mark.parametrize("name", sorted(SPLIT_CASES))
def test_interpreter_delta_forms_with_query_halves(name):
    """Both delta forms under ``Q_SPLITS=2``: the split (cache + new rows) form stacks the
    halves into one block, the concatenated form runs them as halves."""
    lengths, delta, targets, ctx, window = SPLIT_CASES[name]
    inputs = make_attention_inputs(lengths, 2, 32, 16, seed=11, num_targets=targets,
                                   layout="fused")
    delta_q, cache_k, cache_v, cache_offsets, delta_k, delta_v, rows = split_cached(inputs, delta)
    kwargs = dict(num_targets=inputs.num_targets, max_attn_len=window, contextual_seq_len=ctx)
    f64 = inputs.to(torch.float64)
    expected = delta_hstu_mha(inputs.max_seq_len, 0.3, f64.q[rows], f64.k, f64.v,
                              inputs.seq_offsets, backend="pytorch", **kwargs)
    with _forward_tile(QUERY_HALVES):
        split = delta_hstu_mha(inputs.max_seq_len, 0.3, delta_q, cache_k, cache_v,
                               cache_offsets, delta_k=delta_k, delta_v=delta_v, backend="triton",
                               **kwargs)
        whole = delta_hstu_mha(inputs.max_seq_len, 0.3, delta_q, inputs.k, inputs.v,
                               inputs.seq_offsets, backend="triton", **kwargs)
    assert_close(split, expected, torch.float32, name=f"{name}: split form, query halves")
    assert_close(whole, expected, torch.float32, name=f"{name}: concatenated, query halves")


@CPU
def test_interpreter_backward_is_two_passes_and_reproducible(monkeypatch):
    """The backward launches the dK/dV kernel, then the dQ kernel (no atomics), and gives
    the same bits every run."""
    from tzrec_ops.backends.triton import autotune
    from tzrec_ops.backends.triton import hstu_attention as impl

    launched = []
    tuned = impl._tuned
    monkeypatch.setattr(impl, "_tuned", lambda kernel, wide: launched.append(kernel)
                        or tuned(kernel, wide))
    inputs = make_attention_inputs((40, 25), 2, 16, 16, seed=8, num_targets=(3, 1))
    grads = []
    for _ in range(2):
        launched.clear()
        ins = inputs.to(torch.float32, requires_grad=True)
        out = hstu_mha(inputs.max_seq_len, 0.5, ins.q, ins.k, ins.v, inputs.seq_offsets,
                       num_targets=inputs.num_targets, contextual_seq_len=2, backend="triton")
        out.backward(torch.ones_like(out))
        grads.append([t.grad.clone() for t in (ins.q, ins.k, ins.v)])
        assert launched == [autotune.FWD, autotune.BWD_DKDV, autotune.BWD_DQ]
    for first, second in zip(*grads):
        assert torch.equal(first, second)


@CPU
def test_interpreter_non_power_of_two_and_unequal_dims():
    inputs = make_attention_inputs((13, 38), 1, 20, 40, seed=9, num_targets=(2, 2))
    check_against_oracle(inputs, "triton", torch.float32, contextual_seq_len=2)


# ------------------------------------------------------------------------- errors and plumbing


@pytest.fixture
def fresh_registry():
    reset_registry()
    yield
    reset_registry()


def _small(**over):
    inputs = make_attention_inputs((3, 5), 2, 16, 16, seed=1)
    args = dict(max_seq_len=8, alpha=0.5, q=inputs.q, k=inputs.k, v=inputs.v,
                seq_offsets=inputs.seq_offsets)
    args.update(over)
    return args


@pytest.mark.parametrize(
    "over,reason",
    [
        (dict(dropout_pr=0.2), r"dropout_pr=0.2 is not supported"),
        (dict(min_full_attn_seq_len=1, max_attn_len=2),
         r"min_full_attn_seq_len=1 is not supported"),
        (dict(attn_func=torch.zeros(2, 3, 8, dtype=torch.int32)), r"attn_func \(arbitrary masks\)"),
    ],
)
@pytest.mark.parametrize("backend", ["triton", "triton_tma"])
def test_unsupported_options_rejected_before_launch(monkeypatch, fresh_registry, over, reason,
                                                    backend):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    if backend == "triton_tma":
        reason = r"tensor descriptors are not supported by the Triton interpreter"
    with pytest.raises(BackendError, match=reason):
        hstu_mha(**_small(**over), backend=backend)


def test_tma_backend_takes_bfloat16_attention_only():
    from tzrec_ops.backends.triton.refusals import tma_call_rejection

    for dtype in (torch.float16, torch.float32):
        for op in ("hstu_mha", "delta_hstu_mha"):
            reason = tma_call_rejection(op, {"dtype": dtype, "device": torch.device("cpu")})
            assert reason is not None and "(bfloat16 only); use backend 'triton'" in reason
    assert tma_call_rejection("hstu_mha", {"dtype": torch.bfloat16}) is None
    assert tma_call_rejection("hstu_mha", {"dtype": torch.bfloat16, "dropout_pr": 0.5}) == (
        "dropout_pr=0.5 is not supported (needs 0.0)"
    )


def test_cpu_tensors_without_interpreter_rejected(monkeypatch, fresh_registry):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    if torch.cuda.is_available():
        pattern = r"backend 'triton' .* cannot run hstu_mha: tensors are on cpu, needs CUDA"
    else:
        pattern = r"backend 'triton' .* cannot run hstu_mha: unavailable: no CUDA/ROCm device"
    with pytest.raises(BackendError, match=pattern):
        hstu_mha(**_small(), backend="triton")


@CPU
def test_backend_function_rejects_options_itself():
    from tzrec_ops.backends.triton import hstu_attention as impl

    args = _small()
    args.pop("seq_offsets")
    offsets = _small()["seq_offsets"]
    refused = r"hstu_mha on the triton backends: dropout_pr=0.1 is not supported"
    with pytest.raises(ValueError, match=refused):
        impl.hstu_mha(args["max_seq_len"], 0.5, args["q"], args["k"], args["v"], offsets,
                      dropout_pr=0.1)
    with pytest.raises(ValueError, match=r"min_full_attn_seq_len=2 is not supported \(needs 0\)"):
        impl.hstu_mha(8, 0.5, args["q"], args["k"], args["v"], offsets, min_full_attn_seq_len=2)
    # eval mode turns dropout off, so it is accepted
    out = impl.hstu_mha(8, 0.5, args["q"], args["k"], args["v"], offsets, dropout_pr=0.1,
                        training=False)
    assert out.shape == (8, 2, 16)


@CPU
def test_head_dim_above_256_is_a_clear_error():
    inputs = make_attention_inputs((3,), 1, 264, 16, seed=2)
    with pytest.raises(ValueError, match=r"head dims up to 256 are supported, got 264"):
        hstu_mha(4, 0.5, inputs.q, inputs.k, inputs.v, inputs.seq_offsets, backend="triton")


@CPU
def test_autotune_keys_and_configs():
    from tzrec_ops.backends.rocm import configs as rocm
    from tzrec_ops.backends.triton import autotune
    from tzrec_ops.backends.triton.hstu_attention import attention_kernels

    kernels, wide = attention_kernels(), attention_kernels(wide=True)
    assert list(kernels) == [autotune.FWD, autotune.BWD_DKDV, autotune.BWD_DQ] == list(wide)
    for kernel in kernels.values():
        assert "AUTOTUNE_MAX_SEQ_LEN" in kernel.keys and "AUTOTUNE_Z" in kernel.keys
        assert len(kernel.configs) == 1  # the interpreter's single config
    for name in (autotune.FWD, autotune.BWD_DQ, autotune.BWD_DKDV):
        hip = rocm.for_kernel(name)
        assert hip and all("matrix_instr_nonkdim" in c.kwargs for c in hip)
        assert wide[name].keys == kernels[name].keys and wide[name] is not kernels[name]
        assert attention_kernels()[name] is kernels[name]  # built once


@CPU
def test_tile_config_reads_query_halves_and_register_cap():
    from tzrec_ops.backends.triton import autotune

    plain = autotune.tile_config(autotune.FWD, (128, 32, 4, 3))
    assert plain.kwargs == {"BLOCK_M": 128, "BLOCK_N": 32, "Q_SPLITS": 1}
    assert (plain.num_warps, plain.num_stages, plain.maxnreg) == (4, 3, None)
    capped = autotune.tile_config(autotune.FWD, (64, 16, 4, 4, 1, 128))
    assert capped.kwargs["Q_SPLITS"] == 1 and capped.maxnreg == 128
    assert autotune.tile_config(autotune.FWD, (128, 32, 4, 3, 2)).kwargs["Q_SPLITS"] == 2
    # the backward kernels have no query halves
    assert autotune.tile_config(autotune.BWD_DQ, (128, 64, 8, 2)).kwargs == {
        "BLOCK_M": 128, "BLOCK_N": 64}


@CPU
@pytest.mark.parametrize("kernel_ms, reps", [(2.0, [100.0]), (15.0, [100.0, 375.0])])
def test_autotune_times_slow_candidates_over_enough_runs(monkeypatch, kernel_ms, reps):
    """Triton's 100 ms benchmark holds six runs of a 15 ms kernel: the candidate is timed
    again over 25 runs; a 2 ms kernel (50 runs) is not."""
    from tzrec_ops.backends.triton import autotune

    asked = []

    def fake_do_bench(fn, rep, quantiles, **kwargs):
        asked.append(rep)
        # the median is the kernel's time; each call's quantiles differ (by the call count)
        return [kernel_ms] + [kernel_ms + len(asked) * q for q in quantiles[1:]]

    monkeypatch.setattr(autotune.triton.testing, "do_bench", fake_do_bench)
    times = autotune.bench_candidate(lambda: None, (0.5, 0.2, 0.8))
    assert asked == reps
    assert times == [kernel_ms, kernel_ms + len(reps) * 0.2, kernel_ms + len(reps) * 0.8]


def _opcheck(device, test_utils):
    import tzrec_ops.backends.triton.hstu_attention  # noqa: F401  (registers the ops)

    inputs = make_attention_inputs((5, 19), 2, 16, 16, seed=12, num_targets=(1, 3),
                                   device=device)
    q, k, v = (t.detach().requires_grad_() for t in inputs.tensors())
    args = (inputs.max_seq_len, 0.5, q, k, v, inputs.seq_offsets, True, inputs.num_targets,
            0, 2, True, -1)
    ops = ["hstu_mha_triton"] + (["hstu_mha_triton_tma"] if device == "cuda" else [])
    for name in ops:
        torch.library.opcheck(getattr(torch.ops.tzrec_ops, name).default, args,
                              test_utils=test_utils)


@CPU
def test_opcheck_in_interpreter():
    """Schema, fake tensors and autograd registration (AOT dispatch needs a GPU: below)."""
    _opcheck("cpu", ("test_schema", "test_autograd_registration", "test_faketensor"))


def _opcheck_delta(device, test_utils):
    import tzrec_ops.backends.triton.hstu_attention  # noqa: F401  (registers the ops)

    inputs = make_attention_inputs((5, 19), 2, 16, 16, seed=13, num_targets=(1, 3),
                                   device=device, layout="fused")
    delta_q, cache_k, cache_v, cache_offsets, delta_k, delta_v, rows = split_cached(inputs, 3)
    head = (inputs.max_seq_len, 0.5, delta_q)
    tail = (inputs.num_targets, 0, 2, -1)
    calls = [
        head + (cache_k, cache_v, cache_offsets) + tail + (delta_k, delta_v),
        head + (inputs.k, inputs.v, inputs.seq_offsets) + tail,
    ]
    ops = ["delta_hstu_mha_triton"] + (["delta_hstu_mha_triton_tma"] if device == "cuda" else [])
    for name in ops:
        for args in calls:
            torch.library.opcheck(getattr(torch.ops.tzrec_ops, name).default, args,
                                  test_utils=test_utils)


@CPU
def test_delta_opcheck_in_interpreter():
    """The delta op's schema takes the optional split-form tensors; fakes match."""
    _opcheck_delta("cpu", ("test_schema", "test_faketensor"))


@pytest.mark.gpu
def test_gpu_opcheck():
    _opcheck("cuda", ("test_schema", "test_autograd_registration", "test_faketensor",
                      "test_aot_dispatch_dynamic"))
    _opcheck_delta("cuda", ("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))


# ------------------------------------------------------------------------------------- GPU

GPU_BACKENDS = ["triton", "triton_tma"]
GPU_OPTIONS = {
    "plain": dict(),
    "targets_ctx": dict(targets=True, contextual_seq_len=5),
    "window_targets": dict(targets=True, max_attn_len=100),
    "noncausal": dict(causal=False),
}


def _gpu_inputs(lengths, attn_dim, hidden_dim, dtype, targets=False, layout="fused", seed=0):
    g = torch.Generator().manual_seed(seed + 99)
    nt = [int(x) for x in torch.randint(0, 20, (len(lengths),), generator=g)] if targets else None
    nt = None if nt is None else [min(t, n) for t, n in zip(nt, lengths)]
    # drawn in ``dtype`` so the fused views survive (``AttentionInputs.to`` of another
    # dtype would copy them into contiguous tensors)
    return make_attention_inputs(lengths, 4, attn_dim, hidden_dim, dtype=dtype, seed=seed,
                                 device="cuda", layout=layout, num_targets=nt, scale=0.5)


def _gpu_lengths(batch, max_len, seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, max_len + 1, (batch,), generator=g).tolist()
    lengths[0] = max_len
    return lengths


GPU_SWEEP = [(torch.bfloat16, option) for option in sorted(GPU_OPTIONS)] + [
    (torch.float16, "plain"), (torch.float16, "targets_ctx"), (torch.float32, "plain"),
    (torch.float32, "window_targets"),
]


@pytest.mark.gpu
@pytest.mark.parametrize(
    "backend,dtype,option",
    [("triton", d, o) for d, o in GPU_SWEEP]
    + [("triton_tma", d, o) for d, o in GPU_SWEEP if d == torch.bfloat16],
)
def test_gpu_matches_oracle(backend, dtype, option):
    opts = dict(GPU_OPTIONS[option])
    targets = opts.pop("targets", False)
    inputs = _gpu_inputs(_gpu_lengths(8, 1024), 128, 128, dtype, targets=targets)
    check_against_oracle(inputs, backend, dtype, sort_by_length=True, alpha=1 / 128, **opts)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("dims", [(64, 64), (96, 96), (128, 64), (256, 256), (32, 48)])
def test_gpu_head_dims(backend, dims):
    inputs = _gpu_inputs(_gpu_lengths(4, 700, seed=1), dims[0], dims[1], torch.bfloat16,
                         targets=True)
    check_against_oracle(inputs, backend, torch.bfloat16, contextual_seq_len=3,
                         alpha=dims[0] ** -0.5)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("layout", ["contiguous", "fused"])
def test_gpu_long_sequences_int32_offsets(backend, layout):
    lengths = _gpu_lengths(6, 2048, seed=2)
    g = torch.Generator().manual_seed(3)
    nt = [min(int(x), n) for x, n in zip(torch.randint(1, 21, (6,), generator=g), lengths)]
    inputs = make_attention_inputs(lengths, 2, 128, 128, dtype=torch.bfloat16, seed=4,
                                   device="cuda", layout=layout, num_targets=nt,
                                   offsets_dtype=torch.int32, scale=0.5)
    assert layout == "contiguous" or inputs.q.stride(0) == 2 * (3 * 128)
    check_against_oracle(inputs, backend, torch.bfloat16, sort_by_length=True, alpha=1 / 128)


@pytest.mark.gpu
def test_gpu_tma_backend_reads_misaligned_views():
    """A view starting one element into its buffer cannot be a TMA descriptor; triton_tma
    must still give the right answer (it reads such tensors through pointers)."""
    lengths = _gpu_lengths(4, 500, seed=8)
    inputs = make_attention_inputs(lengths, 2, 64, 64, seed=9, device="cuda", layout="fused")
    buf = torch.randn(inputs.q.shape[0], 2, 3 * 64 + 1, device="cuda", dtype=torch.bfloat16)
    q, k, v = buf[..., 1:65], buf[..., 65:129], buf[..., 129:193]
    inputs = inputs.__class__(q=q, k=k, v=v, seq_offsets=inputs.seq_offsets, num_targets=None,
                              lengths=lengths, max_seq_len=inputs.max_seq_len)
    assert inputs.q.storage_offset() == 1
    check_against_oracle(inputs, "triton_tma", torch.bfloat16, alpha=0.125)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_gpu_tma_backend_rejects_other_dtypes(dtype):
    inputs = make_attention_inputs((5, 9), 2, 32, 32, dtype=dtype, device="cuda")
    with pytest.raises(BackendError, match=r"not supported by the descriptor \(TMA\) attention"):
        hstu_mha(16, 0.5, inputs.q, inputs.k, inputs.v, inputs.seq_offsets,
                 backend="triton_tma")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_gpu_tma_ops_called_directly_read_other_dtypes_through_pointers(dtype):
    """The registry never routes fp16/fp32 to ``triton_tma``, but an export pass can put a
    ``*_triton_tma`` op into a graph: it must then run the pointer-load kernel, giving
    exactly the ``*_triton`` op's forward and gradients."""
    import tzrec_ops.backends.triton.hstu_attention  # noqa: F401  (registers the ops)

    # the oracle sweep's plain causal case, which descriptors got wrong for these dtypes
    # on an H200 (on an H100 they matched here, so this guards the rule, not that bug)
    inputs = _gpu_inputs(_gpu_lengths(8, 1024), 128, 128, dtype)
    results = []
    for name in ("hstu_mha_triton", "hstu_mha_triton_tma"):
        q, k, v = (t.detach().requires_grad_() for t in inputs.tensors())
        out = getattr(torch.ops.tzrec_ops, name)(
            inputs.max_seq_len, 1 / 128, q, k, v, inputs.seq_offsets, True, None, 0, 0, True,
            -1,
        )
        torch.manual_seed(23)  # the same upstream gradient for both ops
        out.backward(torch.randn_like(out))
        results.append((out, q.grad, k.grad, v.grad))
    for pointer, tma in zip(*results):
        torch.testing.assert_close(tma, pointer, rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "backend,dtype",
    # triton_tma serves bfloat16 only (its fp16 rejection is tested on the CPU)
    [("triton", torch.bfloat16), ("triton", torch.float16), ("triton_tma", torch.bfloat16)],
)
def test_gpu_delta_matches_full_forward(backend, dtype):
    lengths = [300, 1000, 57, 800]
    inputs = _gpu_inputs(lengths, 128, 128, dtype, targets=True, seed=5).to(dtype)
    delta = 16
    offsets = inputs.seq_offsets
    rows = torch.cat([torch.arange(int(offsets[b + 1]) - delta, int(offsets[b + 1]))
                      for b in range(len(lengths))]).cuda()
    kwargs = dict(num_targets=inputs.num_targets, max_attn_len=200, contextual_seq_len=4)
    got = delta_hstu_mha(inputs.max_seq_len, 0.1, inputs.q[rows], inputs.k, inputs.v, offsets,
                         backend=backend, **kwargs)
    f64 = inputs.to(torch.float64)
    expected = hstu_mha(inputs.max_seq_len, 0.1, f64.q, f64.k, f64.v, offsets,
                        backend="pytorch", **kwargs)[rows]
    assert_close(got, expected, dtype, name="delta vs oracle full-forward rows")


def _serving_batch(dtype, seed=21):
    """The serving benchmark's shape: B = 64 sequences of a ~2000-token cache plus D = 8 new
    tokens, H = 4, d = 128, targets in [1, 12] (some reach into the cache)."""
    delta = 8
    g = torch.Generator().manual_seed(seed)
    cache = torch.randint(1800, 2001, (64,), generator=g)
    cache[0] = 2000
    lengths = (cache + delta).tolist()
    targets = torch.randint(1, 13, (64,), generator=g).tolist()
    inputs = make_attention_inputs(lengths, 4, 128, 128, dtype=dtype, seed=seed, device="cuda",
                                   layout="fused", num_targets=targets, scale=0.5)
    return inputs, delta


@pytest.mark.gpu
@pytest.mark.parametrize(
    "backend,dtype",
    [("triton", torch.bfloat16), ("triton", torch.float16), ("triton_tma", torch.bfloat16)],
)
@pytest.mark.parametrize("option", ["targets_ctx", "window_targets"])
def test_gpu_delta_split_form_serving_size(backend, dtype, option):
    """B=64, cache ~2000, D=8: the split form (cache read in place, new keys from views of
    a fused buffer) vs the float64 oracle, and vs the concatenated call on the same backend."""
    inputs, delta = _serving_batch(dtype)
    delta_q, cache_k, cache_v, cache_offsets, delta_k, delta_v, rows = split_cached(inputs, delta)
    kwargs = dict(num_targets=inputs.num_targets, contextual_seq_len=4)
    if option == "window_targets":
        kwargs["max_attn_len"] = 300
    got = delta_hstu_mha(inputs.max_seq_len, 1 / 128, delta_q, cache_k, cache_v, cache_offsets,
                         delta_k=delta_k, delta_v=delta_v, backend=backend, **kwargs)
    concatenated = delta_hstu_mha(inputs.max_seq_len, 1 / 128, delta_q, inputs.k, inputs.v,
                                  inputs.seq_offsets, backend=backend, **kwargs)
    f64 = inputs.to(torch.float64)
    expected = delta_hstu_mha(inputs.max_seq_len, 1 / 128, f64.q[rows], f64.k, f64.v,
                              inputs.seq_offsets, backend="pytorch", **kwargs)
    assert_close(got, expected, dtype, name="split delta vs oracle")
    assert_close(got, concatenated.double(), dtype, name="split vs concatenated delta")


class _SplitDelta(torch.nn.Module):
    def __init__(self, backend, max_seq_len):
        super().__init__()
        self.backend = backend
        self.max_seq_len = max_seq_len

    def forward(self, delta_q, k, v, seq_offsets, num_targets, delta_k, delta_v):
        return delta_hstu_mha(self.max_seq_len, 1 / 128, delta_q, k, v, seq_offsets,
                              num_targets, contextual_seq_len=4, delta_k=delta_k,
                              delta_v=delta_v, backend=self.backend)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_gpu_delta_split_form_compile_and_export(backend):
    """The split form's optional tensors go through torch.compile(fullgraph) and export."""
    inputs, delta = _serving_batch(torch.bfloat16, seed=22)
    delta_q, cache_k, cache_v, cache_offsets, delta_k, delta_v, rows = split_cached(inputs, delta)
    args = (delta_q, cache_k, cache_v, cache_offsets, inputs.num_targets, delta_k, delta_v)
    f64 = inputs.to(torch.float64)
    expected = delta_hstu_mha(inputs.max_seq_len, 1 / 128, f64.q[rows], f64.k, f64.v,
                              inputs.seq_offsets, inputs.num_targets, contextual_seq_len=4,
                              backend="pytorch")
    module = _SplitDelta(backend, inputs.max_seq_len)
    compiled = torch.compile(module, fullgraph=True, backend="inductor")
    assert_close(compiled(*args), expected, torch.bfloat16, name="compiled split delta")
    exported = torch.export.export(module, args)
    assert_close(exported.module()(*args), expected, torch.bfloat16, name="exported split delta")


@pytest.mark.gpu
@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("wide", [False, True])
def test_gpu_every_config_is_correct(backend, wide, monkeypatch):
    """Each autotune candidate (not only the winner) compiles and gives the right answer with
    the default ptxas: the public backward crashed on Hopper with triton 3.6's ptxas."""
    from tzrec_ops.backends.triton import autotune
    from tzrec_ops.backends.triton.hstu_attention import attention_kernels

    dim = 256 if wide else 128
    inputs = _gpu_inputs(_gpu_lengths(4, 600, seed=6), dim, dim, torch.bfloat16, targets=True)
    table = autotune._CUDA_WIDE if wide else autotune._CUDA
    for name, kernel in attention_kernels(wide).items():
        for tile in table[name]:
            monkeypatch.setattr(kernel, "configs", [autotune.tile_config(name, tile)])
            kernel.cache.clear()
            check_against_oracle(inputs, backend, torch.bfloat16, contextual_seq_len=2,
                                 alpha=dim ** -0.5)
        monkeypatch.undo()
        kernel.cache.clear()


class _Attention(torch.nn.Module):
    def __init__(self, backend):
        super().__init__()
        self.backend = backend

    def forward(self, q, k, v, seq_offsets, num_targets):
        # sort_by_length: the schedule order's own kernel is traced too
        return hstu_mha(64, 0.25, q, k, v, seq_offsets, num_targets=num_targets,
                        contextual_seq_len=2, sort_by_length=True, backend=self.backend)


def _compile_case():
    inputs = make_attention_inputs([40, 64, 0, 17], 2, 32, 32, dtype=torch.bfloat16, seed=7,
                                   device="cuda", layout="fused", num_targets=[3, 1, 0, 2])
    f64 = inputs.to(torch.float64, requires_grad=True)
    expected = hstu_mha(64, 0.25, f64.q, f64.k, f64.v, inputs.seq_offsets,
                        num_targets=inputs.num_targets, contextual_seq_len=2, backend="pytorch")
    return inputs, f64, expected


@pytest.mark.gpu
@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("compiler", ["aot_eager", "inductor"])
def test_gpu_compile_fullgraph(backend, compiler, request):
    if backend == "triton_tma" and compiler == "aot_eager":
        # The TMA kernels need triton's scratch allocator, a ContextVar that the launcher sets
        # on its own thread. aot_eager replays the backward graph's kernel calls on autograd's
        # thread without the launcher, so it fails there unless an eager TMA backward ran on
        # that thread before (order-dependent). Inductor is not affected.
        request.applymarker(pytest.mark.xfail(reason="TMA scratch allocator unset on autograd's "
                                              "thread under aot_eager", strict=False))
    inputs, f64, expected = _compile_case()
    compiled = torch.compile(_Attention(backend), fullgraph=True, backend=compiler)
    with torch.no_grad():
        out = compiled(*inputs.tensors(), inputs.seq_offsets, inputs.num_targets)
    assert_close(out, expected, torch.bfloat16, name=f"{compiler} inference out")
    q, k, v = (t.detach().requires_grad_() for t in inputs.tensors())
    out = compiled(q, k, v, inputs.seq_offsets, inputs.num_targets)
    assert_close(out, expected, torch.bfloat16, name=f"{compiler} training out")
    dout = torch.randn_like(expected)
    out.backward(dout.to(out.dtype))
    expected.backward(dout)
    for name, got, want in zip("qkv", (q, k, v), (f64.q, f64.k, f64.v)):
        assert_close(got.grad, want.grad, torch.bfloat16, grad=True, name=f"{compiler} d{name}")


@pytest.mark.gpu
@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_gpu_export_and_aoti_package(backend, tmp_path):
    inputs, _, expected = _compile_case()
    args = (*inputs.tensors(), inputs.seq_offsets, inputs.num_targets)
    exported = torch.export.export(_Attention(backend), args)
    assert_close(exported.module()(*args), expected, torch.bfloat16, name="exported out")
    path = torch._inductor.aoti_compile_and_package(exported, package_path=str(tmp_path / "m.pt2"))
    (out,) = run_package(path, args)  # a child process: see tzrec_ops.testing.aoti
    assert_close(out.to(expected.device), expected, torch.bfloat16, name="AOTInductor out")
