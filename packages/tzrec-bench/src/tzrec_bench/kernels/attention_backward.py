"""HSTU attention backward: the deterministic two-pass kernel (the default) against the
one-pass kernel with atomic dQ (``TZREC_OPS_TRITON_ATTENTION_BACKWARD=one_pass``), same run.

Usage (GPU)::

    python -m tzrec_bench.kernels.attention_backward --backends triton,triton_tma

Each point is the ``tzrec-bench ops`` attention case (B sequences of U[0.9 N, N) tokens,
U[1, 20] targets, q/k/v leaf views of one fused buffer, value checks on): ``o.backward(dO)``
timed in both modes, TFLOP/s by architecture §6, peak memory above the inputs, and the
one-pass / two-pass speed-up.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from typing import Iterator, List, Optional

import torch

from tzrec_bench.opbench.cases import CASES, Inputs
from tzrec_bench.opbench.report import device_name, triton_version
from tzrec_bench.opbench.shapes import Shape, jagged_batch
from tzrec_bench.opbench.timing import measure

#: the triton backends' choice of backward kernel (read at each backward)
BACKWARD_ENV = "TZREC_OPS_TRITON_ATTENTION_BACKWARD"
MODES = ("two_pass", "one_pass")


@contextlib.contextmanager
def backward_kernel(mode: str) -> Iterator[None]:
    before = os.environ.get(BACKWARD_ENV)
    os.environ[BACKWARD_ENV] = mode
    try:
        yield
    finally:
        if before is None:
            del os.environ[BACKWARD_ENV]
        else:
            os.environ[BACKWARD_ENV] = before


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backends", default="triton", help="comma-separated backend names")
    p.add_argument("--seq-lens", default="256,1024,4096")
    p.add_argument("--batch", type=int, default=512)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    p.add_argument("--rep-ms", type=float, default=200.0)
    args = p.parse_args(argv)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    print(f"{device_name(device)}, torch {torch.__version__}, triton {triton_version()}, "
          f"{args.dtype}, H {args.heads}, A = V = {args.dim}, value checks on")
    for n in (int(v) for v in args.seq_lens.split(",")):
        batch = args.batch
        shape = Shape(batch, n, args.heads, args.dim, args.dim, args.heads * args.dim)
        inputs = Inputs(shape, jagged_batch(shape), dtype, device)
        for backend in args.backends.split(","):
            times = {}
            for label in MODES:
                with backward_kernel(label):
                    case = CASES["hstu_mha"](inputs, backend)
                    m = measure(case, "bwd", device, args.rep_ms)
                times[label] = m.ms
                tflops = case.flops("bwd") / m.ms / 1e9 if case.flops else float("nan")
                peak = "n/a" if m.peak_mib is None else f"{m.peak_mib:8.1f} MiB"
                print(f"N {n:5d} B {batch:4d} {backend:>10} {label:>8}: {m.ms:8.3f} ms "
                      f"{tflops:7.1f} TFLOP/s  peak {peak}")
            ratio = times["two_pass"] / times["one_pass"]
            print(f"N {n:5d} B {batch:4d} {backend:>10} one-pass / two-pass speed: {ratio:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
