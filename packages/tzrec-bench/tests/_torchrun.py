"""Two-process runs of ``tzrec-bench`` commands under torchrun for the tests (gloo on a CPU,
NCCL on two GPUs)."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Mapping, Sequence

#: the settings of a tiny config passed on as options
FIELDS = ("synthetic_users", "synthetic_items", "max_seq_len", "embedding_dim", "num_layers",
          "num_heads", "num_negatives", "batch_size", "lr", "eval_batch_size", "log_every")


def torchrun_bench(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    """``torchrun --nproc-per-node 2 -m tzrec_bench ARGS`` (one thread a process); fails the
    test, with the output's end, unless it exits 0 within ``timeout`` seconds."""
    run = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
         "2", "-m", "tzrec_bench", *args],
        capture_output=True, text=True, timeout=timeout,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    return run


def torchrun_train(tiny: Mapping[str, object], *options: str,
                   fields: Sequence[str] = FIELDS,
                   timeout: float = 240) -> subprocess.CompletedProcess:
    """``tzrec-bench train`` under :func:`torchrun_bench` with ``options`` and the ``fields``
    of ``tiny`` as options."""
    args = list(options)
    for field in fields:
        args += ["--" + field.replace("_", "-"), str(tiny[field])]
    return torchrun_bench("train", *args, timeout=timeout)
