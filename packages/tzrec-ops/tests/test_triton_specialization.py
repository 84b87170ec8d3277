"""Triton kernels compile once per problem layout, not once per token count or seed (GPU).

Triton specializes integer arguments on ``== 1`` and on divisibility by 16, so a jagged batch
with a new token count could otherwise compile another variant of a kernel (seconds each) in
the middle of training. Data-dependent integers are listed in the kernels' ``do_not_specialize``
(the dropout seed, drawn anew each call, is a device tensor the kernels load, not an integer
argument); this test counts compiles through Triton's post-compile hook.
"""

from __future__ import annotations

import os
from collections import Counter
from typing import Any, Iterator

import pytest
import torch

os.environ.setdefault("TZREC_OPS_TRITON_AUTOTUNE", "0")

triton = pytest.importorskip("triton")

from tzrec_ops.ops.layer_norm import layer_norm_mul_dropout  # noqa: E402
from tzrec_ops.ops.mm import addmm  # noqa: E402

pytestmark = pytest.mark.gpu

E, N = 64, 96


@pytest.fixture
def compiles() -> Iterator[Counter]:
    """Names of the Triton kernels compiled while the fixture is active."""
    counter: Counter = Counter()
    knobs = triton.knobs.runtime
    previous = knobs.jit_post_compile_hook

    def hook(*args: Any, **kwargs: Any) -> bool:
        counter[kwargs["fn"].name.rsplit(".", 1)[-1]] += 1  # a qualified name
        return False

    knobs.jit_post_compile_hook = hook
    try:
        yield counter
    finally:
        knobs.jit_post_compile_hook = previous


def _train_step(tokens: int) -> None:
    x = torch.randn(tokens, E, device="cuda", requires_grad=True)
    w = torch.randn(E, N, device="cuda", requires_grad=True)
    b = torch.randn(N, device="cuda", requires_grad=True)
    y = addmm(b, x, w, backend="triton")
    u = torch.randn(tokens, N, device="cuda", requires_grad=True)
    gamma = torch.ones(N, device="cuda", requires_grad=True)
    beta = torch.zeros(N, device="cuda", requires_grad=True)
    out = layer_norm_mul_dropout(
        y, u, gamma, beta, eps=1e-5, dropout_ratio=0.1, training=True, backend="triton"
    )
    out.sum().backward()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="compiles only happen on a GPU")
def test_new_token_counts_and_seeds_compile_nothing(compiles: Counter) -> None:
    # one token count warms every kernel up: the token count is M of the forward and dx
    # products and K of the dW product, and neither form of the GEMM specializes it
    _train_step(128)
    torch.cuda.synchronize()
    warm = Counter(compiles)
    assert warm, "the warm-up compiled no Triton kernel: the hook is not counting"
    for tokens in (100, 37, 112, 1000, 4099, 1):
        _train_step(tokens)
    torch.cuda.synchronize()
    assert compiles == warm, f"new compiles after warm-up: {compiles - warm}"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="compiles only happen on a GPU")
def test_precompile_builds_every_candidate_before_timing(compiles: Counter) -> None:
    import triton.language as tl

    from tzrec_ops.backends.triton._eager import precompile

    @triton.jit
    def _scale_kernel(X, Y, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(Y + offs, tl.load(X + offs, mask=offs < n) * 2.0, mask=offs < n)

    configs = [triton.Config({"BLOCK": b}, num_warps=w) for b, w in ((64, 1), (128, 2), (256, 4))]
    tuner = triton.autotune(configs, key=["n"])(_scale_kernel)
    x = torch.randn(1000, device="cuda")
    y = torch.empty_like(x)
    precompile(tuner, (x, y, x.numel()), {})
    assert compiles["_scale_kernel"] == len(configs)
    tuner[lambda meta: (triton.cdiv(x.numel(), meta["BLOCK"]),)](x, y, x.numel())
    assert compiles["_scale_kernel"] == len(configs), "the autotuner compiled again"
    torch.testing.assert_close(y, x * 2)
