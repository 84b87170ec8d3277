"""Benchmark the HSTU ranking model: a training step per backend, and model-level serving.

Usage (GPU)::

    python -m tzrec_bench.models.ranking_model --providers pytorch,triton

Measures, with E=512, H=4, d=128, 3 layers, 64 users of ~2000-event histories:

* train: forward + loss + backward of ``HSTURanking`` under bf16 autocast (fp32 weights, as
  the trainer runs it), history U[0.9 N, N) events and U[1, 8] candidates per user,
  tokens/s per provider (backend name);
* serve (weights in the compute dtype, eval mode): ``score`` of 8 candidates per user
  against a cache of 2000 history events (``prefill`` once) vs ``forward`` over history and
  candidates (the full recompute), and ``extend`` by 8 events vs the same full forward on a
  model built with ``use_time_encoding=False`` (the form that can append); eager and, on a
  GPU, replayed from CUDA graphs.

Each figure is a median in ms (:func:`tzrec_ops.measure.median_ms`: on a GPU
``triton.testing.do_bench``, warm-up 25 ms, rep 200 ms; on the CPU, calls timed one by one
for 200 ms). Inputs come as a server gets them: index tensors built on the CPU and moved with
``tzrec_ops.to_device`` (checked on their host copies, no device read), value checks on.
"""

from __future__ import annotations

import argparse
import sys
from typing import Callable, Dict, List, Optional

import torch

from tzrec_gr.features import (
    CANDIDATE_ITEM_ID,
    CANDIDATE_LENGTHS,
    CANDIDATE_TIMESTAMPS,
    QUERY_TIME,
    UIH_ACTIONS,
    UIH_ITEM_ID,
    UIH_LENGTHS,
    UIH_TIMESTAMPS,
)
from tzrec_gr.models import HSTURanking
from tzrec_ops.jagged import to_device
from tzrec_ops.measure import cuda_graph_replay, median_ms

CLICK, LIKE = 1, 2
Batch = Dict[str, torch.Tensor]


def build_model(provider: str, args, device, **kw) -> HSTURanking:
    torch.manual_seed(1001)
    return HSTURanking(
        args.num_items,
        args.item_dim,
        args.embedding_dim,
        task_bitmasks=[CLICK, LIKE],
        action_weights=[CLICK, LIKE],
        num_heads=args.heads,
        attention_dim=args.head_dim,
        hidden_dim=args.head_dim,
        num_layers=args.layers,
        dropout_ratio=0.0,
        backend=provider,
        device=device,
        max_uih_len=args.max_uih_len,
        max_targets=args.max_targets,
        **kw,
    )


def history(lengths: torch.Tensor, num_items: int, device, start: int = 0) -> Batch:
    """``uih.*`` features for users with ``lengths`` events (ids and times on ``device``)."""
    total = int(lengths.sum())
    ids = torch.randint(0, num_items, (total,))
    return {
        UIH_ITEM_ID: ids.to(device),
        UIH_LENGTHS: to_device(lengths, device),
        UIH_ACTIONS: torch.randint(0, 4, (total,)).to(device),
        UIH_TIMESTAMPS: (start + torch.arange(total) * 60).to(device),
    }


def candidates(lengths: torch.Tensor, num_items: int, now: int, device) -> Batch:
    total = int(lengths.sum())
    return {
        CANDIDATE_ITEM_ID: torch.randint(0, num_items, (total,)).to(device),
        CANDIDATE_LENGTHS: to_device(lengths, device),
        CANDIDATE_TIMESTAMPS: torch.full((total,), now).to(device),
    }


def bench_train(provider: str, args, device) -> Dict[str, float]:
    model = build_model(provider, args, device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    n = args.max_uih_len
    uih = torch.randint(int(0.9 * n), n, (args.train_batch,))
    cand = torch.randint(1, args.max_targets + 1, (args.train_batch,))
    now = int(uih.sum()) * 60
    batch = {
        **history(uih, args.num_items, device),
        **candidates(cand, args.num_items, now, device),
    }
    labels = torch.randint(0, 4, (int(cand.sum()),), device=device)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")

    def step() -> None:
        with autocast:
            loss = model.loss(model(batch), labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    ms = median_ms(step, device)
    tokens = int(uih.sum() + cand.sum())
    return {"ms": ms, "tokens_per_s": tokens / ms * 1e3}


def bench_serve(provider: str, args, device, dtype) -> Dict[str, float]:
    """ms of ``score``/``extend`` of Δ events vs the full forward; ``graph_*`` on a GPU."""
    b, cache_len, delta = args.batch, args.cache_len, args.delta
    now = b * (cache_len + delta) * 60 + 60
    hist_lengths = torch.full((b,), cache_len)
    new_lengths = torch.full((b,), delta)
    torch.manual_seed(7)
    hist = history(hist_lengths, args.num_items, device)
    cands = candidates(new_lengths, args.num_items, now, device)
    events = history(new_lengths, args.num_items, device, start=now - 60 * b * delta)
    query_time = to_device(torch.full((b,), now), device)
    full_batch = {**hist, **cands, QUERY_TIME: query_time}
    result: Dict[str, float] = {}
    with torch.inference_mode():
        scorer = build_model(provider, args, device).eval().to(dtype)
        cache = scorer.prefill(hist, query_time=query_time)
        appender = build_model(provider, args, device, use_time_encoding=False).eval().to(dtype)
        plain_cache = appender.prefill(hist)
        steps: Dict[str, Callable[[], object]] = {
            "full": lambda: scorer(full_batch),
            "score": lambda: scorer.score(cache, cands),
            "extend": lambda: appender.extend(plain_cache, events),
        }
        for name, fn in steps.items():
            result[f"{name}_ms"] = median_ms(fn, device)
        if device.type == "cuda":
            for name, fn in steps.items():
                result[f"graph_{name}_ms"] = median_ms(cuda_graph_replay(fn), device)
    return result


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--providers", default="pytorch,triton", help="comma-separated backend names")
    p.add_argument("--modes", default="train,serve")
    p.add_argument("--batch", type=int, default=64, help="serving: users per request batch")
    p.add_argument("--train-batch", type=int, default=32)
    p.add_argument("--cache-len", type=int, default=2000, help="serving: cached events per user")
    p.add_argument("--delta", type=int, default=8, help="serving: new candidates or events")
    p.add_argument("--max-uih-len", type=int, default=2048)
    p.add_argument("--max-targets", type=int, default=8)
    p.add_argument("--num-items", type=int, default=100_000)
    p.add_argument("--item-dim", type=int, default=128)
    p.add_argument("--embedding-dim", type=int, default=512)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    args = p.parse_args(argv)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    gpu = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    print(
        f"HSTURanking on {gpu}, torch {torch.__version__}, serving {args.dtype}, "
        f"E {args.embedding_dim}, H {args.heads}, d {args.head_dim}, {args.layers} layers"
    )
    modes = args.modes.split(",")
    train: Dict[str, float] = {}
    for provider in args.providers.split(","):
        if "train" in modes:
            r = bench_train(provider, args, device)
            train[provider] = r["tokens_per_s"]
            print(
                f"train {provider:>10} (B {args.train_batch}, history < {args.max_uih_len}): "
                f"{r['ms']:9.2f} ms/step {r['tokens_per_s'] / 1e6:8.3f} M tokens/s"
            )
        if "serve" in modes:
            r = bench_serve(provider, args, device, dtype)
            runs = [("eager", "")] + ([("cuda graph", "graph_")] if "graph_full_ms" in r else [])
            for label, prefix in runs:
                full = r[f"{prefix}full_ms"]
                for step in ("score", "extend"):
                    cached = r[f"{prefix}{step}_ms"]
                    print(
                        f"serve {provider:>10} {label:>10} {step:>6}: B {args.batch}, "
                        f"{args.delta} new vs a {args.cache_len}-event cache {cached:8.3f} ms, "
                        f"full forward {full:8.3f} ms, speed-up {full / cached:6.1f}x"
                    )
    if "pytorch" in train and "triton" in train:
        print(f"train triton / pytorch tokens/s: {train['triton'] / train['pytorch']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
