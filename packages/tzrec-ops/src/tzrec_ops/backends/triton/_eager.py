"""``torch.library`` Triton ops whose eager calls skip the dispatcher.

Every Triton op is registered with :func:`torch.library.triton_op` so that
``torch.compile``, ``torch.export`` and AOTInductor see its kernels. In eager mode that
registration costs host time on every call: the dispatcher, the op's autograd wrapper and,
above all, :func:`torch.library.wrap_triton`, which routes each launch through a
higher-order op. For small kernels that host time exceeds the GPU time.

:func:`triton_library_op` registers the op exactly as before and returns a callable that,
for plain tensors outside any tracing, runs the op's Python body directly (through a plain
``autograd.Function`` when a gradient is needed) and launches kernels without the
higher-order op (:func:`launchable`). Anything being traced goes through the registered op.

Eager launches of autotuned kernels also skip ``Autotuner.run`` once a key is tuned
(:class:`_TunedLauncher`): a launch through it costs about three times the host time of the
plain ``JITFunction.run`` it ends in (figures in docs/tzrec-ops-measurements.md).
"""

from __future__ import annotations

import inspect
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Dict, Optional, Tuple

import torch
from torch.library import triton_op, wrap_triton
from torch.utils._python_dispatch import is_in_torch_dispatch_mode
from triton.runtime.autotuner import Autotuner

from tzrec_ops.backends.triton.refusals import interpreting


def tracing() -> bool:
    """Whether a compiler or a dispatch-mode tracer (export, make_fx, fake tensors) is active."""
    return torch.compiler.is_compiling() or is_in_torch_dispatch_mode()


def launchable(kernel: Any) -> Any:
    """``kernel`` wrapped for graph capture while tracing; in eager mode ``kernel`` itself, or
    for an autotuned kernel its :class:`_TunedLauncher`."""
    if tracing():
        return wrap_triton(kernel)
    if isinstance(kernel, Autotuner):
        launcher = _LAUNCHERS.get(kernel)
        if launcher is None:
            launcher = _LAUNCHERS.setdefault(kernel, _TunedLauncher(kernel))
        return launcher
    return kernel


class _TunedLauncher:
    """Eager launches of an autotuned kernel: the autotuner runs once per key (it benchmarks
    and launches), later launches of that key go straight to ``JITFunction.run`` with the
    config it chose.

    The key is at least as fine as the autotuner's own: the values of its key arguments and
    the dtype of every tensor argument. Configs with a ``pre_hook``, and calls that leave a key
    argument to its default, always take the autotuner's path.
    """

    def __init__(self, autotuner: Autotuner) -> None:
        self._tuner = autotuner
        self._key = tuple((autotuner.arg_names.index(k), k) for k in autotuner.keys)
        self._chosen: Dict[Tuple[Any, ...], Tuple[Any, Dict[str, Any]]] = {}

    def __getitem__(self, grid: Any) -> Callable[..., Any]:
        return lambda *args, **kwargs: self._launch(grid, args, kwargs)

    def _launch(self, grid: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
        try:
            key = tuple(args[i] if i < len(args) else kwargs[name] for i, name in self._key)
        except KeyError:
            return self._tuner.run(*args, grid=grid, warmup=False, **kwargs)
        key += tuple(a.dtype for a in args if isinstance(a, torch.Tensor))
        key += tuple(a.dtype for a in kwargs.values() if isinstance(a, torch.Tensor))
        chosen = self._chosen.get(key)
        if chosen is not None:
            config, config_kwargs = chosen
            self._tuner.best_config = config  # as Autotuner.run leaves it
            return self._tuner.fn.run(*args, grid=grid, warmup=False, **kwargs, **config_kwargs)
        precompile(self._tuner, args, kwargs)
        result = self._tuner.run(*args, grid=grid, warmup=False, **kwargs)
        config = self._tuner.best_config
        if config.pre_hook is None:
            self._chosen[key] = (config, config.all_kwargs())
        return result


_LAUNCHERS: Dict[Autotuner, _TunedLauncher] = {}

COMPILE_THREADS_ENV = "TZREC_OPS_TRITON_COMPILE_THREADS"
_POOL: Optional[ThreadPoolExecutor] = None


def _compile_pool() -> Optional[ThreadPoolExecutor]:
    global _POOL
    if _POOL is None:
        threads = int(os.environ.get(COMPILE_THREADS_ENV, str(min(16, os.cpu_count() or 1))))
        if threads <= 1:
            return None
        _POOL = ThreadPoolExecutor(threads, thread_name_prefix="tzrec-triton-compile")
    return _POOL


def precompile(tuner: Autotuner, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> None:
    """Compile every candidate config of ``tuner`` for this call's specialization at once, in
    a thread pool, before the autotuner times them one after the other (it would compile each
    on its first timed run). Each compile is seconds to tens of seconds, mostly in ``ptxas``
    and MLIR passes, so a first training step on a fresh machine waits for the slowest config
    rather than for their sum. ``TZREC_OPS_TRITON_COMPILE_THREADS=1`` compiles one at a time.
    A config that fails to compile is left to the autotuner, which skips it as before. Does
    nothing with a Triton whose asynchronous compile mode is missing or cannot leave failed
    compiles alone (``ignore_errors``, older Triton)."""
    if len(tuner.configs) < 2 or interpreting():
        return
    try:
        from triton.runtime._async_compile import AsyncCompileMode
    except ImportError:
        return
    if "ignore_errors" not in inspect.signature(AsyncCompileMode).parameters:
        return
    pool = _compile_pool()
    if pool is None:
        return
    with AsyncCompileMode(pool, ignore_errors=True):
        for config in tuner.configs:
            tuner.fn.warmup(*args, grid=(1,), **kwargs, **config.all_kwargs())


# Parameters are plain tensors to the kernels (no __torch_function__ of their own); every
# other subclass (fake, functional, DTensor...) goes through the registered op.
_PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)


def _plain_eager(args: tuple) -> bool:
    if tracing():
        return False
    return all(type(a) in _PLAIN_TYPES for a in args if isinstance(a, torch.Tensor))


class _EagerAutograd(torch.autograd.Function):
    """The op's registered autograd formula, applied without the dispatcher."""

    @staticmethod
    def forward(ctx: Any, op: "TritonLibraryOp", *args: Any) -> Any:
        out = op.fn(*args)
        ctx.library_op = op
        op.setup_context(ctx, args, out)
        if isinstance(out, tuple) and op.grad_outputs is not None and op.grad_outputs < len(out):
            # outputs past the differentiable ones are saved values: no zero-filled gradients
            ctx.mark_non_differentiable(*out[op.grad_outputs :])
            ctx.set_materialize_grads(False)
            ctx.grad_meta = [(t.shape, t.dtype, t.device) for t in out[: op.grad_outputs]]
        return out

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        meta = getattr(ctx, "grad_meta", None)
        if meta is not None:
            grads = tuple(
                torch.zeros(meta[i][0], dtype=meta[i][1], device=meta[i][2])
                if g is None and i < len(meta)
                else g
                for i, g in enumerate(grads)
            )
        result = ctx.library_op.backward(ctx, *grads)
        return (None, *(result if isinstance(result, tuple) else (result,)))


class TritonLibraryOp:
    """A registered ``triton_op`` (``.op``) with a dispatcher-free eager path."""

    def __init__(self, name: str, fn: Callable[..., Any]) -> None:
        self.fn = fn
        self.op = triton_op(name, mutates_args=())(fn)
        self.backward: Optional[Callable[..., Any]] = None
        self.setup_context: Optional[Callable[..., None]] = None
        self.grad_outputs: Optional[int] = None

    def register_autograd(
        self,
        backward: Callable[..., Any],
        *,
        setup_context: Callable[..., None],
        grad_outputs: Optional[int] = None,
    ) -> None:
        """As ``CustomOpDef.register_autograd``; only the first ``grad_outputs`` outputs take
        gradients (the rest are values saved for the backward, whose gradients it ignores);
        None: every output does."""
        self.op.register_autograd(backward, setup_context=setup_context)
        self.backward, self.setup_context = backward, setup_context
        self.grad_outputs = grad_outputs

    def register_fake(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        return self.op.register_fake(fn)

    def __call__(self, *args: Any) -> Any:
        if not _plain_eager(args):
            return self.op(*args)
        needs_grad = (
            self.backward is not None
            and torch.is_grad_enabled()
            and any(isinstance(a, torch.Tensor) and a.requires_grad for a in args)
        )
        if needs_grad:
            return _EagerAutograd.apply(self, *args)
        return self.fn(*args)


def triton_library_op(name: str) -> Callable[[Callable[..., Any]], TritonLibraryOp]:
    """Decorator: register ``fn`` as the ``triton_op`` ``name`` (no mutated arguments) and
    return a :class:`TritonLibraryOp` calling it."""

    def register(fn: Callable[..., Any]) -> TritonLibraryOp:
        return TritonLibraryOp(name, fn)

    return register
