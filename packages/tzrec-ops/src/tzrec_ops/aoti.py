"""Load an AOTInductor package (or a saved exported program) in a fresh Python process.

An AOTInductor package's wrapper library is built by the system C++ compiler but does not link
libstdc++ itself: it uses whichever one the loading process already has. When that one is
older than the compiler's (torch's own environment can bring an older copy), loading the
package crashes inside ``std::regex`` while parsing the device string. Seen on the lent
H100/H200 machines (torch 2.11, GCC 13): a package holding a single ``nn.Linear`` crashed
the same way, and preloading the compiler's libstdc++ fixed it.

- :func:`compiler_libstdcxx`: that library's path;
- :func:`preloaded_env`: an environment with it in ``LD_PRELOAD``, for a serving process (or
  a script that restarts itself under it);
- :func:`run_in_fresh_process`: loads a package in a child process with that environment and
  calls it on argument tuples, so a crash is an exception of the caller, not its death. It
  is also how to check that a package runs without the code that built it.

tzrec-acc's export flow (``tzrec_acc.aot``) and the tests of every package load packages
through this module.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import torch

__all__ = ["KINDS", "compiler_libstdcxx", "preloaded_env", "run_in_fresh_process"]

#: what :func:`run_in_fresh_process` loads: an AOTInductor package, or a saved program
KINDS = ("aoti", "program")

_CHILD = """
import importlib, sys, torch
kind, path, inputs, outputs = sys.argv[1:5]
for module in sys.argv[5:]:
    importlib.import_module(module)
if kind == "aoti":
    run = torch._inductor.aoti_load_package(path)
else:
    run = torch.export.load(path).module()
results = []
with torch.no_grad():
    for args in torch.load(inputs):
        out = run(*args)
        out = list(out) if isinstance(out, (list, tuple)) else [out]
        results.append([t.cpu() for t in out])
torch.save(results, outputs)
"""


def compiler_libstdcxx() -> Optional[str]:
    """Path of the libstdc++ that inductor's C++ compiler links against, if it has one."""
    from torch._inductor.cpp_builder import get_cpp_compiler

    try:
        found = subprocess.run(
            [get_cpp_compiler(), "-print-file-name=libstdc++.so.6"],
            capture_output=True,
            text=True,
            timeout=60,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return found if os.path.isabs(found) and os.path.exists(found) else None


def preloaded_env(env: Optional[Mapping[str, str]] = None) -> Dict[str, str]:
    """``env`` (default: this process's environment) with the compiler's libstdc++ first in
    ``LD_PRELOAD``; unchanged when the compiler names no such library."""
    out = dict(os.environ if env is None else env)
    preload = compiler_libstdcxx()
    if preload:
        out["LD_PRELOAD"] = " ".join(filter(None, [preload, out.get("LD_PRELOAD")]))
    return out


def run_in_fresh_process(
    path: str,
    batches: Sequence[Tuple[Any, ...]],
    kind: str = "aoti",
    imports: Sequence[str] = (),
    timeout: float = 600,
) -> List[List[torch.Tensor]]:
    """Load ``path`` in a new Python process (:func:`preloaded_env`) and call it on each
    argument tuple.

    Args:
        path: an AOTInductor package (``kind="aoti"``) or a saved program (``"program"``).
        batches: argument tuples.
        kind: ``"aoti"`` or ``"program"``.
        imports: modules the new process imports first (op libraries such as
            ``tzrec_ops.backends.triton.library``, which a saved program's ``tzrec_ops::``
            ops need; an AOTInductor package needs none).
        timeout: seconds.

    Returns:
        Per batch, the list of outputs (on the CPU).

    Raises:
        ValueError: an unknown ``kind``.
        RuntimeError: the process failed; the message holds its exit code, ``LD_PRELOAD`` and
            the end of its stderr.
    """
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {', '.join(KINDS)}, got {kind!r}")
    env = preloaded_env()
    with tempfile.TemporaryDirectory() as tmp:
        inputs, outputs = os.path.join(tmp, "inputs.pt"), os.path.join(tmp, "outputs.pt")
        torch.save([tuple(args) for args in batches], inputs)
        child = subprocess.run(
            [sys.executable, "-c", _CHILD, kind, str(path), inputs, outputs, *imports],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=env,
        )
        if child.returncode != 0:
            raise RuntimeError(
                f"loading/running {path} in a fresh process failed with exit code "
                f"{child.returncode} (LD_PRELOAD={env.get('LD_PRELOAD')!r}):\n"
                f"{child.stderr[-3000:]}"
            )
        return torch.load(outputs)
