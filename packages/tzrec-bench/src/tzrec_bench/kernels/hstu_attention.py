"""HSTU attention benchmark, now an alias of ``tzrec-bench ops --op hstu_mha``.

    python -m tzrec_bench.kernels.hstu_attention                  # N = 256 ... 4096, B = 512
    python -m tzrec_bench.kernels.hstu_attention --providers pytorch --batch 4 --seq-lens 64

Keeps this module's option names (``--providers``, ``--modes``, ``--attn-dim``,
``--pytorch-max-seq-len``) and hands everything to the ``ops`` command (see
:mod:`tzrec_bench.opbench` for shapes, FLOPs and timing); ``--show-configs`` prints the
autotuner's tile choices (:func:`tzrec_bench.opbench.triton_configs.chosen_configs`).
"""

from __future__ import annotations

import argparse
import sys
from typing import List, Optional, Sequence

from tzrec_bench.opbench.command import main as ops_main


def ops_argv(argv: Optional[Sequence[str]] = None) -> List[str]:
    """The ``tzrec-bench ops`` arguments this module's options stand for."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", default="512")
    p.add_argument("--heads", default="4")
    p.add_argument("--attn-dim", default="128")
    p.add_argument("--hidden-dim", default="128")
    p.add_argument("--dtype", default="bf16")
    p.add_argument("--seq-lens", default="256,512,1024,2048,4096")
    p.add_argument("--providers", default="triton,triton_tma,pytorch",
                   help="backend names; pytorch runs only up to --pytorch-max-seq-len")
    p.add_argument("--pytorch-max-seq-len", default="512")
    p.add_argument("--modes", default="fwd,bwd")
    p.add_argument("--rep", default="200", help="milliseconds per point")
    p.add_argument("--seed", default="1001")
    p.add_argument("--value-checks", default="on", help="on, off or both")
    p.add_argument("--show-configs", action="store_true",
                   help="print the tile configs the autotuner chose")
    args, rest = p.parse_known_args(argv)
    return [
        "--op", "hstu_mha", "--backends", args.providers, "--mode", args.modes,
        "--batch", args.batch, "--heads", args.heads, "--dim", args.attn_dim,
        "--hidden-dim", args.hidden_dim, "--dtype", args.dtype, "--seq-lens", args.seq_lens,
        "--backend-max-seq-len", f"pytorch={args.pytorch_max_seq_len}", "--rep", args.rep,
        "--seed", args.seed, "--value-checks", args.value_checks,
        *(["--show-configs"] if args.show_configs else []), *rest,
    ]


def main(argv: Optional[Sequence[str]] = None) -> int:
    return ops_main(ops_argv(argv))


if __name__ == "__main__":
    sys.exit(main())
