"""HSTU attention benchmark: forward and backward TFLOP/s per backend (architecture §6).

    python -m tzrec_bench.kernels.hstu_attention                     # N = 256 ... 4096
    python -m tzrec_bench.kernels.hstu_attention --seq-lens 1024 --providers triton

Shapes: B sequences with lengths uniform in ``[0.9 N, N)``, ``num_targets`` uniform in
``[1, 20]``, H heads, q/k dim A and value dim V, q, k, v sliced from one ``[L, H, 2A + V]``
buffer (row stride ``H (2A + V)``), ``alpha = 1 / A``, ``sort_by_length=True``.

FLOPs per sequence of length n: forward ``H (A + V) n^2``, backward ``H n^2 (3A + 2V)``;
TFLOP/s = FLOPs / ms / 1e9. Times are ``triton.testing.do_bench`` medians (warm-up 25 ms,
rep >= 200 ms). The backward time is ``torch.autograd.grad`` of the output with respect to
q, k, v (leaf views of the fused buffer, so no gradient copies are added). Timing uses the
settings a user gets: the ops' value checks on, with the offsets and ``num_targets`` moved
to the GPU by ``tzrec_ops.to_device`` (so they are checked on their host copies);
``--value-checks both`` also times each provider with the checks off (``name[off]``) in the
same run. Each point also reports the
peak GPU memory its timed calls allocated above the inputs (for the pytorch reference this
is the chunked attention's working set: ``--pytorch-max-seq-len 4096`` shows it at B=512),
and the GPU's median SM clock, highest temperature and median power while it was timed
(:mod:`tzrec_bench.gpu_state`; a power-capped GPU slows down as it warms up, so figures from
two runs compare only at similar clocks).
"""

from __future__ import annotations

import argparse
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from tzrec_bench.gpu_state import GpuStateSampler, device_id
from tzrec_ops.ops.host_copies import to_device

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def make_inputs(
    batch: int, heads: int, attn_dim: int, hidden_dim: int, max_seq_len: int,
    dtype: torch.dtype, seed: int, device: str = "cuda",
) -> Dict[str, object]:
    """One benchmark batch; q, k, v are leaf views of one fused buffer."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(int(0.9 * max_seq_len), max_seq_len, (batch,), generator=g)
    targets = torch.minimum(torch.randint(1, 21, (batch,), generator=g), lengths)
    offsets = torch.zeros(batch + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(lengths, 0)
    total = int(offsets[-1])
    buf = torch.empty(total, heads, 2 * attn_dim + hidden_dim, dtype=dtype, device=device)
    buf.uniform_(-0.01, 0.01, generator=torch.Generator(device).manual_seed(seed))
    q, k, v = torch.split(buf, [attn_dim, attn_dim, hidden_dim], dim=-1)
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    return dict(
        q=q, k=k, v=v, seq_offsets=to_device(offsets, device),
        num_targets=to_device(targets, device),
        lengths=lengths, max_seq_len=max_seq_len,
    )


def flops(lengths: torch.Tensor, heads: int, attn_dim: int, hidden_dim: int, mode: str) -> float:
    sq = float((lengths.double() ** 2).sum())
    if mode == "fwd":
        return heads * (attn_dim + hidden_dim) * sq
    return heads * (3 * attn_dim + 2 * hidden_dim) * sq


def _bench(fn: Callable[[], object], rep: int) -> float:
    import triton

    return float(triton.testing.do_bench(fn, warmup=25, rep=rep, return_mode="median"))


def run_point(
    inputs: Dict[str, object], provider: str, mode: str, rep: int
) -> Tuple[float, float, Tuple[float, float]]:
    """Median milliseconds of one provider (backend name) in one mode (fwd | bwd), the peak
    GPU memory (MiB) the timed calls allocated above the inputs, and the epoch-time window of
    the timing (autotuning happens in an untimed call before it)."""
    from tzrec_ops.ops.hstu_attention import hstu_mha

    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()

    q, k, v = inputs["q"], inputs["k"], inputs["v"]

    def forward():
        return hstu_mha(
            inputs["max_seq_len"], 1.0 / q.shape[2], q, k, v, inputs["seq_offsets"],
            num_targets=inputs["num_targets"], sort_by_length=True, backend=provider,
        )

    def timed(fn: Callable[[], object]) -> Tuple[float, Tuple[float, float]]:
        fn()  # autotunes, outside the timed window
        torch.cuda.synchronize()
        start = time.time()
        ms = _bench(fn, rep)
        return ms, (start, time.time())

    if mode == "fwd":
        with torch.no_grad():
            ms, window = timed(forward)
    else:
        out = forward()
        dout = torch.randn_like(out)
        ms, window = timed(lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True))
        del out, dout
    return ms, (torch.cuda.max_memory_allocated() - base) / 2**20, window


def chosen_configs() -> str:
    """The autotuner's last choice for each Triton attention kernel (head dims <= 128)."""
    from tzrec_ops.backends.triton import hstu_attention as impl

    chosen = []
    for label, kernel in (("fwd", impl._fwd_kernel), ("dkdv", impl._bwd_dkdv_kernel),
                          ("dq", impl._bwd_dq_kernel)):
        config = getattr(kernel, "best_config", None)
        if config is not None:
            kw = config.kwargs
            halves = " halves" if kw.get("Q_SPLITS", 1) == 2 else ""
            cap = f" r{config.maxnreg}" if config.maxnreg else ""
            chosen.append(f"{label} {kw['BLOCK_M']}x{kw['BLOCK_N']}{halves} "
                          f"w{config.num_warps} s{config.num_stages}{cap}")
    return "; ".join(chosen)


def main(argv: Optional[Sequence[str]] = None) -> List[Dict[str, object]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--attn-dim", type=int, default=128)
    parser.add_argument("--hidden-dim", type=int, default=128)
    parser.add_argument("--dtype", choices=sorted(_DTYPES), default="bf16")
    parser.add_argument("--seq-lens", default="256,512,1024,2048,4096")
    parser.add_argument("--providers", default="triton,triton_tma,pytorch",
                        help="backend names; pytorch runs only up to --pytorch-max-seq-len")
    parser.add_argument("--pytorch-max-seq-len", type=int, default=512)
    parser.add_argument("--modes", default="fwd,bwd")
    parser.add_argument("--rep", type=int, default=200, help="do_bench rep in ms (>= 200)")
    parser.add_argument("--seed", type=int, default=1001)
    parser.add_argument("--value-checks", choices=("on", "off", "both"), default="on",
                        help="the ops' argument value checks while timing (default: on, "
                             "as users run; both: each provider twice, [off] marks checks off)")
    parser.add_argument("--show-configs", action="store_true",
                        help="print the tile configs the autotuner chose (BLOCK_MxBLOCK_N; "
                             "'halves': the forward's query block runs as two row halves; "
                             "rN: capped at N registers per thread)")
    args = parser.parse_args(argv)
    if args.rep < 200:
        parser.error(f"--rep must be >= 200 ms, got {args.rep}")

    import triton

    from tzrec_ops.ops.validation import set_value_checks
    from tzrec_ops.registry import get_backend

    torch.backends.cuda.matmul.allow_tf32 = True
    print(f"GPU: {torch.cuda.get_device_name()}  torch {torch.__version__}  "
          f"triton {triton.__version__}")
    print(f"B={args.batch} H={args.heads} A={args.attn_dim} V={args.hidden_dim} "
          f"{args.dtype}, lengths U[0.9N, N), targets U[1, 20], fused q/k/v buffer, "
          f"sort_by_length=True; value checks {args.value_checks}; do_bench median, "
          f"warmup 25 ms, rep {args.rep} ms")
    providers = [p for p in args.providers.split(",") if p]
    for p in providers:
        reason = get_backend(p).unavailable_reason()
        if reason is not None:
            print(f"skipping provider {p}: {reason}")
    providers = [p for p in providers if get_backend(p).unavailable_reason() is None]
    checks = {"on": (True,), "off": (False,), "both": (True, False)}[args.value_checks]
    modes = [m for m in args.modes.split(",") if m]
    rows: List[Dict[str, object]] = []
    header = f"{'N':>5} {'provider':>11} " + " ".join(
        f"{m + ' ms':>9} {m + ' TFLOP/s':>12} {m + ' peak MiB':>13} {m + ' GPU while timed':>24}"
        for m in modes)
    print(header, flush=True)
    with GpuStateSampler(device_id(torch.cuda.current_device())) as sampler:
        for n in (int(x) for x in args.seq_lens.split(",")):
            inputs = make_inputs(args.batch, args.heads, args.attn_dim, args.hidden_dim, n,
                                 _DTYPES[args.dtype], args.seed)
            for p, checked in ((p, c) for p in providers for c in checks):
                if p == "pytorch" and n > args.pytorch_max_seq_len:
                    continue
                set_value_checks(checked)
                label = p if checked else f"{p}[off]"
                row: Dict[str, object] = {"N": n, "provider": p, "value_checks": checked}
                cells = []
                for m in modes:
                    ms, peak, window = run_point(inputs, p, m, args.rep)
                    tflops = flops(inputs["lengths"], args.heads, args.attn_dim,
                                   args.hidden_dim, m) / ms / 1e9
                    state = sampler.window(*window)
                    row[f"{m}_ms"], row[f"{m}_tflops"], row[f"{m}_peak_mib"] = ms, tflops, peak
                    row[f"{m}_gpu_state"] = state
                    cells.append(f"{ms:9.3f} {tflops:12.1f} {peak:13.0f} "
                                 f"{state.cell() if state else 'n/a':>24}")
                rows.append(row)
                print(f"{n:5d} {label:>11} " + " ".join(cells), flush=True)
                if args.show_configs and p.startswith("triton"):
                    print(f"{'':17} configs: {chosen_configs()}", flush=True)
            del inputs
            torch.cuda.empty_cache()
    set_value_checks(None)
    return rows


if __name__ == "__main__":
    main()
