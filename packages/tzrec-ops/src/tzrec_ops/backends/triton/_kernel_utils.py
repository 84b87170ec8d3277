"""Launch helpers shared by the non-attention Triton kernels (mm, norms, jagged, position).

* :func:`tuned` wraps a ``@triton.jit`` kernel in an autotuner built once per (kernel, device
  type): the CUDA configs that live with the kernel plus any extra configs that plugins give
  through :func:`tzrec_ops.registry.autotune_configs` (the ROCm plugin's HIP configs replace the
  CUDA ones on ROCm). Under ``TRITON_INTERPRET=1`` a single small config is used, and with
  ``TZREC_OPS_TRITON_AUTOTUNE=0`` only the first config (no tuning: fast start-up, e.g. tests).
* Data-dependent integer arguments (token and row counts, batch sizes, the autotune keys) are
  named in each kernel's ``do_not_specialize``: Triton otherwise compiles a new variant
  whenever such a value turns 1 or a multiple of 16, seconds per compile in the middle of
  training. Feature dims and strides keep the specialization (vectorized loads).
* A ``@triton.jit`` helper never takes a pointer whose loads it returns for a store address:
  Inductor's analysis of user kernels (``torch.library.wrap_triton``) follows a store's address
  back through a helper call to every pointer passed to it and counts that tensor as written
  (copies in compiled graphs, and an internal error where the tensor is also passed as
  another argument). Callers load, helpers compute.
* :func:`dropout_seed` makes the dropout seed a kernel reads: a one-element int64 tensor on the
  kernel's device, drawn there or filled with the caller's seed. The kernels load it
  (``tl.load``), so no host value enters a traced graph: under ``torch.compile`` the draw is
  a graph op like any other, and no call waits for the device.
"""

from __future__ import annotations

import os
import threading
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
import triton
import triton.language as tl

from tzrec_ops.backends.triton.refusals import interpreting
from tzrec_ops.ops.utils import prev_power_of_2

AUTOTUNE_ENV = "TZREC_OPS_TRITON_AUTOTUNE"
_TUNED: Dict[Tuple[str, int, str], Any] = {}
_LOCK = threading.Lock()


def allow_tf32() -> bool:
    """Whether fp32 ``tl.dot`` may use TF32 (follows ``torch.backends.cuda.matmul.allow_tf32``)."""
    return bool(torch.backends.cuda.matmul.allow_tf32)


def input_precision(dtype: torch.dtype) -> str:
    """The ``tl.dot`` input precision for operands of ``dtype``."""
    if dtype == torch.float32 and not allow_tf32():
        return "ieee"
    return "tf32"


def quantize_rows(n: Union[int, torch.SymInt]) -> int:
    """Autotune key for a row count: the largest power of two <= ``n`` (1 for ``n == 0``).

    A symbolic size (``torch.export`` with dynamic dims, ``torch.compile(dynamic=True)``) is
    keyed on its example value without a guard: ``int()`` would specialize the traced graph
    to that value, and the key only chooses among configs that are all correct."""
    if isinstance(n, torch.SymInt):
        n = n.node.hint if n.node.has_hint() else 1
    return prev_power_of_2(max(int(n), 1))


def tuned(
    name: str,
    kernel: Any,
    configs: Callable[[], List[triton.Config]],
    key: Sequence[str],
    interpret_config: triton.Config,
    device: torch.device,
    **autotune_kwargs: Any,
) -> Any:
    """The autotuned ``kernel`` for ``device`` (built once per kernel and device type; two
    compiled forms of one kernel body share ``name`` but are tuned apart).

    Args:
        name: stable kernel name, also the name plugins' config hooks are asked about.
        kernel: the ``@triton.jit`` function.
        configs: builds the CUDA configs.
        key: argument names the autotune cache is keyed on (quantized sizes).
        interpret_config: the one config used under ``TRITON_INTERPRET=1``.
        device: the device the kernel will run on.
    """
    cache_key = (name, id(kernel), torch.device(device).type)
    found = _TUNED.get(cache_key)
    if found is not None:
        return found
    with _LOCK:
        if cache_key not in _TUNED:
            if interpreting():
                chosen = [interpret_config]
            else:
                from tzrec_ops.registry import autotune_configs

                extra = list(autotune_configs(name, torch.device(device)))
                if torch.version.hip is not None and extra:
                    chosen = extra
                else:
                    chosen = configs() + extra
                if os.environ.get(AUTOTUNE_ENV, "1") in ("0", "false", "no"):
                    chosen = chosen[:1]
            _TUNED[cache_key] = triton.autotune(chosen, key=list(key), **autotune_kwargs)(kernel)
    return _TUNED[cache_key]


def dropout_seed(seed: Optional[int], device: torch.device) -> torch.Tensor:
    """The dropout seed for the kernels on ``device``: ``[1]``, int64, on ``device``.

    ``None`` draws a seed in ``[0, 2**62)`` on the device from torch's default generator of
    ``device``, so ``torch.manual_seed`` reproduces eager runs. Under ``torch.compile``
    Inductor replaces the draw with its own generator (seeded from the same default
    generator): compiled runs are reproducible among themselves, but their seeds differ from
    an eager run's. An int seed is written by a fill kernel (no host-to-device copy) and
    gives the same mask eagerly and compiled. Neither reads a device value back.
    """
    if seed is None:
        return torch.randint(0, 2**62, (1,), dtype=torch.int64, device=device)
    return torch.full((1,), seed, dtype=torch.int64, device=device)


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (a small constant on the CPU interpreter)."""
    if torch.device(device).type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


@triton.jit
def dropout_scale(seed, offsets, p, SCALE):
    """``1 / (1 - p)`` where the Philox draw at ``offsets`` keeps the element, else 0."""
    r = tl.rand(seed, offsets)
    # Inductor passes Python floats as fp64 (eager launches as fp32): compare with the fp32 p
    # both ways, or a draw equal to fp32(p) < p would be kept eagerly and dropped compiled.
    return tl.where(r >= tl.cast(p, tl.float32), SCALE, 0.0).to(tl.float32)
