"""The STU stack on the triton backend against the pytorch backend.

CPU: the Triton interpreter (TRITON_INTERPRET=1, set before triton is imported) at tiny
shapes. GPU (``-m gpu``): real sizes in bf16. Skipped, with the reason, while the triton
backend does not implement every op the STU layer calls.
"""

from __future__ import annotations

import copy
import importlib.util
import os

import pytest
import torch

import tzrec_ops
from tzrec_gr import STULayer, STUStack
from tzrec_gr.stu.layer import _LAYER_OPS
from tzrec_ops.jagged import offsets_from_lengths


def _triton_missing_ops():
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed"
    ops = tzrec_ops.get_backend("triton").ops
    missing = [op for op in _LAYER_OPS if op not in ops]
    return f"triton backend lacks {', '.join(missing)}" if missing else None


def _stacks(e, h, d, layers, device, dtype):
    ref = STUStack(
        [
            STULayer(e, h, d, d, output_dropout_ratio=0.0, backend="pytorch", device=device)
            for _ in range(layers)
        ]
    ).to(dtype)
    tri = copy.deepcopy(ref)
    for layer in tri.stu_layers:
        layer._backend = tzrec_ops.get_backend("triton")
    return ref, tri


def _compare(lengths, e, h, d, device, dtype, tol):
    ref, tri = _stacks(e, h, d, 2, device, dtype)
    offsets = offsets_from_lengths(lengths).to(device)
    targets = (lengths // 4).clamp(min=1).to(device)
    x = torch.randn(int(lengths.sum()), e, device=device, dtype=dtype)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    n = int(lengths.max())
    out_ref = ref(x1, offsets, n, targets).x
    out_tri = tri(x2, offsets, n, targets).x
    torch.testing.assert_close(out_tri.float(), out_ref.float(), **tol)
    grad = torch.randn_like(out_ref)
    out_ref.backward(grad)
    out_tri.backward(grad)
    torch.testing.assert_close(x2.grad.float(), x1.grad.float(), **tol)


@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="set TRITON_INTERPRET=1 before starting pytest to run triton on the CPU",
)
def test_stack_triton_interpreter_matches_pytorch():
    reason = _triton_missing_ops()
    if reason:
        pytest.skip(reason)
    _compare(torch.tensor([5, 9, 3]), 32, 2, 16, "cpu", torch.float32, {"rtol": 1e-4, "atol": 1e-4})


@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="set TRITON_INTERPRET=1 before starting pytest to run triton on the CPU",
)
@pytest.mark.parametrize("update_cache", [False, True])
def test_cached_forward_triton_interpreter_matches_full_forward(update_cache):
    """Incremental serving on triton (attention reads the cache in place): the Δ new tokens'
    outputs equal the full forward's last Δ rows on triton and the pytorch stack's, for one
    layer and for the stack; scoring (update_cache=False) returns no cache."""
    reason = _triton_missing_ops()
    if reason:
        pytest.skip(reason)
    ref, tri = (
        STUStack(
            [
                STULayer(
                    32,
                    2,
                    16,
                    16,
                    output_dropout_ratio=0.0,
                    contextual_seq_len=2,
                    scaling_seqlen=40,
                    backend=backend,
                )
                for _ in range(2)
            ]
        ).eval()
        for backend in ("pytorch", "triton")
    )
    tri.load_state_dict(ref.state_dict())
    delta = 3
    lengths = torch.tensor([9, 3, 20])  # the second sample has an empty history cache
    offsets = offsets_from_lengths(lengths)
    targets = torch.tensor([2, 3, 1])
    x = torch.randn(int(lengths.sum()), 32)
    rows = torch.cat([torch.arange(int(e) - delta, int(e)) for e in offsets[1:]])
    tol = {"rtol": 1e-4, "atol": 1e-4}
    outs = {}
    with torch.inference_mode():
        for name, stack in (("pytorch", ref), ("triton", tri)):
            full = stack(x, offsets, 24, targets).x
            caches = stack(
                x,
                offsets,
                24,
                targets,
                kv_caching_lengths=lengths - delta,
                max_kv_caching_len=24 - delta,
                total_kv_caching_len=int((lengths - delta).sum()),
            ).kv_caches
            out, new = stack.cached_forward(x[rows], caches, targets, update_cache=update_cache)
            layer_out, layer_new = stack.stu_layers[0].cached_forward(
                x[rows], caches[0], targets, update_cache=update_cache
            )
            first = stack.stu_layers[0](x, offsets, 24, targets).out
            torch.testing.assert_close(out, full[rows], **tol)
            torch.testing.assert_close(layer_out, first[rows], **tol)
            assert (new is None) == (not update_cache)
            assert (layer_new is None) == (not update_cache)
            outs[name] = out
    torch.testing.assert_close(outs["triton"], outs["pytorch"], **tol)


@pytest.mark.gpu
def test_stack_triton_matches_float64_oracle_gpu():
    """bf16 on triton against the same (bf16-rounded) weights run in float64 on pytorch."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    reason = _triton_missing_ops()
    if reason:
        pytest.skip(reason)
    from tzrec_ops.testing.tolerances import assert_close

    torch.manual_seed(0)
    lengths = torch.randint(900, 1024, (16,))
    tri, _ = _stacks(512, 4, 128, 2, "cuda", torch.bfloat16)
    oracle = copy.deepcopy(tri).double()
    for layer in oracle.stu_layers:
        layer._backend = tzrec_ops.get_backend("pytorch")
    offsets = offsets_from_lengths(lengths).cuda()
    targets = (lengths // 4).clamp(min=1).cuda()
    x = torch.randn(int(lengths.sum()), 512, device="cuda", dtype=torch.bfloat16)
    x_tri, x_ref = x.clone().requires_grad_(), x.double().requires_grad_()
    n = int(lengths.max())
    out_tri = tri(x_tri, offsets, n, targets).x
    out_ref = oracle(x_ref, offsets, n, targets).x
    assert_close(out_tri, out_ref, torch.bfloat16, name="stack output")
    grad = torch.randn_like(out_ref)
    out_tri.backward(grad.to(torch.bfloat16))
    out_ref.backward(grad)
    assert_close(x_tri.grad, x_ref.grad, torch.bfloat16, grad=True, name="x.grad")


@pytest.mark.gpu
@pytest.mark.parametrize("update_cache", [False, True])
def test_cached_forward_triton_matches_float64_oracle_gpu(update_cache):
    """Serving size (B=64, ~2000-token caches, Δ=8, bf16): the triton stack's cached forward
    against the same weights in float64 on pytorch, each with caches from its own prefill."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    reason = _triton_missing_ops()
    if reason:
        pytest.skip(reason)
    from tzrec_ops.testing.tolerances import assert_close

    torch.manual_seed(1)
    delta = 8
    cache = torch.randint(1800, 2001, (64,))
    lengths = cache + delta
    n = int(lengths.max())
    tri, _ = _stacks(512, 4, 128, 2, "cuda", torch.bfloat16)
    for layer in tri.stu_layers:
        layer.scaling_seqlen = 2048
    tri.eval()
    oracle = copy.deepcopy(tri).double()
    for layer in oracle.stu_layers:
        layer._backend = tzrec_ops.get_backend("pytorch")
    offsets = offsets_from_lengths(lengths).cuda()
    targets = torch.randint(1, delta + 1, (64,)).cuda()
    x = torch.randn(int(lengths.sum()), 512, device="cuda", dtype=torch.bfloat16)
    rows = (offsets[1:, None] - delta + torch.arange(delta, device="cuda")).reshape(-1)
    outs = []
    with torch.inference_mode():
        for stack, inputs in ((tri, x), (oracle, x.double())):
            caches = stack(
                inputs,
                offsets,
                n,
                targets,
                kv_caching_lengths=(lengths - delta).cuda(),
                max_kv_caching_len=n - delta,
                total_kv_caching_len=int(cache.sum()),
            ).kv_caches
            out, new = stack.cached_forward(
                inputs[rows], caches, targets, update_cache=update_cache
            )
            assert (new is None) == (not update_cache)
            outs.append(out)
    assert_close(outs[0], outs[1], torch.bfloat16, name="cached stack output")
