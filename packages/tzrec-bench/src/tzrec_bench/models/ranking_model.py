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

``--profile`` also profiles the training step (``torch.profiler``): per part of the model
(forward ranges: embeddings, preprocessing, each STU layer, postprocessing, towers; then loss,
backward and optimizer) the device time of the kernels it launched, its span on the GPU
timeline and its host time, and the kernels with the most device time.

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


def _annotate(model: HSTURanking) -> List[torch.utils.hooks.RemovableHandle]:
    """Puts each forward of the model's parts in a profiler range named after it (the
    embeddings, the transducer's preprocessing, each STU layer, postprocessing, the towers)."""
    transducer = model.transducer
    parts = {"item_embeddings": model.item_embeddings, "item_tower": model.item_tower,
             "task_head": model.task_head}
    for name, child in transducer.named_children():
        if name == "stu":
            for i, layer in enumerate(child.stu_layers):
                parts[f"stu.layer{i}"] = layer
        else:
            parts[f"transducer.{name}"] = child
    handles = []
    for name, module in parts.items():
        ranges: List[torch.profiler.record_function] = []

        def enter(module, inputs, ranges=ranges, name=name):
            ranges.append(torch.profiler.record_function(f"fwd:{name}"))
            ranges[-1].__enter__()

        def leave(module, inputs, output, ranges=ranges):
            ranges.pop().__exit__(None, None, None)

        handles += [module.register_forward_pre_hook(enter), module.register_forward_hook(leave)]
    return handles


def profile_train(provider: str, args, device, steps: int = 5) -> str:
    """The training step of :func:`bench_train` under ``torch.profiler``: device (kernel) time
    and host time per step, split into forward parts, loss, backward and the optimizer, and
    the kernels that take the most device time."""
    from torch.profiler import ProfilerActivity, profile, record_function

    model = build_model(provider, args, device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    n = args.max_uih_len
    uih = torch.randint(int(0.9 * n), n, (args.train_batch,))
    cand = torch.randint(1, args.max_targets + 1, (args.train_batch,))
    batch = {**history(uih, args.num_items, device),
             **candidates(cand, args.num_items, int(uih.sum()) * 60, device)}
    labels = torch.randint(0, 4, (int(cand.sum()),), device=device)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")

    def step() -> None:
        with autocast:
            with record_function("step:forward"):
                logits = model(batch)
            with record_function("step:loss"):
                loss = model.loss(logits, labels)
        optimizer.zero_grad(set_to_none=True)
        with record_function("step:backward"):
            loss.backward()
        with record_function("step:optimizer"):
            optimizer.step()

    for _ in range(3):  # compiles and autotuning stay out of the profile
        step()
    handles = _annotate(model)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda"
                                           else [])
    try:
        with profile(activities=activities) as prof:
            for _ in range(steps):
                with record_function("step"):
                    step()
            if device.type == "cuda":
                torch.cuda.synchronize()
    finally:
        for handle in handles:
            handle.remove()
    events = prof.key_averages()

    def device_ms(evt) -> float:
        return getattr(evt, "device_time_total", getattr(evt, "cuda_time_total", 0.0)) / 1e3

    def on_device(evt) -> bool:
        return str(getattr(evt, "device_type", "")).endswith("CUDA")

    # each range appears twice: its host side (the device time of the kernels it launched)
    # and, on CUDA, its span on the GPU timeline (kernels and the idle gaps between them)
    ranges = sorted({e.key for e in events if e.key.startswith(("step", "fwd:"))})
    host = {e.key: e for e in events if e.key in ranges and not on_device(e)}
    span = {e.key: device_ms(e) / steps for e in events if e.key in ranges and on_device(e)}
    kernels = [e for e in events if on_device(e) and e.key not in ranges
               and not e.key.startswith("Optimizer.")]
    total_kernel = sum(device_ms(e) for e in kernels) / steps
    lines = [f"profile {provider} (B {args.train_batch}, history < {n}, {steps} steps): per "
             f"step {host['step'].cpu_time_total / 1e3 / steps:.2f} ms on the host, "
             f"{span.get('step', float('nan')):.2f} ms on the GPU timeline, "
             f"{total_kernel:.2f} ms of kernels"]
    lines.append(f"  {'range':<36} {'kernels ms':>10} {'GPU span':>9} {'host ms':>9}")
    for key in ranges:
        evt = host[key]
        lines.append(f"  {key:<36} {device_ms(evt) / steps:10.3f} "
                     f"{span.get(key, float('nan')):9.3f} {evt.cpu_time_total / 1e3 / steps:9.3f}")
    lines.append("  kernels with the most device time (ms per step, calls per step):")
    for evt in sorted(kernels, key=device_ms, reverse=True)[:15]:
        lines.append(f"    {device_ms(evt) / steps:8.3f} {evt.count // steps:5d}  {evt.key[:90]}")
    return "\n".join(lines)


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
    p.add_argument("--profile", action="store_true",
                   help="also profile the training step (torch.profiler): kernel and host "
                   "time per part of the model, and the heaviest kernels")
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
        if "train" in modes and args.profile:
            print(profile_train(provider, args, device))
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
