"""``python -m tzrec_ops info``: versions, backends and failed plugins;
``python -m tzrec_ops contract``: the op table of the plugin contract (the README's)."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import sys
from typing import List, Optional

import torch

from tzrec_ops import registry
from tzrec_ops.commandline import ArgumentParser

_PACKAGES = ("tzrec-ops", "tzrec-gr", "tzrec-acc", "tzrec-bench", "torch", "triton",
             "pluggy", "fbgemm-gpu", "fbgemm-gpu-cpu", "torchrec", "torch-tensorrt")


def _version(dist: str) -> Optional[str]:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _ptxas() -> str:
    """The ptxas Triton compiles with (``TRITON_PTXAS_PATH`` overrides the bundled one)."""
    try:
        from triton import knobs

        tool = knobs.nvidia.ptxas
        source = "TRITON_PTXAS_PATH" if os.environ.get("TRITON_PTXAS_PATH") else "bundled"
        version = tool.version.strip().splitlines()[-1] if tool.version else "?"
        return f"{tool.path} ({source}; {version})"
    except Exception as exc:  # triton missing, or a layout this code does not know
        return f"unknown ({type(exc).__name__}: {exc})"


def info_lines() -> List[str]:
    lines = [f"python {platform.python_version()} on {platform.platform()}"]
    for dist in _PACKAGES:
        version = _version(dist)
        if version is not None:
            lines.append(f"{dist} {version}")
    if torch.cuda.is_available():
        name = torch.cuda.get_device_name()
        cap = ".".join(map(str, torch.cuda.get_device_capability()))
        runtime = f"hip {torch.version.hip}" if torch.version.hip else f"cuda {torch.version.cuda}"
        lines.append(f"device: {name} (compute capability {cap}, {runtime})")
        lines.append(f"ptxas: {_ptxas()}")
    else:
        lines.append("device: no CUDA/ROCm device visible")
    env_backend = os.environ.get(registry.BACKEND_ENV)
    if env_backend:
        lines.append(f"{registry.BACKEND_ENV}={env_backend}")
    reg = registry.get_registry()
    lines.append("backends (highest priority first):")
    for backend in reg.ordered():
        reason = backend.unavailable_reason()
        status = "available" if reason is None else f"unavailable: {reason}"
        lines.append(
            f"  {backend.name:<12} priority {backend.priority:<3} {status}"
            f"  [{len(backend.ops)} ops, from {reg.origins[backend.name]}]"
        )
        if backend.description:
            lines.append(f"    {backend.description}")
    if reg.failed_plugins:
        lines.append("failed plugins:")
        lines.extend(f"  {failure.describe()}" for failure in reg.failed_plugins)
    else:
        lines.append("failed plugins: none")
    return lines


def main(argv: Optional[List[str]] = None) -> int:
    parser = ArgumentParser(prog="python -m tzrec_ops")
    parser.add_argument("command", choices=["info", "contract"], help="what to print")
    args = parser.parse_args(argv)
    if args.command == "contract":
        from tzrec_ops.contract import contract_markdown

        print(contract_markdown(), end="")
    else:
        print("\n".join(info_lines()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
