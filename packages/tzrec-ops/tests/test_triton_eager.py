"""The dispatcher-free eager path of the Triton ops (``backends/triton/_eager.py``).

Eager calls with plain tensors run the op's body (and its registered autograd formula)
directly and launch kernels without ``wrap_triton``'s higher-order op; anything traced goes
through the registered ``torch.library`` op. Both paths must give identical results.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

pytest.importorskip("triton")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from tzrec_ops.backends.triton import _eager  # noqa: E402
from tzrec_ops.backends.triton._norm_kernels import _norm_fwd_kernel  # noqa: E402
from tzrec_ops.backends.triton.layer_norm import layer_norm_op  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


class _Recording(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def test_launchable_is_the_kernel_itself_unless_tracing():
    assert not _eager.tracing()
    assert _eager.launchable(_norm_fwd_kernel) is _norm_fwd_kernel
    with _Recording():
        assert _eager.tracing()


@triton.autotune([triton.Config({"BLOCK": 8}, num_warps=1)], key=["n"])
@triton.jit
def _fill_block_size(Y, n, BLOCK: tl.constexpr):
    """Y[:n] = BLOCK (so the output shows which config ran)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(Y + offs, tl.full([BLOCK], BLOCK, Y.dtype.element_ty), mask=offs < n)


def test_autotuned_kernel_runs_its_autotuner_once_per_key(monkeypatch):
    calls = []
    tuner_run = _fill_block_size.run

    def counting_run(*args, **kwargs):
        calls.append(args[1])
        return tuner_run(*args, **kwargs)

    monkeypatch.setattr(_fill_block_size, "run", counting_run)
    monkeypatch.setattr(_eager, "_LAUNCHERS", {})
    launcher = _eager.launchable(_fill_block_size)
    assert _eager.launchable(_fill_block_size) is launcher

    def fill(n: int, dtype: torch.dtype) -> torch.Tensor:
        y = torch.zeros(n + 3, dtype=dtype, device=DEVICE)
        launcher[(triton.cdiv(n, 8),)](y, n)
        expected = torch.zeros(n + 3, dtype=dtype)
        expected[:n] = 8
        torch.testing.assert_close(y.cpu(), expected, rtol=0, atol=0)
        return y

    fill(10, torch.float32)
    fill(10, torch.float32)  # same key: straight to the chosen config
    assert calls == [10]
    fill(13, torch.float32)  # new key value
    fill(10, torch.float64)  # new dtype
    fill(13, torch.float32)
    assert calls == [10, 13, 10]


def _inputs(seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(37, 24, generator=g).to(DEVICE)
    w = torch.randn(24, generator=g).to(DEVICE)
    b = torch.randn(24, generator=g).to(DEVICE)
    return [t.requires_grad_() for t in (x, w, b)]


def test_eager_path_matches_the_registered_op_forward_and_backward():
    fast, slow = _inputs(0), _inputs(0)
    y_fast = layer_norm_op(*fast, 1e-5)[0]
    y_slow = layer_norm_op.op(*slow, 1e-5)[0]
    torch.testing.assert_close(y_fast, y_slow, rtol=0, atol=0)
    dy = torch.randn(y_fast.shape, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    y_fast.backward(dy)
    y_slow.backward(dy)
    for a, b in zip(fast, slow):
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=0)


def test_eager_path_skips_the_dispatcher_and_tracing_uses_the_op():
    x, w, b = _inputs(2)
    with torch.no_grad(), _Recording() as traced:
        layer_norm_op(x, w, b, 1e-5)
    # under a dispatch mode the call goes through the registered op
    assert any("tzrec_ops.layer_norm_triton" in name for name in traced.ops)
    y = layer_norm_op(x, w, b, 1e-5)[0]
    assert y.grad_fn is not None and "EagerAutograd" in type(y.grad_fn).__name__
    with torch.no_grad():
        assert layer_norm_op(x, w, b, 1e-5)[0].grad_fn is None


def test_parameters_take_the_eager_path():
    # modules pass their nn.Parameter weights straight to the ops
    x, w, b = _inputs(3)
    weight, bias = torch.nn.Parameter(w.detach()), torch.nn.Parameter(b.detach())
    y = layer_norm_op(x, weight, bias, 1e-5)[0]
    assert "EagerAutograd" in type(y.grad_fn).__name__
    y.sum().backward()
    assert weight.grad is not None and bias.grad is not None


def test_eager_path_materializes_the_gradient_of_an_unused_output():
    """The fused op returns (u, attn, saved values...); with u unused its gradient arrives as
    None and the eager path must treat it as zeros, exactly like the registered op."""
    from tzrec_ops.backends.triton.hstu_compute import preprocess_and_attention_op

    heads, dim, embed = 2, 8, 16
    g = torch.Generator().manual_seed(3)

    def inputs():
        t = [
            torch.randn(9, embed, generator=g),
            torch.randn(embed, generator=g),
            torch.randn(embed, generator=g),
            torch.randn(embed, 4 * heads * dim, generator=g) / embed**0.5,
            torch.randn(4 * heads * dim, generator=g),
        ]
        return [x.to(DEVICE).requires_grad_() for x in t]

    fast = inputs()
    slow = [t.detach().clone().requires_grad_() for t in fast]
    offsets = torch.tensor([0, 4, 9], device=DEVICE)

    def attn(op, x, nw, nb, w, b):
        return op(
            x,
            nw,
            nb,
            1e-5,
            heads,
            dim,
            dim,
            w,
            b,
            8,
            offsets,
            0.5,
            True,
            None,
            0,
            0,
            False,
            False,
            False,
            -1,
        )[1]

    attn(preprocess_and_attention_op, *fast).sum().backward()
    attn(preprocess_and_attention_op.op, *slow).sum().backward()
    for a, b in zip(fast, slow):
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=0)


def test_autotune_keys_of_symbolic_sizes_add_no_guard():
    """Under ``torch.export``'s dynamic dims a row count is a SymInt: its autotune key comes
    from the example value without specializing the graph (no guard on the size)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from tzrec_ops.backends.triton._kernel_utils import quantize_rows

    keys = []

    def f(x):
        keys.append(quantize_rows(x.shape[0]))
        return x * 2

    graph = make_fx(f, tracing_mode="symbolic")(torch.ones(40))
    assert keys == [32]
    assert not graph.shape_env.guards
    assert [quantize_rows(n) for n in (0, 1, 33, 64)] == [1, 1, 32, 64]
