"""Triton ``addmm``: ``z = bias + a @ b`` with a broadcast ``[N]`` or full ``[M, N]`` bias.

One tiled GEMM kernel (grouped program order, fp32 accumulation) serves the forward and both
backward products, through strides:

* forward ``z = y + x @ w``;
* ``dx = dz @ w^T`` (``w`` read transposed through its strides);
* ``dw = x^T @ dz``, which also reduces ``db = sum_rows dz`` for a 1-D bias while it streams
  ``dz`` (only the programs of the first output row block write it, so no atomics).
* optionally ``silu`` of the first columns of the forward product, applied to the fp32
  accumulator in the epilogue (the STU input projection's ``u``), so no elementwise pass
  re-reads the product.

``dw`` reduces over every token (K = L, ~10^5) into a small output (E x 4HD: 64 tiles of
128 x 128 at E=512, H=4, D=128), too few programs for the GPU. Such products are split along
K (:func:`split_k`): each split writes fp32 partial sums, then one ``sum`` adds them in a fixed
order, so the result stays deterministic. The autotune key quantizes M and K, so a new token
count does not trigger a new tuning run.

On an NVIDIA GPU, bfloat16 and float16 products of at least :data:`CUBLAS_MIN_WORK`
multiply-adds go to cuBLAS instead (``torch.addmm``, with ``db`` and the SiLU as separate
passes), because it was faster at every STU-layer shape measured, forward and both
backward products (figures in docs/tzrec-ops-measurements.md). The Triton kernel
keeps float32, AMD GPUs, the interpreter, runs under ``torch.use_deterministic_algorithms``
(its split along K adds in a fixed order; torch refuses cuBLAS there without a
``CUBLAS_WORKSPACE_CONFIG``) and smaller products: their time is the host's, and the fused
kernel launches once where cuBLAS needs up to three launches.

Shapes: x ``[M, K]``, w ``[K, N]``, bias ``[N]`` or ``[M, N]``, z ``[M, N]``.
"""

from __future__ import annotations

from typing import Any, List, Optional, Tuple

import torch
import triton
import triton.language as tl

from tzrec_ops.backends.triton._eager import launchable, triton_library_op
from tzrec_ops.backends.triton._kernel_utils import (
    input_precision,
    interpreting,
    num_sms,
    quantize_rows,
    tuned,
)
from tzrec_ops.ops.utils import cdiv


def _cuda_configs() -> List[triton.Config]:
    shapes = [
        (128, 256, 64, 3, 8),
        (256, 128, 64, 3, 8),
        (128, 128, 64, 4, 8),
        (128, 128, 64, 3, 4),
        (128, 64, 64, 4, 4),
        (64, 128, 64, 4, 4),
        (64, 256, 32, 4, 4),
        (64, 64, 64, 4, 4),
    ]
    return [
        triton.Config(
            {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8},
            num_stages=stages,
            num_warps=warps,
        )
        for bm, bn, bk, stages, warps in shapes
    ]


_INTERPRET_CONFIG = triton.Config(
    {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16, "GROUP_M": 2}, num_warps=1
)


def _addmm_kernel(
    A,
    B,
    C,
    BIAS,
    COLSUM,
    ACT,
    M,
    N,
    K,
    stride_am,
    stride_ak,
    stride_bk,
    stride_bn,
    stride_cm,
    stride_cn,
    stride_biasm,
    stride_biasn,
    stride_cs,
    stride_actm,
    act_cols,
    K_PER_SPLIT,
    AUTOTUNE_M,
    AUTOTUNE_K,
    HAS_BIAS: tl.constexpr,
    COLSUM_B: tl.constexpr,
    SILU_OUT: tl.constexpr,
    UPCAST: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    """``C = BIAS + A @ B``; with ``COLSUM_B`` also ``COLSUM = sum over K of B`` ([N], fp32);
    with ``SILU_OUT`` also ``ACT = silu(C[:, :act_cols])`` from the fp32 accumulator (no split).

    Split along K: program ``(pid, s)`` covers ``K`` rows ``[s * K_PER_SPLIT, ...)`` and writes
    ``C + s * stride_cs`` (and ``COLSUM + s * N``)."""
    pid = tl.program_id(0)
    split = tl.program_id(1)
    k_lo = split * K_PER_SPLIT
    k_hi = tl.minimum(k_lo + K_PER_SPLIT, K)
    grid_m = tl.cdiv(M, BLOCK_M)
    grid_n = tl.cdiv(N, BLOCK_N)
    group_size = GROUP_M * grid_n
    group = pid // group_size
    first_m = group * GROUP_M
    rows_in_group = tl.minimum(grid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % group_size) % rows_in_group
    pid_n = (pid % group_size) // rows_in_group

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    a_ptrs = A + offs_m[:, None].to(tl.int64) * stride_am + (k_lo + offs_k[None, :]) * stride_ak
    b_ptrs = B + (k_lo + offs_k[:, None]).to(tl.int64) * stride_bk + offs_n[None, :] * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    colsum = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        mask_k = offs_k + k0 < k_hi
        a = tl.load(a_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
        if COLSUM_B:
            if pid_m == 0:
                colsum += tl.sum(b.to(tl.float32), axis=0)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    if HAS_BIAS:
        bias = tl.load(
            BIAS + offs_m[:, None].to(tl.int64) * stride_biasm + offs_n[None, :] * stride_biasn,
            mask=mask_m[:, None] & mask_n[None, :],
            other=0.0,
        )
        acc += bias.to(tl.float32)
    c_ptrs = (
        C
        + split.to(tl.int64) * stride_cs
        + offs_m[:, None].to(tl.int64) * stride_cm
        + offs_n[None, :] * stride_cn
    )
    tl.store(c_ptrs, acc.to(C.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])
    if SILU_OUT:
        if pid_n * BLOCK_N < act_cols:
            tl.store(
                ACT + offs_m[:, None].to(tl.int64) * stride_actm + offs_n[None, :],
                (acc * tl.sigmoid(acc)).to(ACT.dtype.element_ty),
                mask=mask_m[:, None] & (offs_n[None, :] < act_cols),
            )
    if COLSUM_B:
        if pid_m == 0:
            tl.store(COLSUM + split * N + offs_n, colsum, mask=mask_n)


# Two compiled forms of the kernel, which differ only in the integers Triton may specialize
# (on == 1 and divisibility by 16). A token count must not be specialized, or each new count
# could compile another variant mid-training; the size that bounds a unit-stride dimension of
# ``a`` must be, or its loads are not vectorized. Row-major ``a`` (the forward and dx): M is
# the token count, K a feature dim. Transposed ``a`` (dw = x^T dz, contiguous along M): K is
# the token count and M a feature dim, and an unspecialized M there makes the loads along M
# scalar (a large slowdown of the training step's addmm kernels).
_ROW_MAJOR_KERNEL = triton.jit(do_not_specialize=["M", "AUTOTUNE_M", "AUTOTUNE_K"])(_addmm_kernel)
_TRANSPOSED_KERNEL = triton.jit(do_not_specialize=["K", "K_PER_SPLIT", "AUTOTUNE_M", "AUTOTUNE_K"])(
    _addmm_kernel
)


def _kernel_for(a: torch.Tensor) -> Any:
    """The compiled form of the kernel for operand ``a`` (see above)."""
    if a.stride(0) == 1 and a.stride(1) != 1:
        return _TRANSPOSED_KERNEL
    return _ROW_MAJOR_KERNEL


_MIN_SPLIT_DEPTH = 2048


def split_k(m: int, n: int, k: int, device: torch.device) -> int:
    """How many K splits a bias-free ``[M, K] @ [K, N]`` gets: enough 128 x 128 output tiles
    times splits for two programs per SM, each split at least ``_MIN_SPLIT_DEPTH`` deep."""
    tiles = cdiv(m, 128) * cdiv(n, 128)
    wanted = cdiv(2 * num_sms(device), tiles)
    return max(1, min(wanted, k // _MIN_SPLIT_DEPTH))


#: the fewest multiply-adds (M * K * N) of a product handed to cuBLAS: ~35 us of bf16 work
#: on an H100, above the host time of a launch and its extra passes
CUBLAS_MIN_WORK = 1 << 33


def uses_cublas(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether :func:`matmul` hands ``a @ b`` to cuBLAS (see the module docstring): bfloat16
    or float16 on an NVIDIA GPU, at least :data:`CUBLAS_MIN_WORK` multiply-adds, deterministic
    algorithms off."""
    return (
        a.shape[0] * a.shape[1] * b.shape[1] >= CUBLAS_MIN_WORK
        and a.dtype in (torch.bfloat16, torch.float16)
        and a.is_cuda
        and torch.version.hip is None
        and not interpreting()
        and not torch.are_deterministic_algorithms_enabled()
    )


def _cublas_matmul(
    a: torch.Tensor,
    b: torch.Tensor,
    out: torch.Tensor,
    bias: Optional[torch.Tensor],
    colsum: Optional[torch.Tensor],
    silu_out: Optional[torch.Tensor],
) -> None:
    """:func:`matmul` through cuBLAS; the SiLU is taken of the rounded product."""
    if bias is None:
        torch.mm(a, b, out=out)
    else:
        torch.addmm(bias, a, b, out=out)
    if colsum is not None:
        torch.sum(b, dim=0, dtype=torch.float32, out=colsum)
    if silu_out is not None:
        torch.ops.aten.silu.out(out[:, : silu_out.shape[1]], out=silu_out)


def matmul(
    a: torch.Tensor,
    b: torch.Tensor,
    out: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    colsum: Optional[torch.Tensor] = None,
    silu_out: Optional[torch.Tensor] = None,
) -> None:
    """Write ``bias + a @ b`` into ``out`` ([M, N]); ``colsum`` ([N], fp32) gets ``b.sum(0)``;
    ``silu_out`` ([M, C], C <= N, unit column stride) gets ``silu`` of the first C columns,
    computed from the fp32 accumulator in the GEMM's epilogue (products with a bias only; on
    the cuBLAS route, :func:`uses_cublas`, from the rounded product in a second pass).

    ``a`` [M, K] and ``b`` [K, N] may be any strided views (transposes are free). ``bias`` is
    ``[N]`` (broadcast over rows) or ``[M, N]``. Bias-free products with a deep K and a small
    output are split along K (see the module docstring).
    """
    if silu_out is not None and bias is None:
        raise ValueError("matmul: silu_out needs a bias (bias-free products may split along K)")
    M, K = a.shape
    N = b.shape[1]
    if M == 0 or N == 0:
        if colsum is not None:
            colsum.zero_()
        return
    if K == 0:
        out.copy_(bias.expand(M, N) if bias is not None else torch.zeros_like(out))
        if colsum is not None:
            colsum.zero_()
        if silu_out is not None:
            silu_out.copy_(torch.nn.functional.silu(out[:, : silu_out.shape[1]].float()))
        return
    if uses_cublas(a, b):
        _cublas_matmul(a, b, out, bias, colsum, silu_out)
        return
    if bias is None:
        stride_biasm, stride_biasn = 0, 0
    elif bias.dim() == 1:
        stride_biasm, stride_biasn = 0, bias.stride(0)
    else:
        stride_biasm, stride_biasn = bias.stride(0), bias.stride(1)
    kernel = tuned(
        "addmm",
        _kernel_for(a),
        _cuda_configs,
        ["AUTOTUNE_M", "N", "AUTOTUNE_K"],
        _INTERPRET_CONFIG,
        a.device,
    )

    splits = 1 if bias is not None else split_k(M, N, K, a.device)
    depth = cdiv(cdiv(K, splits), 64) * 64  # whole BLOCK_K steps per split
    splits = cdiv(K, depth)
    target, target_colsum = out, colsum
    if splits > 1:
        target = torch.empty((splits, M, N), dtype=torch.float32, device=out.device)
        if colsum is not None:
            target_colsum = torch.empty((splits, N), dtype=torch.float32, device=out.device)

    def grid(meta):
        return (cdiv(M, meta["BLOCK_M"]) * cdiv(N, meta["BLOCK_N"]), splits)

    launchable(kernel)[grid](
        a,
        b,
        target,
        # absent optional pointers get an input, never an output: torch.compile
        # functionalizes written arguments one by one, so an output passed twice breaks
        bias if bias is not None else a,
        target_colsum if target_colsum is not None else a,
        silu_out if silu_out is not None else a,
        M,
        N,
        K,
        a.stride(0),
        a.stride(1),
        b.stride(0),
        b.stride(1),
        target.stride(-2),
        target.stride(-1),
        stride_biasm,
        stride_biasn,
        target.stride(0) if splits > 1 else 0,
        silu_out.stride(0) if silu_out is not None else 0,
        silu_out.shape[1] if silu_out is not None else 0,
        depth,
        quantize_rows(M),
        quantize_rows(K),
        HAS_BIAS=bias is not None,
        COLSUM_B=colsum is not None,
        SILU_OUT=silu_out is not None,
        UPCAST=interpreting(),
        INPUT_PRECISION=input_precision(a.dtype),
    )
    if splits > 1:
        out.copy_(target.sum(0))
        if colsum is not None:
            colsum.copy_(target_colsum.sum(0))


@triton_library_op("tzrec_ops::addmm_triton")
def addmm_fwd(input: torch.Tensor, mat1: torch.Tensor, mat2: torch.Tensor) -> torch.Tensor:
    """``input + mat1 @ mat2``: mat1 [M, K], mat2 [K, N], input [N] or [M, N] -> [M, N]."""
    out = torch.empty((mat1.shape[0], mat2.shape[1]), dtype=mat1.dtype, device=mat1.device)
    matmul(mat1, mat2, out, bias=input)
    return out


@triton_library_op("tzrec_ops::addmm_bwd_triton")
def addmm_bwd(
    dz: torch.Tensor, input: torch.Tensor, mat1: torch.Tensor, mat2: torch.Tensor
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of ``input + mat1 @ mat2``: (d_input, d_mat1, d_mat2)."""
    d_mat1 = torch.empty_like(mat1)
    d_mat2 = torch.empty_like(mat2)
    matmul(dz, mat2.t(), d_mat1)
    if input.dim() == 1:
        colsum = torch.empty(dz.shape[1], dtype=torch.float32, device=dz.device)
        matmul(mat1.t(), dz, d_mat2, colsum=colsum)
        d_input = colsum.to(input.dtype)
    else:
        matmul(mat1.t(), dz, d_mat2)
        d_input = dz.to(input.dtype, copy=True)
    return d_input, d_mat1, d_mat2


def _setup_addmm(ctx, inputs, output) -> None:  # type: ignore[no-untyped-def]
    ctx.save_for_backward(*inputs)


def _addmm_backward(ctx, dz):  # type: ignore[no-untyped-def]
    input, mat1, mat2 = ctx.saved_tensors
    d_input, d_mat1, d_mat2 = addmm_bwd(dz.contiguous(), input, mat1, mat2)
    return d_input, d_mat1, d_mat2


addmm_fwd.register_autograd(_addmm_backward, setup_context=_setup_addmm)


def addmm(input: torch.Tensor, mat1: torch.Tensor, mat2: torch.Tensor) -> torch.Tensor:
    """Triton backend of :func:`tzrec_ops.ops.mm.addmm` (arguments already validated)."""
    return addmm_fwd(input, mat1, mat2)
