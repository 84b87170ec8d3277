"""CPU speed of backend ``compiled`` against the reference ``pytorch`` backend.

    python benchmarks/cpu_speed.py [--threads N] [--repeats R]

Times, through the public ops (argument checks and dispatch included):

* ``hstu_mha`` forward + backward, B = 16 sequences with lengths drawn in [N/2, N], N = 256,
  H = 2, d = 64 (q/k and v), float32 and bfloat16;
* ``layer_norm`` forward + backward on [4096, 256], float32 and bfloat16.

Each figure is the median of R timed steps after 3 warm-up steps (which include the
compilation); the two backends' steps alternate, so a change in the machine's load hits both
alike. Prints, per case, the wall time and the process CPU time of each backend and the
speed-ups (pytorch time / compiled time).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable, Dict, List, Tuple

import torch

import tzrec_ops
from tzrec_ops.testing.generators import make_attention_inputs, random_lengths


def _medians_ms(
    steps: Dict[str, Callable[[], None]], warmup: int, repeats: int
) -> Dict[str, Tuple[float, float]]:
    """(median wall time, median CPU time of this process) of each step, in ms.

    The steps are timed in alternation (one of each per round), so a change in the machine's
    load hits both alike. The CPU time leaves out the time other processes held the cores,
    so on a shared machine it is the steadier of the two (with one thread it is the work)."""
    for step in steps.values():
        for _ in range(warmup):
            step()
    times: Dict[str, List[Tuple[float, float]]] = {name: [] for name in steps}
    for _ in range(repeats):
        for name, step in steps.items():
            wall, cpu = time.perf_counter(), time.process_time()
            step()
            times[name].append((time.perf_counter() - wall, time.process_time() - cpu))
    return {
        name: (statistics.median(w for w, _ in t) * 1e3, statistics.median(c for _, c in t) * 1e3)
        for name, t in times.items()
    }


def attention_step(backend: str, dtype: torch.dtype) -> Callable[[], None]:
    n = 256
    lengths = random_lengths(16, n, seed=0, min_len=n // 2)
    inp = make_attention_inputs(lengths, heads=2, attn_dim=64, hidden_dim=64, dtype=dtype,
                                max_seq_len=n)
    q, k, v = (t.detach().requires_grad_(True) for t in inp.tensors())
    tzrec_ops.remember_host_copy(inp.seq_offsets, inp.seq_offsets)  # checks read no copy

    def step() -> None:
        out = tzrec_ops.hstu_mha(n, 0.125, q, k, v, inp.seq_offsets, backend=backend)
        out.backward(torch.ones_like(out))

    return step


def layer_norm_step(backend: str, dtype: torch.dtype) -> Callable[[], None]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4096, 256, generator=g).to(dtype).requires_grad_(True)
    w = torch.randn(256, generator=g).to(dtype).requires_grad_(True)
    b = torch.randn(256, generator=g).to(dtype).requires_grad_(True)

    def step() -> None:
        out = tzrec_ops.layer_norm(x, w, b, backend=backend)
        out.backward(torch.ones_like(out))

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    cases = [
        ("hstu_mha fwd+bwd B=16 N=256 H=2 d=64", attention_step),
        ("layer_norm fwd+bwd [4096, 256]", layer_norm_step),
    ]
    for label, make in cases:
        for dtype in (torch.float32, torch.bfloat16):
            # warm-up steps include the compilation
            ms = _medians_ms({b: make(b, dtype) for b in ("pytorch", "compiled")}, 3,
                             args.repeats)
            (ref, ref_cpu), (new, new_cpu) = ms["pytorch"], ms["compiled"]
            print(f"{label} {str(dtype)[6:]:9s} wall: pytorch {ref:7.2f} ms compiled "
                  f"{new:7.2f} ms = {ref / new:4.2f}x | CPU time: pytorch {ref_cpu:7.2f} ms "
                  f"compiled {new_cpu:7.2f} ms = {ref_cpu / new_cpu:4.2f}x")


if __name__ == "__main__":
    main()
