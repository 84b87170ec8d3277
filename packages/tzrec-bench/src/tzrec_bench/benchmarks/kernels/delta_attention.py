"""Cached-attention benchmark: one eager ``delta_hstu_mha`` call, as a server makes it.

    python -m tzrec_bench.benchmarks.kernels.delta_attention        # B=64, D=8, cache ~2000
    python -m tzrec_bench.benchmarks.kernels.delta_attention --providers triton,pytorch \
        --cache-len 512

Shapes: B sequences whose caches hold U[0.9 C, C] tokens, D new queries per sequence, H heads,
q/k and value dim d, bf16 by default. Both forms of the op are timed: ``split`` (the cache and
the D new keys/values apart, as ``STULayer.cached_forward`` calls it) and ``concat`` (cache and
new tokens in one jagged tensor). Each line gives the eager time with the settings a user gets
(value checks on; offsets moved with ``tzrec_ops.to_device``), the eager time with the checks
off, and the time replayed from a CUDA graph (the kernels alone, no Python or launch cost), all
``triton.testing.do_bench`` medians from the same run (:func:`tzrec_ops.measure.median_ms`).
"""

from __future__ import annotations

import argparse
import sys
from typing import Callable, Dict, List, Optional

import torch

from tzrec_bench.benchmarks.opbench.command import DTYPES
from tzrec_ops import delta_hstu_mha, set_value_checks, to_device
from tzrec_ops.commandline import ArgumentParser
from tzrec_ops.jagged import offsets_from_lengths
from tzrec_ops.measure import cuda_graph_replay, median_ms


def make_calls(args: argparse.Namespace, provider: str) -> Dict[str, Callable[[], object]]:
    """The split and concatenated calls over one random batch."""
    g = torch.Generator().manual_seed(args.seed)
    b, d, h, dim = args.batch, args.delta, args.heads, args.dim
    dtype, dev = DTYPES[args.dtype], "cuda"
    cached = torch.randint(int(0.9 * args.cache_len), args.cache_len + 1, (b,), generator=g)
    cache_offsets = offsets_from_lengths(cached)
    full_offsets = cache_offsets + torch.arange(b + 1) * d

    def rand(rows: int) -> torch.Tensor:
        return torch.randn(rows, h, dim, device=dev, dtype=dtype) * 0.1

    q, new_k, new_v = rand(b * d), rand(b * d), rand(b * d)
    k, v = rand(int(cache_offsets[-1])), rand(int(cache_offsets[-1]))
    full_k, full_v = rand(int(full_offsets[-1])), rand(int(full_offsets[-1]))
    cache_offsets, full_offsets = to_device(cache_offsets, dev), to_device(full_offsets, dev)
    n, alpha = args.cache_len + d, 1.0 / dim
    return {
        "split": lambda: delta_hstu_mha(
            n, alpha, q, k, v, cache_offsets, delta_k=new_k, delta_v=new_v, backend=provider
        ),
        "concat": lambda: delta_hstu_mha(
            n, alpha, q, full_k, full_v, full_offsets, backend=provider
        ),
    }


def main(argv: Optional[List[str]] = None) -> List[Dict[str, object]]:
    p = ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--providers", default="triton", help="comma-separated backend names")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--delta", type=int, default=8, help="D, new queries per sequence")
    p.add_argument("--cache-len", type=int, default=2000)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--seed", type=int, default=1001)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("this benchmark needs a CUDA device (torch.cuda.is_available() is False)")
    import triton

    print(
        f"GPU: {torch.cuda.get_device_name()}  torch {torch.__version__}  triton "
        f"{triton.__version__}; B={args.batch} D={args.delta} cache U[0.9C, C], C="
        f"{args.cache_len}, H={args.heads} d={args.dim} {args.dtype}; do_bench medians (ms)"
    )
    print(f"{'provider':>9} {'form':>7} {'eager':>9} {'eager[off]':>11} {'cuda graph':>11}")
    rows: List[Dict[str, object]] = []
    for provider in args.providers.split(","):
        with torch.inference_mode():
            for form, call in make_calls(args, provider).items():
                row: Dict[str, object] = {"provider": provider, "form": form}
                for label, checked in (("eager", True), ("eager_off", False)):
                    set_value_checks(checked)
                    call()  # autotunes and checks outside the timed window
                    row[label] = median_ms(call, "cuda")
                set_value_checks(None)
                row["graph"] = median_ms(cuda_graph_replay(call), "cuda")
                rows.append(row)
                print(
                    f"{provider:>9} {form:>7} {row['eager']:9.4f} {row['eager_off']:11.4f} "
                    f"{row['graph']:11.4f}",
                    flush=True,
                )
    return rows


if __name__ == "__main__":
    main(sys.argv[1:])
