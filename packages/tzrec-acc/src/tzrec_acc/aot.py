"""torch.export with dynamic dims, AOTInductor packages, and parity checked in a fresh process.

The flow::

    program = export(model, args, dynamic_shapes)           # torch.export, no grad
    path = compile_package(program, "model.pt2")             # AOTInductor package
    outputs = run_in_fresh_process(path, [args])             # a new Python process loads it
    print(parity(eager_outputs, outputs[0]))                 # one line per output

``run_in_fresh_process`` is :func:`tzrec_ops.aoti.run_in_fresh_process` (the C++ compiler's
libstdc++ preloaded, as a server of AOTInductor packages needs), part of this flow's API. A
package runs in a process that imports nothing of tzrec: its Triton kernels are compiled
in. A saved exported program (``save_program``) holds ``tzrec_ops::`` ops by name, so its
loader imports the backend's library module first (``tzrec_ops.backends.triton.library``
for the triton backends); pass it in ``imports``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from tzrec_ops.aoti import run_in_fresh_process

__all__ = [
    "TOLERANCES",
    "OutputParity",
    "ParityReport",
    "compile_package",
    "export",
    "flat_outputs",
    "parity",
    "run_in_fresh_process",
    "save_program",
]

# (rtol, atol) per dtype: torch.testing.assert_close's defaults
TOLERANCES: Dict[torch.dtype, Tuple[float, float]] = {
    torch.float64: (1e-7, 1e-7),
    torch.float32: (1.3e-6, 1e-5),
    torch.bfloat16: (1.6e-2, 1e-5),
    torch.float16: (1e-3, 1e-5),
}


def export(
    module: torch.nn.Module,
    args: Tuple[Any, ...],
    dynamic_shapes: Any = None,
    strict: bool = False,
) -> torch.export.ExportedProgram:
    """``torch.export.export`` without autograd (an inference graph).

    Args:
        module: the model (eval mode) or a serving step of it.
        args: example positional arguments.
        dynamic_shapes: as for ``torch.export.export`` (see :func:`tzrec_acc.gr.dynamic_shapes`).
        strict: export with TorchDynamo's strict tracing. Default False (non-strict).
    """
    if module.training:
        raise ValueError("module must be in eval mode to export for inference; call .eval()")
    with torch.no_grad():
        return torch.export.export(module, args, dynamic_shapes=dynamic_shapes, strict=strict)


def compile_package(
    program: torch.export.ExportedProgram,
    path: str,
    inductor_configs: Optional[Dict[str, Any]] = None,
) -> str:
    """Compile ``program`` with AOTInductor into the package ``path`` (``.pt2``); returns it.

    Generated GPU kernels are tuned by running the graph once on the program's example
    inputs (``triton.autotune_at_compile_time=False``, Inductor's two-pass compile), not on
    Inductor's stand-in buffers: those hold zeros for integer tensors, so a gather through
    jagged offsets indexes out of bounds and trips a device-side assert while compiling.
    ``inductor_configs`` entries override this. The C++ compile takes about a minute for a
    small model on two CPU cores.
    """
    if not str(path).endswith(".pt2"):
        raise ValueError(f"path must end with .pt2 (an AOTInductor package), got {path!r}")
    configs = {"triton.autotune_at_compile_time": False, **(inductor_configs or {})}
    with torch.no_grad():  # the tuning run calls out= kernels on the trainable parameters
        return torch._inductor.aoti_compile_and_package(
            program, package_path=str(path), inductor_configs=configs
        )


def save_program(program: torch.export.ExportedProgram, path: str) -> str:
    """``torch.export.save`` the program (the FX graph of aten and ``tzrec_ops::`` ops)."""
    torch.export.save(program, str(path))
    return str(path)


def flat_outputs(out: Any) -> List[torch.Tensor]:
    """A model's output as a list of tensors (a tensor, or a tuple/list of them)."""
    return list(out) if isinstance(out, (list, tuple)) else [out]


@dataclasses.dataclass(frozen=True)
class OutputParity:
    """How one output of a compiled model compares with eager."""

    index: int
    shape: Tuple[int, ...]
    dtype: torch.dtype
    max_abs: float
    max_rel: float
    rtol: float
    atol: float
    ok: bool

    def __str__(self) -> str:
        verdict = "ok" if self.ok else "MISMATCH"
        return (
            f"output {self.index}: shape {list(self.shape)} {str(self.dtype).replace('torch.', '')}"
            f"  max abs err {self.max_abs:.3g}  max rel err {self.max_rel:.3g}"
            f"  (rtol {self.rtol:g}, atol {self.atol:g})  {verdict}"
        )


@dataclasses.dataclass(frozen=True)
class ParityReport:
    """Per-output parity; ``ok`` when every output is within its dtype's tolerances."""

    outputs: Tuple[OutputParity, ...]

    @property
    def ok(self) -> bool:
        return all(o.ok for o in self.outputs)

    def __str__(self) -> str:
        return "\n".join(str(o) for o in self.outputs)


def parity(expected: Sequence[torch.Tensor], actual: Sequence[torch.Tensor]) -> ParityReport:
    """Compare each output with ``torch.testing.assert_close``'s rule for its dtype.

    Raises:
        ValueError: different numbers of outputs, or shapes / dtypes that differ.
    """
    if len(expected) != len(actual):
        raise ValueError(f"expected {len(expected)} outputs, got {len(actual)}")
    rows = []
    for i, (want, got) in enumerate(zip(expected, actual)):
        if want.shape != got.shape or want.dtype != got.dtype:
            raise ValueError(
                f"output {i}: expected {tuple(want.shape)} {want.dtype}, "
                f"got {tuple(got.shape)} {got.dtype}"
            )
        rtol, atol = TOLERANCES.get(want.dtype, (0.0, 0.0))
        want64, got64 = want.detach().cpu().double(), got.detach().cpu().double()
        err = (want64 - got64).abs()
        max_abs = float(err.max()) if err.numel() else 0.0
        rel = err / want64.abs().clamp(min=torch.finfo(torch.float64).tiny)
        max_rel = float(rel.max()) if rel.numel() else 0.0
        ok = bool(torch.isclose(got64, want64, rtol=rtol, atol=atol, equal_nan=True).all())
        rows.append(
            OutputParity(i, tuple(want.shape), want.dtype, max_abs, max_rel, rtol, atol, ok)
        )
    return ParityReport(tuple(rows))
