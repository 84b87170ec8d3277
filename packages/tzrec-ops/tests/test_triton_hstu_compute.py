"""Triton STU blocks (uqvk, fused preprocess + attention, fused output) against the oracle.

The oracle is the pytorch backend (unfused) on float64 copies. CPU runs use the Triton
interpreter at small shapes; ``pytest -m gpu`` repeats them at real sizes and compiles them,
the fused output with dropout on as well.
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

from tzrec_ops.jagged import offsets_from_lengths  # noqa: E402
from tzrec_ops.ops import hstu_compute as HC  # noqa: E402
from tzrec_ops.registry import BackendError  # noqa: E402
from tzrec_ops.testing.tolerances import assert_close  # noqa: E402

pytest.importorskip("triton")

from _philox_keep import philox_keep  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FLAGS = [(False, False), (True, False), (False, True), (True, True)]


def _params(shapes, dtype, seed, scale=0.5):
    g = torch.Generator().manual_seed(seed)
    base = [torch.randn(*s, generator=g, dtype=torch.float64) * scale for s in shapes]
    got = [t.to(DEVICE, dtype).requires_grad_() for t in base]
    ref = [t.to(dtype).to(DEVICE, torch.float64).requires_grad_() for t in base]
    return got, ref, g


def _grads_close(got, ref, dtype, names):
    for name, a, b in zip(names, got, ref):
        assert_close(a.grad, b.grad, dtype, grad=True, name=name)


def _preprocess_case(
    lengths,
    targets,
    E,
    H,
    A,
    V,
    dtype,
    recompute_normed,
    recompute_uvqk,
    contextual=0,
    max_attn_len=0,
    sort_by_length=False,
    fused=True,
    seed=0,
):
    offsets = offsets_from_lengths(lengths).to(DEVICE)
    num_targets = torch.tensor(targets, device=DEVICE) if targets is not None else None
    L, W = sum(lengths), 2 * H * (A + V)
    got, ref, g = _params([(L, E), (E,), (E,), (E, W), (W,)], dtype, seed)
    max_seq_len = max(lengths + [1])

    def run(x, nw, nb, w, b, backend):
        return HC.hstu_preprocess_and_attention(
            x,
            nw,
            nb,
            1e-5,
            H,
            A,
            V,
            w,
            b,
            max_seq_len,
            offsets,
            1.0 / A**0.5,
            True,
            num_targets,
            max_attn_len,
            contextual,
            recompute_uvqk,
            recompute_normed,
            sort_by_length,
            prefill=not fused,
            backend=backend,
        )

    u, attn, k, v = run(*got, "triton")
    assert (k is None and v is None) if fused else (k is not None and v is not None)
    u_ref, attn_ref, _, _ = run(*ref, "pytorch")
    assert_close(u, u_ref, dtype, name="u")
    assert_close(attn, attn_ref, dtype, name="attn")
    du = torch.randn(u.shape, generator=g, dtype=torch.float64).to(dtype)
    da = torch.randn(attn.shape, generator=g, dtype=torch.float64).to(dtype)
    ((u * du.to(DEVICE)).sum() + (attn * da.to(DEVICE)).sum()).float().backward()
    (
        (u_ref * du.to(DEVICE, torch.float64)).sum()
        + (attn_ref * da.to(DEVICE, torch.float64)).sum()
    ).backward()
    _grads_close(
        got, ref, dtype, ["dx", "d_norm_weight", "d_norm_bias", "d_uvqk_weight", "d_uvqk_bias"]
    )


@pytest.mark.parametrize("recompute_normed,recompute_uvqk", FLAGS)
def test_fused_preprocess_and_attention(recompute_normed, recompute_uvqk):
    _preprocess_case(
        [5, 0, 9, 1], [2, 0, 3, 1], 24, 2, 8, 12, torch.float32, recompute_normed, recompute_uvqk
    )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fused_preprocess_and_attention_half(dtype):
    _preprocess_case([7, 4], None, 16, 1, 16, 16, dtype, False, True, max_attn_len=3)


@pytest.mark.parametrize("recompute_normed,recompute_uvqk", FLAGS)
def test_uqvk_path_bitwise_across_recompute_flags(recompute_normed, recompute_uvqk):
    """prefill=True runs hstu_compute_uqvk + attention; remat must not change a single bit."""

    def grads(rn, ru):
        got, _, _ = _params(
            [(6, 16), (16,), (16,), (16, 2 * 2 * (8 + 4)), (2 * 2 * (8 + 4),)], torch.float32, 3
        )
        u, q, k, v = HC.hstu_compute_uqvk(
            *got[:3], 1e-5, 2, 8, 4, *got[3:], rn, ru, backend="triton"
        )
        (u.sum() + (q * 2).sum() + (k * 3).sum() + (v * 4).sum()).backward()
        return [u, q, k, v] + [t.grad for t in got]

    for a, b in zip(grads(False, False), grads(recompute_normed, recompute_uvqk)):
        assert torch.equal(a, b)
    _preprocess_case(
        [3, 6], [1, 2], 16, 2, 8, 4, torch.float32, recompute_normed, recompute_uvqk, fused=False
    )


def _output_case(L, E, H, V, dtype, concat_ux, group_norm, recompute_y, seed=0):
    hv = H * V
    norm_shape = (H,) if group_norm else (hv,)
    got, ref, g = _params(
        [(L, hv), (L, hv), (L, E), norm_shape, norm_shape, ((3 if concat_ux else 1) * hv, E)],
        dtype,
        seed,
    )

    def run(attn, u, x, nw, nb, w, backend):
        return HC.hstu_compute_output(
            attn,
            u,
            x,
            nw,
            nb,
            1e-5,
            w,
            H,
            V,
            0.2,
            False,
            concat_ux,
            group_norm,
            recompute_y,
            backend=backend,
        )

    out = run(*got, "triton")
    expected = run(*ref, "pytorch")
    assert_close(out, expected, dtype, name="out")
    dout = torch.randn(out.shape, generator=g, dtype=torch.float64).to(dtype)
    out.backward(dout.to(DEVICE))
    expected.backward(dout.to(DEVICE, torch.float64))
    _grads_close(
        got, ref, dtype, ["d_attn", "du", "dx", "d_norm_weight", "d_norm_bias", "d_output_weight"]
    )


@pytest.mark.parametrize("concat_ux", [False, True])
@pytest.mark.parametrize("group_norm", [False, True])
@pytest.mark.parametrize("recompute_y", [False, True])
def test_compute_output(concat_ux, group_norm, recompute_y):
    _output_case(9, 20, 2, 6, torch.float32, concat_ux, group_norm, recompute_y)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_compute_output_half(dtype):
    _output_case(7, 16, 4, 4, dtype, True, True, False)


@pytest.mark.parametrize("concat_ux", [False, True])
def test_compute_output_dropout_seed_replay(concat_ux):
    """Training dropout: a torch seed replays the mask, and recomputing y in the backward
    (which regenerates the mask from the kernel seed) gives the gradients of saving it."""
    results = []
    for recompute_y in (False, True):
        got, _, _ = _params(
            [(8, 12), (8, 12), (8, 10), (12,), (12,), ((3 if concat_ux else 1) * 12, 10)],
            torch.float32,
            4,
        )
        torch.manual_seed(11)
        out = HC.hstu_compute_output(
            *got[:5], 1e-5, got[5], 3, 4, 0.4, True, concat_ux, False, recompute_y, backend="triton"
        )
        out.sum().backward()
        results.append([out] + [t.grad for t in got])
    for a, b in zip(*results):
        assert torch.equal(a, b)
    got, _, _ = _params(
        [(8, 12), (8, 12), (8, 10), (12,), (12,), ((3 if concat_ux else 1) * 12, 10)],
        torch.float32,
        4,
    )
    plain = HC.hstu_compute_output(
        *got[:5], 1e-5, got[5], 3, 4, 0.4, False, concat_ux, False, False, backend="triton"
    )
    assert not torch.equal(plain, results[0][0])


def test_compute_output_dropout_mask_is_the_draw_of_its_seed(monkeypatch):
    """The fused output draws its seed on the device (one [1] int64 tensor per call) and its
    mask is that seed's Philox draw. With x = 0 and W = I the output is y itself."""
    from tzrec_ops.backends.triton import _stu_output

    drawn = []
    draw = _stu_output.dropout_seed

    def recording(seed, device):
        drawn.append(draw(seed, device))
        return drawn[-1]

    monkeypatch.setattr(_stu_output, "dropout_seed", recording)

    L, H, V, p = 5, 2, 4, 0.4
    got, _, _ = _params([(L, H * V), (L, H * V), (H * V,), (H * V,)], torch.float32, 8)
    x = torch.zeros(L, H * V, device=DEVICE)
    eye = torch.eye(H * V, device=DEVICE)
    out = HC.hstu_compute_output(
        got[0], got[1], x, got[2], got[3], 1e-5, eye, H, V, p, True, False, False, False,
        backend="triton",
    )
    (seed,) = drawn
    assert seed.shape == (1,) and seed.dtype == torch.int64 and seed.device == out.device
    assert torch.equal(out != 0, philox_keep(int(seed.item()), out.shape, p, DEVICE))


def test_fused_rejects_attn_func():
    got, _, _ = _params([(4, 8), (8,), (8,), (8, 16), (16,)], torch.float32, 0)
    offsets = offsets_from_lengths([4]).to(DEVICE)
    attn_func = torch.zeros(1, 3, 4, dtype=torch.int32, device=DEVICE)
    with pytest.raises(BackendError, match="attn_func"):
        HC.hstu_preprocess_and_attention(
            *got[:3],
            1e-5,
            1,
            4,
            4,
            *got[3:],
            4,
            offsets,
            0.5,
            True,
            None,
            0,
            0,
            False,
            False,
            False,
            attn_func=attn_func,
            backend="triton",
        )


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_stu_gpu_real_sizes(dtype):
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(200, 600, (16,), generator=g).tolist()
    targets = torch.randint(1, 20, (16,), generator=g).tolist()
    for rn, ru in ((False, False), (True, True)):
        _preprocess_case(lengths, targets, 256, 4, 64, 64, dtype, rn, ru)
    for concat_ux, group_norm, recompute_y in ((True, False, False), (False, True, True)):
        _output_case(7001, 512, 4, 128, dtype, concat_ux, group_norm, recompute_y)


@pytest.mark.gpu
def test_stu_gpu_compile():
    """The compiled fused layer equals the eager one up to bf16 rounding (inductor may fuse
    the surrounding pointwise ops in fp32), forward and backward. The eager layer's accuracy
    against the float64 oracle is tested op by op above."""
    lengths = [100, 37, 250]
    offsets = offsets_from_lengths(lengths).to("cuda")
    got, _, _ = _params(
        [(387, 64), (64,), (64,), (64, 2 * 2 * 64), (2 * 2 * 64,), (2,), (2,), (64, 64)],
        torch.bfloat16,
        0,
    )

    def layer(x, nw, nb, w, b, onw, onb, ow, backend="triton"):
        u, attn, _, _ = HC.hstu_preprocess_and_attention(
            x,
            nw,
            nb,
            1e-5,
            2,
            32,
            32,
            w,
            b,
            250,
            offsets,
            0.2,
            True,
            None,
            0,
            0,
            True,
            True,
            False,
            backend=backend,
        )
        return HC.hstu_compute_output(
            attn, u, x, onw, onb, 1e-5, ow, 2, 32, 0.0, True, False, True, True, backend=backend
        )

    eager_inputs = [t.detach().clone().requires_grad_() for t in got]
    out = torch.compile(layer, fullgraph=True)(*got)
    expected = layer(*eager_inputs)
    assert_close(out, expected.double(), torch.bfloat16, name="compiled out")
    grad = torch.randn_like(expected)
    out.backward(grad)
    expected.backward(grad)
    for name, a, b in zip(["x", "nw", "nb", "w", "b", "onw", "onb", "ow"], got, eager_inputs):
        assert_close(a.grad, b.grad.double(), torch.bfloat16, grad=True, name=name)


def _eager_and_compiled(fn, inputs, dout, torch_seed=0):
    """``fn(*inputs)`` eagerly and under ``torch.compile(fullgraph=True)`` (Inductor), each on
    its own copy of ``inputs`` after ``torch.manual_seed(torch_seed)``: a list of
    (out, grads) for the eager run and the compiled one."""
    torch._dynamo.reset()
    results = []
    for run in (fn, torch.compile(fn, fullgraph=True)):
        copies = [t.detach().clone().requires_grad_() for t in inputs]
        torch.manual_seed(torch_seed)
        out = run(*copies)
        out.backward(dout)
        results.append((out.detach(), [t.grad for t in copies]))
    return results


def _output_inputs(L, E, H, V, concat_ux, group_norm):
    hv = H * V
    norm_shape = (H,) if group_norm else (hv,)
    shapes = [(L, hv), (L, hv), (L, E), norm_shape, norm_shape, ((3 if concat_ux else 1) * hv, E)]
    got, _, g = _params(shapes, torch.float32, 9)
    return got, torch.randn(L, E, generator=g).to(DEVICE)


_OUTPUT_GRADS = ["d_attn", "du", "dx", "d_norm_weight", "d_norm_bias", "d_output_weight"]


def _assert_equal_grads(got, expected, group_norm, concat_ux):
    """Bit for bit, except two that may differ in rounding: the group norm's per-head weight
    and bias gradients (a torch sum over each head's features inside the op, which Inductor
    generates itself) and, with concat_ux, ``du = dy_a * a + dy_u`` (Inductor compiles the
    user kernel itself, and one compile contracts it to an FMA where the other does not:
    measured on an H100, same mask, last-bit differences)."""
    for name, a, b in zip(_OUTPUT_GRADS, got, expected):
        if group_norm and name in ("d_norm_weight", "d_norm_bias"):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        elif concat_ux and name == "du":
            assert torch.equal(a == 0, b == 0), name  # the same mask
            torch.testing.assert_close(a, b)
        else:
            assert torch.equal(a, b), name


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize(
    "concat_ux,group_norm,recompute_y",
    [(False, False, False), (True, False, True), (True, True, False)],
)
def test_compute_output_gpu_compiled_equals_eager_for_an_int_seed(
    concat_ux, group_norm, recompute_y
):
    """The fused output op with dropout on and a fixed seed (filled in the graph, as an int
    seed is; ``hstu_compute_output`` itself draws one per call): compiled with fullgraph it
    equals the eager op bit for bit, forward and backward (fp32: Triton GEMMs both ways)."""
    from tzrec_ops.backends.triton._stu_output import compute_output_op

    L, E, H, V, p = 1000, 64, 4, 32, 0.2
    got, dout = _output_inputs(L, E, H, V, concat_ux, group_norm)

    def f(attn, u, x, nw, nb, w):
        seed = torch.full((1,), 1234, dtype=torch.int64, device=x.device)
        return compute_output_op(
            attn, u, x, nw, nb, 1e-5, w, H, group_norm, concat_ux, p, seed, recompute_y
        )[0]

    (eager, eager_grads), (compiled, compiled_grads) = _eager_and_compiled(f, got, dout)
    assert torch.equal(compiled, eager)
    _assert_equal_grads(compiled_grads, eager_grads, group_norm, concat_ux)
    assert torch.equal(f(*[t.detach() for t in got]), eager)  # the seed's mask again
    seed = torch.full((1,), 1234, dtype=torch.int64, device=DEVICE)
    args = (*got[:5], 1e-5, got[5], H, group_norm, concat_ux, p, seed, recompute_y)
    torch.library.opcheck(compute_output_op.op, args)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_compute_output_gpu_compiles_with_a_drawn_seed():
    """``hstu_compute_output`` with dropout on (its seed drawn per call) compiles as one graph:
    Inductor draws the seed with its own generator, so two compiled runs under one
    ``torch.manual_seed`` agree; with ``fallback_random`` (torch's generator) the compiled
    layer equals the eager one bit for bit, forward and backward."""
    import torch._inductor.config as inductor_config
    from torch._dynamo.utils import counters

    L, E, H, V, p = 1000, 64, 4, 32, 0.2
    got, dout = _output_inputs(L, E, H, V, True, False)

    def f(attn, u, x, nw, nb, w):
        return HC.hstu_compute_output(
            attn, u, x, nw, nb, 1e-5, w, H, V, p, True, True, False, True, backend="triton"
        )

    torch._dynamo.reset()
    compiled_f = torch.compile(f, fullgraph=True)
    runs = []
    for _ in range(2):
        copies = [t.detach().clone().requires_grad_() for t in got]
        torch.manual_seed(3)
        out = compiled_f(*copies)
        out.backward(dout)
        runs.append([out.detach()] + [t.grad for t in copies])
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert all(torch.isfinite(t).all() for t in runs[0])
    for a, b in zip(*runs):
        assert torch.equal(a, b)
    with inductor_config.patch(fallback_random=True):
        (eager, eager_grads), (compiled, compiled_grads) = _eager_and_compiled(f, got, dout)
    assert torch.equal(compiled, eager)
    _assert_equal_grads(compiled_grads, eager_grads, False, True)
    torch._dynamo.reset()
