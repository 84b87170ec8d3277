"""``python -m tzrec_bench.benchmarks.export``: what export and quantization buy for HSTU ranking.

Three comparisons, each printed with the device, torch / triton versions and shapes:

1. the full forward (B users, ~``history`` events each, ``new`` candidates each): eager
   against its AOTInductor package, loaded in this process;
2. the packaged cached serving step (``new`` candidates scored against a ``history``-event
   cache: ``HSTURanking.score``) against the packaged full forward of the same users; on
   a GPU also with both packages replayed from CUDA graphs. With ``--dtype bf16/fp16`` the
   cache is held in that dtype, as a half-precision prefill stores it;
3. int8 dense layers + int8 embedding tables against float, in eager mode on the CPU (torch's
   dynamic int8 linear runs there only): latency and the metric change. The metric is the
   AUC of the first task; its labels are the float model's own decisions (logit above the
   median) on synthetic data, so the float AUC is 1 and the change measures how much
   quantization reorders candidates. With ``--movielens DIR`` (MovieLens-100K's ``u.data``
   or ``u.data.gz``, read by :mod:`tzrec_bench.data` as ``tzrec-bench train`` reads it, so
   item ids are the dense ids a model trained there knows) the labels are ratings >= 4 of
   each user's last ``new`` ratings, the history their earlier ones; pass a trained model
   with ``--model`` for a meaningful AUC.

Every figure is a median in ms (:func:`tzrec_ops.measure.median_ms`: on a GPU
``triton.testing.do_bench``, warm-up 25 ms, rep 200 ms; on the CPU at least ``--repeats``
calls timed one by one, for at least 200 ms). Each package's outputs are checked against
eager first: per-output parity in fp32; with ``--dtype bf16/fp16`` the max abs difference
next to the dtype's spacing at the largest output (two half-precision runs round
differently, so neither is the reference).

GPU figures of the issue: ``--device cuda --backend triton --dtype bf16 --batch 64
--history 2000 --new 8`` (the default model: 3 layers, E = 512, 4 heads). CPU test sizes:
``--batch 2 --history 16 --new 4 --dim 16 --layers 1 --repeats 2``.

An AOTInductor package uses the C++ compiler's libstdc++; the script restarts itself once
with it preloaded (:func:`tzrec_ops.aoti.preloaded_env`; tzrec-ops' README, "Compile and
export").
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import torch

from tzrec_bench.benchmarks.opbench.report import triton_version
from tzrec_bench.data import DataFormatError, SequenceDataset, load_dataset
from tzrec_ops.aoti import preloaded_env
from tzrec_ops.commandline import ArgumentParser
from tzrec_ops.devices import add_device_option
from tzrec_ops.measure import cuda_graph_replay, median_ms

__all__ = ["main"]

_PRELOADED = "TZREC_BENCH_EXPORT_PRELOADED"


def _parser() -> argparse.ArgumentParser:
    p = ArgumentParser(
        prog="python -m tzrec_bench.benchmarks.export", description=__doc__.split("\n")[0]
    )
    add_device_option(p, "cpu")
    p.add_argument("--backend", default="pytorch", help="tzrec-ops backend (triton on a GPU)")
    p.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default="fp32")
    p.add_argument("--batch", type=int, default=8, help="B users")
    p.add_argument("--history", type=int, default=256, help="the longest history")
    p.add_argument("--new", type=int, default=8, help="candidates per user")
    p.add_argument("--dim", type=int, default=512, help="E")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--items", type=int, default=10000, help="catalogue size")
    p.add_argument(
        "--repeats",
        type=int,
        default=20,
        help="the fewest calls timed one by one (CPU); the median is reported",
    )
    p.add_argument("--model", help="a checkpoint / state dict to use instead of a fresh model")
    p.add_argument("--config", help="the model config of a plain state dict")
    p.add_argument("--movielens", help="MovieLens-100K folder (with u.data) for the metric")
    p.add_argument(
        "--cache-dir", help="where the MovieLens data set is cached (default: tzrec-bench's)"
    )
    p.add_argument("--skip-quant", action="store_true", help="skip comparison 3")
    p.add_argument("--workdir", help="where packages are written (default: a temporary one)")
    return p


def _versions(device: torch.device) -> str:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor()
    return (
        f"device {device} ({name or platform.machine()}), torch {torch.__version__}, "
        f"triton {triton_version()}, python {platform.python_version()}"
    )


def _model(args: argparse.Namespace, device: torch.device) -> torch.nn.Module:
    from tzrec_acc.checkpoint import load_model
    from tzrec_gr.models import HSTURanking

    if args.model:
        return load_model(args.model, args.config, args.backend).to(device).eval()
    torch.manual_seed(0)
    model = HSTURanking(
        args.items,
        args.dim,
        args.dim,
        [1, 2],
        [1, 2, 4, 8],
        num_heads=args.heads,
        num_layers=args.layers,
        dropout_ratio=0.0,
        backend=args.backend,
        device=device,
        max_uih_len=args.history,
        max_targets=args.new,
        use_time_encoding=True,
    )
    return model.eval()


def _progress(message: str) -> None:
    """A stage note on stderr (package compiles take minutes on a GPU with autotuning)."""
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def _package(module: torch.nn.Module, call: Tuple[Any, ...], shapes: Any, path: str) -> Any:
    from tzrec_acc import aot

    _progress(f"exporting and compiling {os.path.basename(path)}")
    program = aot.export(module, call, shapes)
    aot.compile_package(program, path)
    return torch._inductor.aoti_load_package(path)


def _forward_and_step(
    args: argparse.Namespace, model: torch.nn.Module, device: torch.device, workdir: str
) -> Iterator[str]:
    from tzrec_acc import aot, gr
    from tzrec_acc.precision import HalfPrecision

    step, step_call, step_shapes = gr.serving_step(model, args.history, args.new, args.batch)
    (features,) = gr.sample_inputs(model, args.batch, args.history, args.new, 0, device)
    query_time = step_call[4]
    features["query_time"] = query_time  # the cache's time anchor, for the same logits
    full_call, full_shapes = (features,), gr.dynamic_shapes(model, (features,), args.batch)
    # export from the varied example; time every user with exactly ``new`` candidates
    candidates = _candidates(model, args.batch, args.new, query_time)
    timed_full = ({**features, **candidates, "query_time": query_time},)
    timed_step = (*step_call[:-1], candidates)
    if args.dtype != "fp32":
        model, step = (
            HalfPrecision(model, args.dtype).eval(),
            HalfPrecision(step, args.dtype).eval(),
        )
        full_shapes, step_shapes = (tuple(full_shapes),), (tuple(step_shapes),)
        # the cache as a half-precision prefill stores it: a float32 cache would be
        # converted in every timed step (a read and a write of every cached key and value)
        step_call, timed_step = step.cast(step_call), step.cast(timed_step)
        full_call, timed_full = model.cast(full_call), model.cast(timed_full)

    def parity(name: str, eager_fn: Any, pkg: Any, call: Tuple[Any, ...]) -> str:
        want, got = aot.flat_outputs(eager_fn(*call)), aot.flat_outputs(pkg(*call))
        if args.dtype == "fp32":
            return f"parity, {name} package vs eager: {aot.parity(want, got)}"
        return f"parity, {name} package vs eager: {_half_parity(want, got, args.dtype)}"

    # each line as soon as it is measured: the step package compiles for minutes on a GPU
    with torch.no_grad():
        _progress("timing eager")
        eager = median_ms(lambda: model(*timed_full), device, min_calls=args.repeats)
        full_pkg = _package(model, full_call, full_shapes, os.path.join(workdir, "full.pt2"))
        yield parity("full forward", model, full_pkg, timed_full)
        full_ms = median_ms(lambda: full_pkg(*timed_full), device, min_calls=args.repeats)
        yield (
            f"1. full forward: eager {eager:.3f} ms, AOTInductor package {full_ms:.3f} ms "
            f"({eager / full_ms:.2f}x)"
        )
        step_pkg = _package(step, step_call, step_shapes, os.path.join(workdir, "step.pt2"))
        yield parity("serving step", step, step_pkg, timed_step)
        step_ms = median_ms(lambda: step_pkg(*timed_step), device, min_calls=args.repeats)
        yield (
            f"2. serving step ({args.new} candidates vs a {args.history}-event cache): "
            f"package {step_ms:.3f} ms vs packaged full forward {full_ms:.3f} ms "
            f"({full_ms / step_ms:.2f}x)"
        )
        if device.type == "cuda":
            yield _graph_replay_line(full_pkg, timed_full, step_pkg, timed_step, args.repeats)


def _half_parity(
    expected: Sequence[torch.Tensor], actual: Sequence[torch.Tensor], dtype: str
) -> str:
    """Max abs difference of two half-precision runs next to the dtype's spacing at the
    largest output: different fusions round differently, so a few units of that spacing
    is agreement, not a tolerance to pass or fail."""
    from tzrec_acc.precision import DTYPES

    diff = max(float((e.double() - a.double()).abs().max()) for e, a in zip(expected, actual))
    top = torch.tensor(max(float(e.abs().max()) for e in expected), dtype=DTYPES[dtype])
    spacing = float(torch.nextafter(top, torch.tensor(float("inf"), dtype=top.dtype)) - top)
    return (
        f"max abs diff {diff:.3g}, largest |output| {float(top):.3g} "
        f"({dtype} spacing there {spacing:.3g})"
    )


def _graph_replay_line(
    full_pkg: Any,
    full_call: Tuple[Any, ...],
    step_pkg: Any,
    step_call: Tuple[Any, ...],
    repeats: int,
) -> str:
    """Comparison 2 with each package captured in a CUDA graph and replayed, as a server
    that keeps a graph per batch shape runs it (the launches' host time drops out)."""
    cuda = torch.device("cuda")
    try:
        # relaxed: the package runner queries its previous run's CUDA event at each run
        full_replay = cuda_graph_replay(lambda: full_pkg(*full_call), "relaxed")
        step_replay = cuda_graph_replay(lambda: step_pkg(*step_call), "relaxed")
        full_ms = median_ms(full_replay, cuda, min_calls=repeats)
        step_ms = median_ms(step_replay, cuda, min_calls=repeats)
    except RuntimeError as exc:
        return f"2b. CUDA graph replay of the packages: not possible ({exc})"
    return (
        f"2b. the same under CUDA graph replay: step {step_ms:.3f} ms vs full forward "
        f"{full_ms:.3f} ms ({full_ms / step_ms:.2f}x)"
    )


def _candidates(
    model: torch.nn.Module, users: int, new: int, query_time: torch.Tensor
) -> Dict[str, torch.Tensor]:
    """``new`` candidates for each of ``users`` users, shown at ``query_time``."""
    device = query_time.device
    return {
        "candidate.item_id": torch.randint(0, model.num_items, (users * new,), device=device),
        "candidate.sequence_length": torch.full((users,), new, device=device),
        "candidate_timestamp.sequence": query_time.repeat_interleave(new),
    }


def _auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    from torchmetrics.functional import auroc  # ~1 s to import: only when needed

    return float(auroc(scores.float(), labels.long(), task="binary"))


def _movielens(
    ratings: SequenceDataset, model: torch.nn.Module, users: int, new: int
) -> Tuple[Any, ...]:
    """A ranking batch of the first ``users`` users with more than ``new`` ratings: their
    last ``new`` ratings as candidates (labels: rating >= 4), earlier ones as history (one
    action bit per rating: rating r sets bit r - 1).

    Args:
        ratings: MovieLens-100K as :func:`tzrec_bench.data.load_dataset` gives it (users in
            the order of their ids, each user's ratings by time, dense item ids).
        model: the ranking model (its catalogue size and history bound).
        users: how many users.
        new: candidates per user.
    """
    offsets = ratings.offsets
    stars = ratings.ratings.astype(np.int64)
    parts: Dict[str, List[torch.Tensor]] = {}
    labels = []
    for row in range(ratings.num_users):
        start, end = int(offsets[row]), int(offsets[row + 1])
        if end - start <= new:
            continue
        hist = slice(max(start, end - new - model.max_uih_len), end - new)
        cand = slice(end - new, end)
        for key, value in (
            ("uih.item_id", ratings.item_ids[hist] % model.num_items),
            ("uih.sequence_length", np.array([hist.stop - hist.start])),
            ("uih_action.sequence", 1 << (stars[hist] - 1)),
            ("uih_timestamp.sequence", ratings.timestamps[hist]),
            ("candidate.item_id", ratings.item_ids[cand] % model.num_items),
            ("candidate.sequence_length", np.array([new])),
            ("candidate_timestamp.sequence", ratings.timestamps[cand]),
        ):
            parts.setdefault(key, []).append(torch.tensor(value, dtype=torch.int64))  # a copy
        labels.append(torch.from_numpy(stars[cand] >= 4))
        if len(labels) == users:
            break
    return ({k: torch.cat(v) for k, v in parts.items()},), torch.cat(labels)


def _quantized(args: argparse.Namespace, movielens: Optional[SequenceDataset]) -> List[str]:
    from tzrec_acc import gr, quant

    cpu = torch.device("cpu")
    reference = _model(argparse.Namespace(**{**vars(args), "backend": "pytorch"}), cpu)
    quantized = _model(argparse.Namespace(**{**vars(args), "backend": "pytorch"}), cpu)
    quant.quantize_dense(quant.quantize_embeddings(quantized, "int8"))
    if movielens is not None:
        batch, labels = _movielens(movielens, reference, args.batch, args.new)
        source = f"MovieLens-100K ({args.batch} users, labels: rating >= 4)"
    else:
        batch = gr.sample_inputs(reference, args.batch, args.history, args.new, seed=5)
        with torch.no_grad():
            logits = reference(*batch)[:, 0]
        labels = logits > logits.median()
        source = "synthetic (labels: the float model's logit above its median)"
    report = quant.compare(
        reference, quantized, [batch], lambda out, y: _auc(out[:, 0], y), [labels], args.repeats
    )
    return [
        f"3. int8 dense + int8 embeddings (CPU, eager), {source}: "
        f"{report['ms_float']:.3f} ms float vs {report['ms_quant']:.3f} ms int8 "
        f"({report['ms_float'] / report['ms_quant']:.2f}x); AUC {report['metric_float']:.4f} -> "
        f"{report['metric_quant']:.4f} (change {report['metric_change']:+.4f}); "
        f"max |logit diff| {report['max_abs_diff']:.3g}"
    ]


def _preload_and_restart(argv: Sequence[str]) -> None:
    """Re-run this script with the compiler's libstdc++ preloaded (once)."""
    env = preloaded_env()
    if os.environ.get(_PRELOADED) or env.get("LD_PRELOAD") == os.environ.get("LD_PRELOAD"):
        return
    env[_PRELOADED] = "1"
    os.execve(sys.executable, [sys.executable, "-m", "tzrec_bench.benchmarks.export", *argv], env)


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parser().parse_args(argv)
    for name in ("batch", "history", "new", "repeats"):
        if getattr(args, name) < 1:
            print(f"error: --{name} must be >= 1, got {getattr(args, name)}", file=sys.stderr)
            return 2
    _preload_and_restart(argv)
    movielens = None
    if args.movielens:
        try:  # before minutes of compiling
            movielens = load_dataset("ml-100k", args.movielens, args.cache_dir)
        except (FileNotFoundError, DataFormatError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    device = args.device
    model = _model(args, device)
    print(_versions(device))
    shape = (
        f"from {args.model}"  # its own sizes, not the --dim/--heads/--layers defaults
        if args.model
        else f"E={args.dim}, {args.heads} heads, {args.layers} layers"
    )
    print(
        f"HSTURanking {shape}, backend {args.backend}, {args.dtype}; B={args.batch}, "
        f"histories of {args.history} events (lengths in [0.9, 1] of it), {args.new} "
        f"candidates per user"
    )
    if args.workdir:
        os.makedirs(args.workdir, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        for line in _forward_and_step(args, model, device, args.workdir or tmp):
            print(line)
    if not args.skip_quant:
        for line in _quantized(args, movielens):
            print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
