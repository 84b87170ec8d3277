"""Triton norms (layer, RMS, swish, norm-mul-dropout, group variant) against the float64 oracle.

The oracle is the pytorch backend on float64 copies. CPU runs use the Triton interpreter at
small shapes; ``pytest -m gpu`` repeats them at real sizes. Dropout cannot match another
backend's mask, so it is checked by its contract: a seed replays the same mask, the keep rate
is about 1 - p, kept entries equal the no-dropout value / (1 - p), and gradients flow only
through kept entries. The mask of an int seed is also checked against the Philox draw the
kernels made when they took the seed as a scalar (``_philox_keep``), and the GPU tests
compile the ops with dropout on: an int seed gives the eager result bit for bit.
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

from _philox_keep import philox_keep  # noqa: E402

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


@pytest.mark.parametrize("kind", ["layer", "group"])
@pytest.mark.parametrize("concat_ux", [False, True])
def test_int_seed_gives_the_mask_of_the_scalar_seed_kernels(kind, concat_ux):
    """The seed is read from a device tensor now; the mask of an int seed is still the draw
    ``tl.rand(seed, row * W + col) >= p`` of that seed (32- and 64-bit seeds; p = 0.7 rounds
    down in fp32, p = 0.3 up)."""
    rows, heads, dim = 7, 2, 6
    d = heads * dim
    wshape = (d,) if kind == "layer" else (heads,)
    got, _, _ = _inputs([(rows, d), (rows, d), wshape, wshape], torch.float32, 2)
    got = [t.detach() for t in got]
    for seed, p in ((1234, 0.3), (2**40 + 7, 0.7)):
        out = _dropout_call(kind, *got, p, seed, concat_ux, heads)
        assert torch.equal(out != 0, philox_keep(seed, out.shape, p, DEVICE)), (seed, p)


def test_seed_none_backward_replays_the_forward_mask():
    """A drawn seed is saved with the forward: the gradients are those of the forward's mask
    (recomputed here from the output's zeros against the float64 oracle)."""
    rows, heads, dim, p = 6, 2, 8, 0.4
    got, ref, g = _inputs([(rows, heads * dim), (rows, heads * dim), (heads,), (heads,)],
                          torch.float32, 4)
    torch.manual_seed(3)
    out = _dropout_call("group", *got, p, None, True, heads)
    kept = out.detach() != 0
    plain = _dropout_call("group", *ref, 0.0, None, True, heads, backend="pytorch")
    expected = torch.where(kept, plain / (1 - p), torch.zeros_like(plain))
    dy = torch.randn(out.shape, generator=g, dtype=torch.float64).to(DEVICE)
    torch.manual_seed(4)  # a backward that drew a new seed would get another mask
    out.backward(dy.float())
    expected.backward(dy)
    for i, (a, b) in enumerate(zip(got, ref)):
        assert_close(a.grad, b.grad, torch.float32, grad=True, name=f"grad of input {i}")


def _rng_state() -> torch.Tensor:
    """The state of torch's default generator of DEVICE (where a drawn seed comes from)."""
    return torch.cuda.get_rng_state() if DEVICE == "cuda" else torch.get_rng_state()


def test_dropout_off_draws_no_seed():
    """Without dropout (not training, or p = 0) nothing is drawn or filled for a seed: the
    default generator is untouched."""
    got, _, _ = _inputs([(5, 8), (5, 8), (8,), (8,)], torch.float32, 0)
    got = [t.detach() for t in got]
    state = _rng_state()
    N.layer_norm_mul_dropout(*got, 1e-5, 0.3, False, backend="triton")
    N.layer_norm_mul_dropout(*got, 1e-5, 0.0, True, backend="triton")
    assert torch.equal(_rng_state(), state)
    N.layer_norm_mul_dropout(*got, 1e-5, 0.3, True, backend="triton")
    assert not torch.equal(_rng_state(), state)


def test_op_with_dropout_needs_a_seed_tensor():
    from tzrec_ops.backends.triton.layer_norm import norm_mul_dropout_op

    x = torch.randn(3, 8, device=DEVICE)
    w = torch.ones(8, device=DEVICE)
    with pytest.raises(ValueError, match=r"dropout_p=0.5 needs a \[1\] int64 seed tensor, got No"):
        norm_mul_dropout_op(x, x, w, w, 1e-5, 0, False, 0.5, None)
    seed = torch.full((1,), 9, dtype=torch.int64, device=DEVICE)
    by_tensor = norm_mul_dropout_op(x, x, w, w, 1e-5, 0, False, 0.5, seed)[0]
    by_int = N.layer_norm_mul_dropout(x, x, w, w, 1e-5, 0.5, True, False, 9, backend="triton")
    assert torch.equal(by_tensor, by_int)


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
    seed = torch.full((1,), 5, dtype=torch.int64, device="cuda")
    torch.library.opcheck(norm_mul_dropout_op.op, (x, u, w, b, 1e-5, 0, True, 0.1, seed))
    torch.library.opcheck(norm_mul_dropout_op.op, (x, u, w, b, 1e-5, 0, False, 0.0, None))


def _eager_and_compiled(fn, inputs, dy):
    """``fn(*inputs)`` eagerly and under ``torch.compile(fullgraph=True)`` (Inductor), each on
    its own copy of ``inputs``: ((eager out, its grads), (compiled out, its grads))."""
    torch._dynamo.reset()
    results = []
    for run in (fn, torch.compile(fn, fullgraph=True)):
        copies = [t.detach().clone().requires_grad_() for t in inputs]
        out = run(*copies)
        out.backward(dy)
        results.append((out.detach(), [t.grad for t in copies]))
    return results


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("kind", ["layer", "group"])
@pytest.mark.parametrize("concat_ux", [False, True])
def test_dropout_gpu_compiled_equals_eager_for_an_int_seed(kind, concat_ux):
    """The seed is a device tensor, so dropout compiles without a graph break; with an int
    seed the compiled op draws the eager mask (that of the scalar-seed kernels) and gives
    the eager output and gradients bit for bit, but for two that may differ in rounding: the
    group norm's per-head weight and bias gradients (a torch sum over each head's features
    inside the op, which Inductor generates itself) and, with concat_ux, ``du = dy_a * a +
    dy_u`` (Inductor compiles the user kernel itself, and one compile contracts it to an FMA
    where the other does not: measured on an H100, same mask, last-bit differences)."""
    rows, heads, dim, p, seed = 1000, 4, 32, 0.3, 1234
    d = heads * dim
    wshape = (d,) if kind == "layer" else (heads,)
    got, _, g = _inputs([(rows, d), (rows, d), wshape, wshape], torch.float32, 5)
    width = 3 * d if concat_ux else d
    dy = torch.randn(rows, width, generator=g).to(DEVICE)

    def f(x, u, w, b):
        return _dropout_call(kind, x, u, w, b, p, seed, concat_ux, heads)

    (eager, eager_grads), (compiled, compiled_grads) = _eager_and_compiled(f, got, dy)
    assert torch.equal(compiled, eager)
    assert torch.equal(compiled != 0, philox_keep(seed, compiled.shape, p, DEVICE))
    for name, a, b in zip(("x", "u", "weight", "bias"), compiled_grads, eager_grads):
        if kind == "group" and name in ("weight", "bias"):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        elif concat_ux and name == "u":
            assert torch.equal(a == 0, b == 0), name  # the same mask
            torch.testing.assert_close(a, b)  # du = dy_a * a + dy_u: FMA contraction may differ
        else:
            assert torch.equal(a, b), name


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_dropout_gpu_compiles_a_drawn_seed_in_one_graph():
    """seed=None under torch.compile(fullgraph=True): the draw is a graph op (Inductor's
    generator, seeded from torch's), so compiled runs repeat under ``torch.manual_seed``,
    the backward uses the forward's mask, and with ``fallback_random`` (torch's own
    generator) the compiled op equals the eager one."""
    from torch._dynamo.utils import counters

    rows, heads, dim, p = 1000, 4, 32, 0.3
    d = heads * dim
    got, _, g = _inputs([(rows, d), (rows, d), (d,), (d,)], torch.float32, 6)
    dy = torch.randn(rows, d, generator=g).to(DEVICE)

    def f(x, u, w, b):
        return _dropout_call("layer", x, u, w, b, p, None, False, heads)

    torch._dynamo.reset()
    compiled_f = torch.compile(f, fullgraph=True)
    runs = []
    for _ in range(2):
        copies = [t.detach().clone().requires_grad_() for t in got]
        torch.manual_seed(0)
        out = compiled_f(*copies)
        out.backward(dy)
        runs.append((out.detach(), copies[1].grad))
    assert not counters["graph_break"], dict(counters["graph_break"])
    (out, du), (again, du_again) = runs
    assert torch.equal(out, again) and torch.equal(du, du_again)
    dropped = out == 0
    assert abs(dropped.double().mean().item() - p) < 0.02
    # du = dy * Norm(x) * keep / (1 - p): zero exactly where the forward dropped
    assert torch.equal(du == 0, dropped)

    import torch._inductor.config as inductor_config

    with inductor_config.patch(fallback_random=True):
        eager_copies = [t.detach().clone() for t in got]
        torch.manual_seed(1)
        eager = f(*eager_copies)
        torch._dynamo.reset()
        torch.manual_seed(1)
        compiled = torch.compile(f, fullgraph=True)(*[t.detach().clone() for t in got])
    assert torch.equal(compiled, eager)
    torch._dynamo.reset()
