"""Benchmark of the non-attention STU ops, now an alias of ``tzrec-bench ops``.

    python -m tzrec_bench.kernels.stu_ops [--batch 64] [--max-len 2048] [--providers ...]
                                          [--ops layer_norm,addmm]

Times every op of :data:`STU_OPS` (or ``--ops``) forward and backward per backend at the
shapes of an STU layer: B = 64 sequences of U[0.9 N, N) tokens (N = 2048), E = 512, H = 4,
A = V = 128, bf16. Other ``tzrec-bench ops`` options pass through (``--plot``, ``--csv``...).
"""

from __future__ import annotations

import argparse
import sys
from typing import List, Optional, Sequence

from tzrec_bench.opbench.cases import CASES
from tzrec_bench.opbench.command import main as ops_main

#: every op but attention (:mod:`~tzrec_bench.kernels.hstu_attention` and
#: :mod:`~tzrec_bench.kernels.delta_attention` time it)
STU_OPS = tuple(op for op in CASES if op not in ("hstu_mha", "delta_hstu_mha"))


def ops_argv(argv: Optional[Sequence[str]] = None) -> List[str]:
    """The ``tzrec-bench ops`` arguments this module's options stand for."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", default="64")
    p.add_argument("--max-len", default="2048")
    p.add_argument("--providers", default="pytorch,triton", help="comma-separated backend names")
    p.add_argument("--ops", default=",".join(STU_OPS), help="comma-separated op names")
    args, rest = p.parse_known_args(argv)
    return ["--op", args.ops, "--backends", args.providers, "--batch", args.batch,
            "--seq-lens", args.max_len, "--embedding", "512", "--heads", "4", "--dim", "128",
            *rest]


def main(argv: Optional[Sequence[str]] = None) -> int:
    return ops_main(ops_argv(argv))


if __name__ == "__main__":
    sys.exit(main())
