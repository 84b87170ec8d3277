"""Run an AOTInductor package in a child process, for tests: one call of
:func:`tzrec_ops.aoti.run_in_fresh_process` (the compiler's libstdc++ preloaded; see that
module for why), so a crash fails the calling test instead of killing the test run."""

from __future__ import annotations

from typing import List, Sequence

import torch

from tzrec_ops.aoti import run_in_fresh_process

__all__ = ["run_package"]


def run_package(
    package_path: str, args: Sequence[torch.Tensor], timeout: float = 600
) -> List[torch.Tensor]:
    """Outputs (on the CPU) of the AOTInductor package at ``package_path`` called on ``args``.

    Raises:
        RuntimeError: the child process failed; the message holds its exit code and stderr.
    """
    (outputs,) = run_in_fresh_process(package_path, [tuple(args)], timeout=timeout)
    return outputs
