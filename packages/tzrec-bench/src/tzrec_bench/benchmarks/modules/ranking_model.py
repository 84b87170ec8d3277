"""Benchmark the HSTU ranking model: a training step per backend, and model-level serving.

Usage (GPU)::

    python -m tzrec_bench.benchmarks.modules.ranking_model --providers pytorch,triton

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
timeline and its host time, and the kernels with the most device time. ``--count-ops`` counts
the aten ops of one training step per part (on any device: the CPU shows the op overhead
around the STU layers as well as a GPU does). ``--compile`` also times the training step with
the model under ``torch.compile``, which removes most of the host time between the
eager step's small kernels.

Each figure is a median in ms (:func:`tzrec_ops.measure.median_ms`: on a GPU
``triton.testing.do_bench``, warm-up 25 ms, rep 200 ms; on the CPU, calls timed one by one
for 200 ms). Inputs come as a server gets them: index tensors built on the CPU and moved with
``tzrec_ops.to_device`` (checked on their host copies, no device read), value checks on.
"""

from __future__ import annotations

import contextlib
import sys
from collections import Counter
from typing import Callable, ContextManager, Dict, Iterator, List, Optional, Tuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode

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
from tzrec_gr.serving import RankingServer
from tzrec_ops.commandline import ArgumentParser
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


def _train_setup(provider: str, args, device, autocast_on_cpu: bool = False):
    """The training step's model (train mode), AdamW (fused on a GPU), batch, labels and
    autocast context (bf16 on a GPU, and on the CPU with ``autocast_on_cpu``): histories
    U[0.9 N, N) and U[1, max_targets] candidates per user."""
    model = build_model(provider, args, device).train()
    # one fused kernel per parameter group on a GPU, as the trainer steps (train/strategies.py)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=1e-4, fused=True if device.type == "cuda" else None
    )
    n = args.max_uih_len
    uih = torch.randint(int(0.9 * n), n, (args.train_batch,))
    cand = torch.randint(1, args.max_targets + 1, (args.train_batch,))
    batch = {
        **history(uih, args.num_items, device),
        **candidates(cand, args.num_items, int(uih.sum()) * 60, device),
    }
    labels = torch.randint(0, 4, (int(cand.sum()),), device=device)
    on = device.type == "cuda" or autocast_on_cpu
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=on)
    return model, optimizer, batch, labels, autocast


def bench_train(provider: str, args, device, compiled: bool = False) -> Dict[str, float]:
    """The training step's ms and tokens/s; ``compiled`` runs the model's forward (and so
    its backward) through ``torch.compile`` (the first, compiling, calls are not timed)."""
    _, step, tokens = _phased_step(
        provider, args, device, lambda name: contextlib.nullcontext(), compiled=compiled
    )
    if compiled:  # compile (forward and backward graphs) before the timer sizes its runs
        for _ in range(2):
            step()
    ms = median_ms(step, device)
    return {"ms": ms, "tokens_per_s": tokens / ms * 1e3}


def _parts(model: HSTURanking) -> Dict[str, torch.nn.Module]:
    """The model's parts, by name: the embeddings, the transducer (its own code: splitting
    off the candidates), each child of the transducer (each STU layer on its own), the
    towers."""
    transducer = model.transducer
    parts = {"item_embeddings": model.item_embeddings, "transducer": transducer,
             "item_tower": model.item_tower, "task_head": model.task_head}
    for name, child in transducer.named_children():
        if name == "stu":
            for i, layer in enumerate(child.stu_layers):
                parts[f"stu.layer{i}"] = layer
        else:
            parts[f"transducer.{name}"] = child
    return parts


def _hook_parts(
    model: HSTURanking, enter: Callable[[str], None], leave: Callable[[str], None]
) -> List[torch.utils.hooks.RemovableHandle]:
    """Calls ``enter(name)`` / ``leave(name)`` around each forward of the model's parts."""
    handles = []
    for name, module in _parts(model).items():

        def pre_hook(module, inputs, name=name) -> None:
            enter(name)

        def hook(module, inputs, output, name=name) -> None:
            leave(name)

        handles += [module.register_forward_pre_hook(pre_hook), module.register_forward_hook(hook)]
    return handles


def _annotate(model: HSTURanking) -> List[torch.utils.hooks.RemovableHandle]:
    """Puts each forward of the model's parts in a profiler range named after it (the
    embeddings, the transducer's preprocessing, each STU layer, postprocessing, the towers)."""
    ranges: List[torch.profiler.record_function] = []

    def enter(name: str) -> None:
        ranges.append(torch.profiler.record_function(f"fwd:{name}"))
        ranges[-1].__enter__()

    def leave(name: str) -> None:
        ranges.pop().__exit__(None, None, None)

    return _hook_parts(model, enter, leave)


def _phased_step(
    provider: str,
    args,
    device,
    phase: Callable[[str], ContextManager[object]],
    autocast_on_cpu: bool = False,
    compiled: bool = False,
) -> Tuple[HSTURanking, Callable[[], None], int]:
    """The model, the training step (each phase, ``forward``, ``loss``, ``backward`` and
    ``optimizer``, inside ``phase(name)``; ``compiled``: the model under ``torch.compile``)
    and the tokens of its batch (history events and candidates)."""
    model, optimizer, batch, labels, autocast = _train_setup(
        provider, args, device, autocast_on_cpu
    )
    forward = torch.compile(model) if compiled else model

    def step() -> None:
        with autocast:
            with phase("forward"):
                logits = forward(batch)
            with phase("loss"):
                loss = model.loss(logits, labels)
        optimizer.zero_grad(set_to_none=True)
        with phase("backward"):
            loss.backward()
        with phase("optimizer"):
            optimizer.step()

    tokens = batch[UIH_ITEM_ID].shape[0] + batch[CANDIDATE_ITEM_ID].shape[0]
    return model, step, tokens


def profile_train(
    provider: str, args, device, steps: int = 5, compiled: bool = False
) -> str:
    """The training step of :func:`bench_train` under ``torch.profiler``: device (kernel) time
    and host time per step, split into forward parts, loss, backward and the optimizer, and
    the kernels that take the most device time. ``compiled``: the model under
    ``torch.compile``, whose forward is one range (its parts are fused across)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    model, step, _ = _phased_step(
        provider, args, device, lambda name: record_function(f"step:{name}"), compiled=compiled
    )
    for _ in range(3):  # compiles and autotuning stay out of the profile
        step()
    handles = [] if compiled else _annotate(model)
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
    lines = [f"profile {provider}{' compiled' if compiled else ''} (B {args.train_batch}, "
             f"history < {args.max_uih_len}, "
             f"{steps} steps): per "
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


# tzrec_ops.jagged functions whose ops work on host copies of index tensors (on the CPU
# whatever the model's device): value checks and the host side of ``mirror``
_HOST_SIDE = {"check_once", "host_copy", "host_copies", "remember_host_copy"}


def _on_host_copies() -> bool:
    """Whether the calling op works on host copies (see ``_HOST_SIDE``)."""
    frame = sys._getframe(2)
    while frame is not None:
        code = frame.f_code
        if "tzrec_ops" in code.co_filename and (
            code.co_name in _HOST_SIDE
            # mirror's second run, on the host copies, comes after its device run (``out``)
            or (code.co_name == "mirror" and "out" in frame.f_locals)
        ):
            return True
        frame = frame.f_back
    return False


class _OpCounter(TorchDispatchMode):
    """Counts the aten ops dispatched (after autograd and the composite decompositions, so
    about one per kernel launch on a GPU), per label (the innermost entered name), apart
    from the ops on host copies of index tensors (label ``host``; see ``_HOST_SIDE``)."""

    def __init__(self) -> None:
        super().__init__()
        self.labels: List[str] = []
        self.counts: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        label = self.labels[-1] if self.labels else "other"
        if _on_host_copies():
            label = f"{label} (host copies)"
        self.counts[(label, func.overloadpacket.__name__)] += 1
        return func(*args, **(kwargs or {}))


def count_train_ops(provider: str, args, device, top: int = 6) -> str:
    """The aten ops of one training step of :func:`bench_train` (after a warm-up step), per
    forward part (see :func:`_parts`; ``forward`` is the model's own code around them, its
    input checks included), loss, backward and optimizer, with each part's commonest ops.
    Runs on any device, the CPU included, under bf16 autocast as the GPU step runs (so the
    casts it makes are counted too)."""
    counter = _OpCounter()

    @contextlib.contextmanager
    def phase(name: str) -> Iterator[None]:
        counter.labels.append(name)
        try:
            yield
        finally:
            counter.labels.pop()

    model, step, _ = _phased_step(provider, args, device, phase, autocast_on_cpu=True)
    step()
    handles = _hook_parts(model, counter.labels.append, lambda name: counter.labels.pop() and None)
    try:
        with counter:
            step()
    finally:
        for handle in handles:
            handle.remove()
    per_label: Counter = Counter()
    for (label, _), n in counter.counts.items():
        per_label[label] += n
    order = ["forward", *_parts(model), "loss", "backward", "optimizer", "other"]
    order = [label for name in order for label in (name, f"{name} (host copies)")]
    host = sum(n for label, n in per_label.items() if label.endswith("(host copies)"))
    lines = [f"aten ops of one training step, {provider} (B {args.train_batch}, history < "
             f"{args.max_uih_len}): {sum(per_label.values())}, {host} of them on host copies "
             "of index tensors (the CPU, whatever the model's device)"]
    for label in [name for name in order if per_label[name]]:
        ops = sorted(((n, op) for (lab, op), n in counter.counts.items() if lab == label),
                     reverse=True)[:top]
        common = ", ".join(f"{op} {n}" for n, op in ops)
        lines.append(f"  {label:<36} {per_label[label]:6d}  {common}")
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
        score_server = RankingServer(scorer)
        cache = score_server.prefill(hist, query_time=query_time)
        appender = build_model(provider, args, device, use_time_encoding=False).eval().to(dtype)
        extend_server = RankingServer(appender)
        plain_cache = extend_server.prefill(hist)
        steps: Dict[str, Callable[[], object]] = {
            "full": lambda: scorer(full_batch),
            "score": lambda: score_server.score(cache, cands),
            "extend": lambda: extend_server.extend(plain_cache, events),
        }
        for name, fn in steps.items():
            result[f"{name}_ms"] = median_ms(fn, device)
        if device.type == "cuda":
            for name, fn in steps.items():
                result[f"graph_{name}_ms"] = median_ms(cuda_graph_replay(fn), device)
    return result


def main(argv: Optional[List[str]] = None) -> int:
    p = ArgumentParser(description=__doc__.splitlines()[0])
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
                   "time per part of the model, and the heaviest kernels (with --compile, "
                   "the compiled step too)")
    p.add_argument("--compile", action="store_true",
                   help="also time the training step with the model under torch.compile")
    p.add_argument("--count-ops", action="store_true",
                   help="also count the aten ops of one training step per part of the model "
                   "(works on the CPU)")
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
        if "train" in modes and args.compile:
            r = bench_train(provider, args, device, compiled=True)
            print(
                f"train {provider:>10} compiled: {r['ms']:9.2f} ms/step "
                f"{r['tokens_per_s'] / 1e6:8.3f} M tokens/s"
            )
        if "train" in modes and args.profile:
            print(profile_train(provider, args, device))
        if "train" in modes and args.profile and args.compile:
            print(profile_train(provider, args, device, compiled=True))
        if "train" in modes and args.count_ops:
            print(count_train_ops(provider, args, device))
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
