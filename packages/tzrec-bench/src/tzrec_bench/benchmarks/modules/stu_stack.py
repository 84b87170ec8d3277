"""Benchmark a 3-layer STU stack: training step per backend, and KV-cached serving.

Usage (GPU)::

    python -m tzrec_bench.benchmarks.modules.stu_stack --providers pytorch,triton

Measures, in bf16 with E=512, H=4, d=128 and 64 sequences of U[0.9 N, N) tokens (N=2048):

* train: forward + backward of the stack, tokens/s per provider (backend name);
* serve (weights in the compute dtype): 8 new tokens per sequence against a 2000-token KV
  cache (``cached_forward``) vs a full forward over 2008 tokens, ms and speed-up, in two
  modes: "score" (``update_cache=False``: candidates scored against a fixed history, no new
  cache built) and "append" (``update_cache=True``: the extended cache is built too, as decoding
  needs); on a GPU also replayed from CUDA graphs, as a server with fixed request shapes
  would run them (no Python or launch cost).

Each figure is a median in ms (:func:`tzrec_ops.measure.median_ms`: on a GPU
``triton.testing.do_bench``, warm-up 25 ms, rep 200 ms; on the CPU, calls timed one by one
for 200 ms), with the settings a user gets: the ops' value checks on, the batch's index
tensors built on the CPU and moved with ``tzrec_ops.to_device`` (so they are checked on their
host copies, without a device read). ``--value-checks both`` adds each figure with the checks
off, from the same run.
"""

from __future__ import annotations

import sys
from typing import Callable, Dict, List, Optional

import torch

from tzrec_bench.benchmarks.opbench.report import device_name, triton_version
from tzrec_bench.benchmarks.opbench.shapes import Shape, jagged_batch
from tzrec_gr import STULayer, STUStack
from tzrec_ops import set_value_checks, to_device
from tzrec_ops.commandline import ArgumentParser
from tzrec_ops.jagged import offsets_from_lengths
from tzrec_ops.measure import cuda_graph_replay, median_ms


def _setup_stack(provider: str, args, device) -> STUStack:
    layers = [
        STULayer(
            args.embedding_dim,
            args.heads,
            args.head_dim,
            args.head_dim,
            output_dropout_ratio=0.0,
            scaling_seqlen=args.max_seq_len,
            backend=provider,
            device=device,
        )
        for _ in range(args.layers)
    ]
    return STUStack(layers)


def bench_train(provider: str, args, device, dtype) -> Dict[str, float]:
    """Forward + backward of the stack; returns ms and tokens/s."""
    torch.manual_seed(1001)
    stack = _setup_stack(provider, args, device)
    n = args.max_seq_len
    batch = jagged_batch(Shape(args.batch, n, args.heads, args.head_dim, args.head_dim,
                               args.embedding_dim))
    offsets = to_device(batch.offsets, device)
    num_targets = to_device(batch.num_targets, device)
    tokens = batch.tokens
    x = torch.randn(tokens, args.embedding_dim, device=device, dtype=dtype, requires_grad=True)
    grad = torch.randn(tokens, args.embedding_dim, device=device, dtype=dtype)

    def step():
        out = stack(x, offsets, n, num_targets).x
        out.backward(grad)

    ms = median_ms(step, device)
    return {"ms": ms, "tokens_per_s": tokens / ms * 1e3}


SERVE_MODES = (("score", False), ("append", True))  # (label, update_cache)


def bench_serve(provider: str, args, device, dtype) -> Dict[str, float]:
    """Cached forward of Δ new tokens (each serve mode) vs a full forward, in ms: keys
    ``{mode}_ms`` and ``full_ms``, and ``graph_{mode}_ms``/``graph_full_ms`` on a GPU."""
    torch.manual_seed(1001)
    # served in the compute dtype, as a server holds its weights (training keeps fp32 ones)
    stack = _setup_stack(provider, args, device).eval().to(dtype)
    cache_len, delta = args.cache_len, args.delta
    b, e = args.batch, args.embedding_dim
    lengths = torch.full((b,), cache_len + delta)
    offsets = to_device(offsets_from_lengths(lengths), device)
    cached_lengths = to_device(lengths - delta, device)
    x = torch.randn(int(lengths.sum()), e, device=device, dtype=dtype)
    rows = (offsets[1:, None] - delta + torch.arange(delta, device=device)).reshape(-1)
    with torch.inference_mode():
        caches = stack(
            x,
            offsets,
            cache_len + delta,
            kv_caching_lengths=cached_lengths,
            max_kv_caching_len=cache_len,
            total_kv_caching_len=b * cache_len,
        ).kv_caches
        delta_x = x[rows]

        def cached_step(update_cache: bool) -> Callable[[], object]:
            return lambda: stack.cached_forward(delta_x, caches, update_cache=update_cache)

        def full_step() -> object:
            return stack(x, offsets, cache_len + delta)

        result = {"full_ms": median_ms(full_step, device)}
        for mode, update_cache in SERVE_MODES:
            result[f"{mode}_ms"] = median_ms(cached_step(update_cache), device)
        if device.type == "cuda":
            result["graph_full_ms"] = median_ms(cuda_graph_replay(full_step), device)
            for mode, update_cache in SERVE_MODES:
                replay = cuda_graph_replay(cached_step(update_cache))
                result[f"graph_{mode}_ms"] = median_ms(replay, device)
    return result


def main(argv: Optional[List[str]] = None) -> int:
    p = ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--providers", default="pytorch,triton", help="comma-separated backend names")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--max-seq-len", type=int, default=2048)
    p.add_argument("--embedding-dim", type=int, default=512)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--cache-len", type=int, default=2000)
    p.add_argument("--delta", type=int, default=8)
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    p.add_argument("--modes", default="train,serve")
    p.add_argument(
        "--value-checks",
        choices=("on", "off", "both"),
        default="on",
        help="the ops' value checks while timing (default on, as users run them)",
    )
    args = p.parse_args(argv)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.backends.cuda.matmul.allow_tf32 = True
    print(
        f"device {device_name(device)}, torch {torch.__version__}, triton {triton_version()}, "
        f"{args.dtype}, "
        f"E {args.embedding_dim}, H {args.heads}, d {args.head_dim}, {args.layers} layers, "
        f"B {args.batch}, N {args.max_seq_len}"
    )
    print(f"ops value checks while timing: {args.value_checks}")
    modes = args.modes.split(",")
    train: Dict[str, Dict[str, float]] = {}
    checks = {"on": (True,), "off": (False,), "both": (True, False)}[args.value_checks]
    for provider, checked in ((p, c) for p in args.providers.split(",") for c in checks):
        set_value_checks(checked)
        label = provider if checked else f"{provider}[off]"
        if "train" in modes:
            r = bench_train(provider, args, device, dtype)
            train[label] = r
            tokens_m = r["tokens_per_s"] / 1e6
            print(f"train {label:>13}: {r['ms']:9.2f} ms/step  {tokens_m:8.3f} M tokens/s")
        if "serve" in modes:
            r = bench_serve(provider, args, device, dtype)
            runs = [("eager", "")] + ([("cuda graph", "graph_")] if "graph_full_ms" in r else [])
            for label, prefix in runs:
                full = r[f"{prefix}full_ms"]
                for mode, update_cache in SERVE_MODES:
                    cached = r[f"{prefix}{mode}_ms"]
                    print(
                        f"serve {label:>13} {mode:>6} (update_cache={update_cache!s:>5}, "
                        f"{label:>10}): {args.delta} new tokens vs a {args.cache_len}-token "
                        f"cache {cached:8.3f} ms, full recompute {full:8.3f} ms, speed-up "
                        f"{full / cached:6.1f}x"
                    )
    if "pytorch" in train and "triton" in train:
        ratio = train["triton"]["tokens_per_s"] / train["pytorch"]["tokens_per_s"]
        print(f"train triton / pytorch tokens/s: {ratio:.2f}x")
    set_value_checks(None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
