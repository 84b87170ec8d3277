"""TensorRT compilation of an exported program (``tzrec-acc[tensorrt]``, NVIDIA GPUs).

:func:`compile` hands an ``ExportedProgram`` (from :func:`tzrec_acc.aot.export`, with dynamic
dims) to ``torch_tensorrt.dynamo.compile`` with one ``torch_tensorrt.Input`` per input
tensor, whose min / opt / max shapes come from three example batches (smallest, typical,
largest). Ops TensorRT cannot convert (the ``tzrec_ops::`` Triton kernels among them) stay in
PyTorch, in blocks between TensorRT engines; ``min_block_size`` is the fewest ops a TensorRT
block must hold. :func:`profile` runs the result under ``torch.profiler`` and returns its
table of the most expensive ops.

torch-tensorrt is imported when a function here is called; without it they raise an
ImportError naming ``tzrec-acc[tensorrt]``.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence, Set, Tuple

import torch
from torch.utils import _pytree as pytree

from tzrec_ops.extras import require

__all__ = ["compile", "input_specs", "profile", "save"]


def _trt() -> Any:
    return require("torch_tensorrt", "tzrec-acc[tensorrt]", "TensorRT compilation")


def input_specs(
    min_args: Tuple[Any, ...], opt_args: Tuple[Any, ...], max_args: Tuple[Any, ...]
) -> Any:
    """The ``torch_tensorrt.Input`` tree for three example batches of one structure.

    Non-tensor leaves (None, ints) are kept as they are.

    Raises:
        ValueError: the batches differ in structure, or a tensor in rank or dtype.
    """
    trt = _trt()
    leaves = []
    flat = [pytree.tree_flatten(a) for a in (min_args, opt_args, max_args)]
    if not flat[0][1] == flat[1][1] == flat[2][1]:
        raise ValueError("min_args, opt_args and max_args must have the same structure")
    for i, (low, opt, high) in enumerate(zip(flat[0][0], flat[1][0], flat[2][0])):
        if not isinstance(opt, torch.Tensor):
            leaves.append(opt)
            continue
        if (
            low.dim() != opt.dim()
            or high.dim() != opt.dim()
            or not low.dtype == opt.dtype == high.dtype
        ):
            raise ValueError(
                f"input leaf {i}: min/opt/max must share rank and dtype, got "
                f"{tuple(low.shape)} {low.dtype}, {tuple(opt.shape)} {opt.dtype}, "
                f"{tuple(high.shape)} {high.dtype}"
            )
        leaves.append(
            trt.Input(
                min_shape=tuple(low.shape),
                opt_shape=tuple(opt.shape),
                max_shape=tuple(high.shape),
                dtype=opt.dtype,
            )
        )
    return pytree.tree_unflatten(leaves, flat[1][1])


def compile(
    program: torch.export.ExportedProgram,
    min_args: Tuple[Any, ...],
    opt_args: Tuple[Any, ...],
    max_args: Tuple[Any, ...],
    workspace_size: int = 1 << 30,
    min_block_size: int = 5,
    enabled_precisions: Optional[Set[torch.dtype]] = None,
    **options: Any,
) -> torch.nn.Module:
    """``torch_tensorrt.dynamo.compile`` of ``program`` for inputs ranging over the batches.

    Args:
        program: an exported program whose dims are dynamic over the batches' shapes.
        min_args, opt_args, max_args: argument tuples of the smallest, the typical (the one
            TensorRT tunes for) and the largest batch.
        workspace_size: bytes TensorRT may use for its tactics. Default: 1 GiB.
        min_block_size: the fewest convertible ops that become a TensorRT engine. Default 5.
        enabled_precisions: dtypes TensorRT may run in. Default: torch-tensorrt's.
        options: any other ``torch_tensorrt.dynamo.compile`` keyword argument.

    Returns:
        The compiled module (a ``torch.fx.GraphModule`` calling TensorRT engines).
    """
    if workspace_size <= 0:
        raise ValueError(f"workspace_size must be > 0 bytes, got {workspace_size}")
    if min_block_size < 1:
        raise ValueError(f"min_block_size must be >= 1, got {min_block_size}")
    trt = _trt()
    kwargs = dict(options)
    if enabled_precisions is not None:
        kwargs["enabled_precisions"] = set(enabled_precisions)
    return trt.dynamo.compile(
        program,
        arg_inputs=list(input_specs(min_args, opt_args, max_args)),
        workspace_size=workspace_size,
        min_block_size=min_block_size,
        **kwargs,
    )


def save(module: torch.nn.Module, path: str, example_args: Sequence[Any]) -> str:
    """``torch_tensorrt.save`` the compiled module as an exported program at ``path``."""
    _trt().save(module, str(path), output_format="exported_program", arg_inputs=list(example_args))
    return str(path)


def profile(module: torch.nn.Module, args: Tuple[Any, ...], steps: int = 10, rows: int = 15) -> str:
    """Run ``module(*args)`` ``steps`` times under ``torch.profiler``; the top ``rows`` ops
    by total time, as the profiler's table."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.no_grad(), torch.profiler.profile(activities=activities) as prof:
        for _ in range(steps):
            module(*args)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    key = "cuda_time_total" if torch.cuda.is_available() else "cpu_time_total"
    return prof.key_averages().table(sort_by=key, row_limit=rows)
