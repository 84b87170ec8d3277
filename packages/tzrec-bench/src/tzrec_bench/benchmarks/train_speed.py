"""``tzrec-bench train-speed``: training throughput of run configs side by side, in one process.

    tzrec-bench train-speed sasrec-amazon-games hstu-retrieval-amazon-games \\
        --set embedding_dim=64 --modes eager,compile --data-root ../shared/data

Each (config, mode) pair gets the trainer of ``tzrec-bench train`` (same data, task, model,
optimizer, autocast and batches), which first takes ``--warmup`` steps (Triton compiles and
autotuning, ``torch.compile``'s first graphs, the allocator). The pairs are then timed in
``--rounds`` rounds of ``--steps`` steps each, one pair after the other within a round, so
that drift of the GPU's clocks falls on every pair alike; each round ends with a device
synchronize, so the time is the device's, not the host's queue. The table shows the median
round, and the seconds of the first step and of all warm-up steps (what compiling costs).
``--profile DIR`` also writes a ``torch.profiler`` table and trace per pair.

Under ``torchrun --nproc-per-node N -m tzrec_bench train-speed ...`` every process trains
its share of each global batch (as ``tzrec-bench train`` does) and rank 0 prints the
global batch's tokens/s.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from tzrec_bench.benchmarks.opbench.report import device_name, triton_version
from tzrec_bench.regression.configs import RunConfigError, data_dir, load_config, missing_data
from tzrec_bench.train.config import TrainConfig
from tzrec_bench.train.distributed import DistContext, close, init_distributed
from tzrec_bench.train.loop import Trainer
from tzrec_bench.train.strategies import Replicated

#: each mode's (compile, cuda_graphs) settings: graph captures the step in CUDA graphs
#: (train/graphed_step.py), compile+graph captures the compiled step
MODES = {
    "eager": (False, "off"),
    "compile": (True, "off"),
    "graph": (False, "on"),
    "compile+graph": (True, "on"),
}


@dataclasses.dataclass
class Pair:
    """One config in one mode and its timings."""

    name: str
    mode: str
    first_step_s: float = 0.0
    warmup_s: float = 0.0
    rounds: List[Dict[str, float]] = dataclasses.field(default_factory=list)

    def median(self, key: str) -> float:
        return statistics.median(r[key] for r in self.rounds)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _steps(trainer: Trainer, count: int) -> Dict[str, float]:
    """Runs ``count`` training steps; returns their seconds, tokens and samples."""
    device = trainer.ctx.device
    tokens = samples = 0
    _sync(device)
    started = time.perf_counter()
    for _ in range(count):
        rows = trainer.global_rows(trainer.step)
        trainer.train_step(rows)
        tokens += trainer.task.tokens(rows, trainer.step)
        samples += len(rows)
        trainer.step += 1
    _sync(device)
    return {"seconds": time.perf_counter() - started, "tokens": tokens, "samples": samples,
            "steps": count}


def _profile(pair: Pair, trainer: Trainer, steps: int, folder: Path) -> None:
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if trainer.ctx.device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
        _steps(trainer, steps)
    ctx = trainer.ctx
    stem = folder / f"{pair.name}-{pair.mode}{f'-rank{ctx.rank}' if ctx.distributed else ''}"
    sort = "self_cuda_time_total" if len(activities) > 1 else "self_cpu_time_total"
    table = prof.key_averages().table(sort_by=sort, row_limit=40)
    cpu_table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
    stem.with_suffix(".txt").write_text(
        f"{pair.name} {pair.mode}: {steps} steps\n\n{table}\n\nby host time\n\n{cpu_table}\n"
    )
    prof.export_chrome_trace(str(stem.with_suffix(".json")))


def _time_pairs(
    configs: Dict[str, TrainConfig],
    modes: Sequence[str],
    steps: int,
    warmup: int,
    rounds: int,
    profile_dir: Optional[Path],
    ctx: DistContext,
    work: Path,
) -> List[Pair]:
    pairs: List[Pair] = []
    trainers: List[Trainer] = []
    trainer: Optional[Trainer] = None
    try:
        for name, config in configs.items():
            for mode in modes:
                compiled, graphs = MODES[mode]
                run = dataclasses.replace(
                    config, compile=compiled, cuda_graphs=graphs,
                    out_dir=str(work / f"{name}-{mode}"), progress=False, plot=False,
                )
                pair, trainer = Pair(name, mode), Trainer(run, ctx, Replicated)
                pair.first_step_s = _steps(trainer, 1)["seconds"]
                pair.warmup_s = pair.first_step_s + _steps(trainer, max(warmup - 1, 0))["seconds"]
                pairs.append(pair)
                trainers.append(trainer)
        for _ in range(rounds):
            for pair, trainer in zip(pairs, trainers):
                pair.rounds.append(_steps(trainer, steps))
        if profile_dir is not None:
            profile_dir.mkdir(parents=True, exist_ok=True)
            for pair, trainer in zip(pairs, trainers):
                _profile(pair, trainer, min(steps, 20), profile_dir)
        return pairs
    finally:
        # every reference to a trainer goes here, the loop's too (an error's traceback keeps
        # this frame): a captured step's graphs hold NCCL's communicator (their all-reduce),
        # and leaving the group while they live hangs in destroy_process_group
        trainers.clear()
        trainer = None


def measure(
    configs: Dict[str, TrainConfig],
    modes: Sequence[str],
    steps: int,
    warmup: int,
    rounds: int,
    profile_dir: Optional[Path] = None,
) -> Tuple[List[Pair], DistContext]:
    """Times every config in every mode (see the module docstring); returns the timings and
    the process's context (which has left its process group)."""
    ctx = init_distributed(next(iter(configs.values())).device)
    try:
        with tempfile.TemporaryDirectory(prefix="train-speed-") as work:
            pairs = _time_pairs(configs, modes, steps, warmup, rounds, profile_dir, ctx,
                                Path(work))
        return pairs, ctx
    finally:
        close(ctx)


def table(pairs: Sequence[Pair]) -> str:
    """The figures, one line per pair, with each config's ratio of every mode to eager and each
    pair's ratio to the first config in the same mode."""
    rate = {(p.name, p.mode): p.median("tokens") / p.median("seconds") for p in pairs}
    first = pairs[0].name
    lines = [f"{'config':34s} {'mode':13s} {'tokens/s':>10s} {'samples/s':>10s} "
             f"{'ms/step':>8s} {'first step s':>12s} {'warm-up s':>9s} "
             f"{'vs ' + first[:20]:>24s}"]
    for p in pairs:
        seconds = p.median("seconds")
        step_ms = 1e3 * seconds / p.rounds[0]["steps"]
        versus = rate[(p.name, p.mode)] / rate.get((first, p.mode), float("nan"))
        lines.append(
            f"{p.name:34s} {p.mode:13s} {rate[(p.name, p.mode)]:10.0f} "
            f"{p.median('samples') / seconds:10.0f} {step_ms:8.2f} {p.first_step_s:12.1f} "
            f"{p.warmup_s:9.1f} {versus:24.2f}x"
        )
    for name in dict.fromkeys(p.name for p in pairs):
        for mode in MODES:
            if mode != "eager" and (name, "eager") in rate and (name, mode) in rate:
                speedup = rate[(name, mode)] / rate[(name, "eager")]
                lines.append(f"{name}: {mode} / eager {speedup:.2f}x")
    return "\n".join(lines)


def add_parser(subparsers: argparse._SubParsersAction,
               formatter: type = argparse.HelpFormatter) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "train-speed",
        help="training tokens/s of run configs side by side (eager, compiled, captured)",
        description=__doc__.split("\n\n", 2)[2],
        formatter_class=formatter,
    )
    p.add_argument("configs", nargs="+", metavar="CONFIG",
                   help="a shipped config's name or a config file (TOML)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a setting of every config (a TrainConfig field, e.g. "
                   "embedding_dim=64); repeatable")
    p.add_argument("--modes", default="eager,compile", metavar="MODE,...",
                   help=f"comma-separated, of {', '.join(MODES)}")
    p.add_argument("--steps", type=int, default=100, metavar="N", help="steps per round")
    p.add_argument("--rounds", type=int, default=3, metavar="N", help="timed rounds")
    p.add_argument("--warmup", type=int, default=30, metavar="N",
                   help="untimed steps first (compiles, autotuning)")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    p.add_argument("--data-root", metavar="PATH",
                   help="folder holding the data sets' folders (default $TZREC_BENCH_DATA)")
    p.add_argument("--profile", metavar="DIR",
                   help="also write a torch.profiler table and trace of 20 steps per pair")
    return p


def _override(text: str) -> tuple:
    key, sep, value = text.partition("=")
    fields = {f.name: f for f in dataclasses.fields(TrainConfig)}
    if not sep or key not in fields:
        raise RunConfigError(f"--set {text!r}: expected KEY=VALUE with KEY a TrainConfig "
                             f"field ({', '.join(fields)})")
    kind = type(getattr(TrainConfig(), key))
    try:
        parsed: Any = (value.lower() in ("1", "true", "yes")) if kind is bool else kind(value)
    except ValueError:
        raise RunConfigError(f"--set {text!r}: {key} expects {kind.__name__} values") from None
    return key, parsed


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    modes = [m for m in args.modes.split(",") if m]
    if not modes or set(modes) - set(MODES):
        parser.error(f"--modes {args.modes!r}: expected a comma-separated list of "
                     f"{', '.join(MODES)}")
    for name in ("steps", "rounds"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.warmup < 0:
        parser.error(f"--warmup must be >= 0, got {args.warmup}")
    try:
        overrides = dict(_override(text) for text in args.set)
        configs: Dict[str, TrainConfig] = {}
        for name in args.configs:
            config = load_config(name)
            missing = missing_data(config, args.data_root)
            if missing:
                raise RunConfigError(f"{config.name}: {missing}")
            folder = data_dir(config, args.data_root)
            configs[config.name] = config.train_config(
                **overrides, device=args.device,
                **({"data_dir": str(folder)} if folder else {}))
    except RunConfigError as exc:
        parser.error(str(exc))
    pairs, ctx = measure(configs, modes, args.steps, args.warmup, args.rounds,
                         Path(args.profile) if args.profile else None)
    if not ctx.is_main:
        return 0
    processes = f", {ctx.world_size} processes" if ctx.distributed else ""
    print(f"train-speed on {device_name(ctx.device)}{processes} (torch {torch.__version__}, triton "
          f"{triton_version()}): median of {args.rounds} rounds of "
          f"{args.steps} steps after {args.warmup} warm-up steps"
          + (f"; overrides {', '.join(args.set)}" if args.set else ""))
    print(table(pairs))
    return 0
