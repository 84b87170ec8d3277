"""Run an AOTInductor package in a child process, for tests.

An AOTInductor package's wrapper library is built by the system C++ compiler but does not link
libstdc++ itself: it uses whichever one the loading process already has. When that one is
older than the compiler's (torch's own environment can bring an older copy), loading the
package crashes inside ``std::regex`` while parsing the device string. Seen on the lent
H100/H200 machines (torch 2.11, GCC 13): a package holding a single ``nn.Linear`` crashed
the same way, and preloading the compiler's libstdc++ fixed it.

:func:`run_package` therefore loads the package in a child process with the compiler's
libstdc++ preloaded, so a crash fails the calling test instead of killing the test run.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from typing import List, Optional, Sequence

import torch

_CHILD = """
import sys, torch
package, inputs, outputs = sys.argv[1:4]
args = torch.load(inputs)
result = torch._inductor.aoti_load_package(package)(*args)
result = list(result) if isinstance(result, (list, tuple)) else [result]
torch.save([t.cpu() for t in result], outputs)
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


def run_package(
    package_path: str, args: Sequence[torch.Tensor], timeout: float = 600
) -> List[torch.Tensor]:
    """Outputs (on the CPU) of the AOTInductor package at ``package_path`` called on ``args``.

    Raises:
        RuntimeError: the child process failed; the message holds its exit code and stderr.
    """
    env = dict(os.environ)
    preload = compiler_libstdcxx()
    if preload:
        env["LD_PRELOAD"] = " ".join(filter(None, [preload, env.get("LD_PRELOAD")]))
    with tempfile.TemporaryDirectory() as tmp:
        inputs, outputs = os.path.join(tmp, "inputs.pt"), os.path.join(tmp, "outputs.pt")
        torch.save(list(args), inputs)
        child = subprocess.run(
            [sys.executable, "-c", _CHILD, package_path, inputs, outputs],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=env,
        )
        if child.returncode != 0:
            raise RuntimeError(
                f"loading/running {package_path} failed with exit code {child.returncode} "
                f"(LD_PRELOAD={env.get('LD_PRELOAD')!r}):\n{child.stderr[-3000:]}"
            )
        return torch.load(outputs)
