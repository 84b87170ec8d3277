"""``tzrec-bench ops``: its options, their checks (exit 2 with one line) and the run.

    tzrec-bench ops --op hstu_mha --backends pytorch,triton,triton_tma --mode fwd,bwd \\
        --dtype bf16 --seq-lens 256,512,1024,2048,4096 --batch 512 --heads 4 --dim 128
    tzrec-bench ops --op all --backends pytorch --device cpu --dtype fp32 --seq-lens 32 \\
        --batch 2 --dim 16 --embedding 32 --plot ops.png
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from tqdm import tqdm

from tzrec_bench.benchmarks.opbench import report
from tzrec_bench.benchmarks.opbench.cases import ATTENTION_OPS, CASES, FORWARD_ONLY, SDPA
from tzrec_bench.benchmarks.opbench.sweep import Plan, Row, run
from tzrec_bench.benchmarks.opbench.triton_configs import chosen_configs
from tzrec_bench.gpu_state import GpuStateSampler, device_id
from tzrec_ops.devices import DeviceError, resolve_device
from tzrec_ops.registry import BackendError, backends, get_backend

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
MODES = ("fwd", "bwd")
VALUE_CHECKS = {"on": (True,), "off": (False,), "both": (True, False)}
DEFAULT_CSV = "tzrec-bench-runs/ops.csv"


class UsageError(ValueError):
    """A bad option: the message names it; the command exits 2."""


def add_parser(subparsers: argparse._SubParsersAction,
               formatter: type = argparse.HelpFormatter) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "ops",
        help="time tzrec-ops ops per backend: table, CSV rows, optional PNG plot",
        description=(
            "Time public tzrec-ops ops on named backends (any backend the registry lists, "
            "plugins included), forward and backward, over a sweep of sequence lengths, with "
            "the settings a user gets (value checks on, index tensors moved with "
            "tzrec_ops.to_device). Attention FLOPs follow architecture §6 (TFLOP/s); GEMM ops "
            "report TFLOP/s and the others GB/s of the tensors they read and write at the "
            "least. Peak memory is on CUDA only. The attention op gets torch's "
            "scaled_dot_product_attention (flash on CUDA, causal, a dense batch of the same "
            "token count) as the reference line 'sdpa'."
        ),
        epilog=(
            "examples:\n"
            "  tzrec-bench ops --op hstu_mha --backends pytorch,triton,triton_tma\n"
            "  tzrec-bench ops --op all --backends pytorch --device cpu --dtype fp32 "
            "--seq-lens 32 --batch 2 --dim 16 --embedding 32\n"
            f"ops: {', '.join(CASES)}"
        ),
        formatter_class=formatter,
    )
    g = p.add_argument_group("what to time")
    g.add_argument("--op", required=True, metavar="NAMES",
                   help="comma-separated op names, or 'all' (the list is below)")
    g.add_argument("--backends", metavar="NAMES",
                   help="comma-separated backend names (default: every available backend)")
    g.add_argument("--mode", default="fwd,bwd", metavar="MODES",
                   help="comma-separated subset of fwd, bwd")
    g.add_argument("--dtype", default="bf16", help=f"input dtype: {', '.join(DTYPES)}")
    g.add_argument("--device", default="auto",
                   help="auto (CUDA when available, else the CPU), cpu or cuda")
    g.add_argument("--value-checks", default="on",
                   help="the ops' value checks while timing: on (as users run them), off, or "
                   "both (every point twice, [off] marks checks off)")
    g.add_argument("--no-reference", dest="reference", action="store_false",
                   help=f"leave out the {SDPA} reference line of the attention op")
    g.add_argument("--backend-max-seq-len", metavar="NAME=N,...",
                   help="skip a provider above a length, e.g. pytorch=1024 (the reference "
                   "attention is slow and large at long N)")

    g = p.add_argument_group("shapes (an STU layer's batch)")
    g.add_argument("--seq-lens", default="256,512,1024,2048,4096", metavar="N,...",
                   help="max sequence lengths N; lengths are uniform in [0.9N, N)")
    g.add_argument("--batch", type=int, default=512, metavar="B", help="sequences")
    g.add_argument("--heads", type=int, default=4, metavar="H", help="attention heads")
    g.add_argument("--dim", type=int, default=128, metavar="A",
                   help="query/key dim per head (and value dim unless --hidden-dim)")
    g.add_argument("--hidden-dim", type=int, metavar="V",
                   help="value dim per head (default: --dim)")
    g.add_argument("--embedding", type=int, default=512, metavar="E",
                   help="token embedding width (the non-attention ops)")
    g.add_argument("--seed", type=int, default=1001, help="seed of lengths and inputs")

    g = p.add_argument_group("timing and outputs")
    g.add_argument("--rep", type=float, default=200.0, metavar="MS",
                   help="time each point for about MS milliseconds (architecture §6: >= 200)")
    g.add_argument("--csv", default=DEFAULT_CSV, metavar="PATH",
                   help="CSV file the rows are appended to (created, with a header, if new; a "
                   "relative path is under the current folder); its path is printed before "
                   "the sweep and with the number of rows after it")
    g.add_argument("--no-csv", dest="write_csv", action="store_false", help="write no CSV")
    g.add_argument("--plot", metavar="PATH",
                   help="also draw a PNG (needs matplotlib: pip install 'tzrec-bench[plot]')")
    g.add_argument("--show-configs", action="store_true",
                   help="after each triton attention point, the tile configs the autotuner chose")
    g.add_argument("--no-progress", dest="progress", action="store_false",
                   help="no progress bar")
    return p


def _names(text: str, option: str) -> List[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise UsageError(f"{option}: expected comma-separated names, got {text!r}")
    return names


def _positive(name: str, value: Optional[int], least: int = 1) -> None:
    if value is not None and value < least:
        raise UsageError(f"{name}: must be >= {least}, got {value}")


def _choice(option: str, value: str, choices: Sequence[str]) -> str:
    if value not in choices:
        raise UsageError(f"{option}: unknown value {value!r}; expected one of "
                         f"{', '.join(choices)}")
    return value


def _device(name: str) -> torch.device:
    _choice("--device", name, ("auto", "cpu", "cuda"))
    try:
        return resolve_device(name)
    except DeviceError as exc:
        raise UsageError(f"--device {exc}") from None


def _backends(text: Optional[str]) -> List[str]:
    """The backends to time: named ones (each registered and available), or every available."""
    if text is None:
        return [b.name for b in backends() if b.unavailable_reason() is None]
    names = _names(text, "--backends")
    for name in names:
        if name == SDPA:
            continue
        try:
            backend = get_backend(name)
        except BackendError as exc:
            raise UsageError(f"--backends {name}: {' '.join(str(exc).split())}") from None
        reason = backend.unavailable_reason()
        if reason is not None:
            raise UsageError(f"--backends {name}: unavailable on this machine: {reason}")
    return names


def _limits(text: str) -> Dict[str, int]:
    limits = {}
    for item in filter(None, (t.strip() for t in text.split(","))):
        name, _, value = item.partition("=")
        if not value.isdigit():
            raise UsageError(f"--backend-max-seq-len: expected NAME=N, got {item!r}")
        limits[name] = int(value)
    return limits


def make_plan(args: argparse.Namespace) -> Tuple[Plan, List[str]]:
    """The checked :class:`Plan`, and notes on skipped (op, backend) pairs."""
    for name in ("batch", "heads", "dim", "hidden_dim", "embedding"):
        _positive(f"--{name.replace('_', '-')}", getattr(args, name))
    _positive("--seed", args.seed, 0)
    _choice("--dtype", args.dtype, list(DTYPES))
    _choice("--value-checks", args.value_checks, list(VALUE_CHECKS))
    if not args.rep > 0:
        raise UsageError(f"--rep: must be > 0 ms, got {args.rep}")
    modes = _names(args.mode, "--mode")
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        raise UsageError(f"--mode: unknown mode {unknown[0]!r}; expected a subset of "
                         f"{', '.join(MODES)}")
    try:
        seq_lens = [int(n) for n in _names(args.seq_lens, "--seq-lens")]
    except ValueError:
        raise UsageError(f"--seq-lens: expected comma-separated integers, got "
                         f"{args.seq_lens!r}") from None
    for n in seq_lens:
        _positive("--seq-lens", n, 2)
    device = _device(args.device)
    names = _backends(args.backends)
    backend_names = [n for n in names if n != SDPA]
    requested = _names(args.op, "--op")
    if requested == ["all"]:
        ops = list(CASES)
    else:
        ops = requested
        for op in ops:
            if op not in CASES:
                raise UsageError(f"--op: unknown op {op!r}; expected 'all' or one of "
                                 f"{', '.join(CASES)}")
    providers: Dict[str, List[str]] = {}
    notes = []
    for op in ops:
        implemented = [b for b in backend_names if op in get_backend(b).ops]
        notes += [f"skipped: backend {b} does not implement {op}"
                  for b in backend_names if b not in implemented]
        if op in ATTENTION_OPS and (args.reference or SDPA in names):
            implemented.append(SDPA)
        if implemented:
            providers[op] = implemented
            if op in FORWARD_ONLY and "bwd" in modes:
                notes.append(f"skipped: {op} bwd ({op} has no backward)")
    if not providers:
        raise UsageError(f"--backends: none of {', '.join(names)} implements "
                         f"{', '.join(ops)}")
    plan = Plan(
        ops=[op for op in ops if op in providers], providers=providers, modes=modes,
        seq_lens=seq_lens, dtype=DTYPES[args.dtype], device=device, batch=args.batch,
        heads=args.heads, attn_dim=args.dim, hidden_dim=args.hidden_dim or args.dim,
        embedding=args.embedding, value_checks=VALUE_CHECKS[args.value_checks],
        rep_ms=args.rep, seed=args.seed, max_seq_len=_limits(args.backend_max_seq_len or ""),
    )
    return plan, notes


def _csv_where(path: Path) -> str:
    """``path`` as given, with the folder a relative one is under."""
    return str(path) if path.is_absolute() else f"{path} (under {Path.cwd()})"


def run_command(args: argparse.Namespace) -> int:
    """Runs the checked sweep; 0 when every point was measured, 1 when one failed."""
    plan, notes = make_plan(args)
    if args.plot:
        try:
            report.require_matplotlib()
        except ImportError as exc:
            raise UsageError(f"--plot: {exc}") from None
    for line in report.header_lines(plan.device, args.dtype, args.value_checks, plan.rep_ms):
        print(line)
    print(f"B={plan.batch} H={plan.heads} A={plan.attn_dim} V={plan.hidden_dim} "
          f"E={plan.embedding}")
    for note in notes:
        print(note)
    csv_path = Path(args.csv)
    if args.write_csv:
        print(f"csv: rows will be appended to {_csv_where(csv_path)}")
    table = report.Table(gpu_state=plan.device.type == "cuda")
    print(table.header(), flush=True)
    # a log file (not a terminal) gets a redraw every 10 s, not a line per point
    bar = tqdm(total=plan.size(), unit="point", disable=not args.progress, file=sys.stderr,
               leave=False, mininterval=0.5 if sys.stderr.isatty() else 10.0)

    def on_row(row: Row) -> None:
        bar.write(table.line(row), file=sys.stdout)
        if args.show_configs and row.provider.startswith("triton") and row.op == "hstu_mha":
            bar.write(f"{'':>12}configs: {chosen_configs()}", file=sys.stdout)
        bar.update(1)

    if plan.device.type == "cuda":
        index = plan.device.index if plan.device.index is not None else (
            torch.cuda.current_device())
        with GpuStateSampler(device_id(index)) as sampler:
            rows = run(plan, on_row, sampler.window)
    else:
        rows = run(plan, on_row)
    bar.close()
    if args.write_csv:
        new = not csv_path.exists() or csv_path.stat().st_size == 0
        report.append_csv(csv_path, rows, plan.device, args.dtype)
        counted = f"{len(rows)} row{'' if len(rows) == 1 else 's'}"
        print(f"csv: {counted} appended to {_csv_where(csv_path)}"
              + (" (a new file)" if new else ""))
    failed = [r for r in rows if r.error is not None]
    if args.plot and len(failed) < len(rows):
        path = report.plot(Path(args.plot), rows,
                           f"{report.device_name(plan.device)}, {args.dtype}")
        print(f"plot: {path}")
    if failed:
        print(f"{len(failed)} of {len(rows)} points failed (the error is on each row)")
    return 1 if failed else 0
