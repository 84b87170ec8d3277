"""The ``ops`` command's outputs: the printed table, CSV rows and the PNG plot."""

from __future__ import annotations

import csv
import importlib.metadata
import importlib.util
from collections import defaultdict
from datetime import datetime, timezone
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import torch

from tzrec_bench.benchmarks.opbench.cases import SDPA
from tzrec_bench.benchmarks.opbench.sweep import Row
from tzrec_ops.extras import require

CSV_COLUMNS = (
    "timestamp", "device", "torch", "triton", "op", "provider", "mode", "dtype", "batch",
    "max_seq_len", "heads", "attn_dim", "hidden_dim", "embedding", "tokens", "value_checks",
    "ms", "tflops", "gbps", "peak_mib", "sm_clock_mhz", "max_temperature_c", "power_w",
    "error",
)


def device_name(device: torch.device) -> str:
    """The GPU's name, or ``cpu``."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def triton_version() -> str:
    """The installed triton's version (read without importing it), or "not installed" when
    it cannot be imported."""
    if importlib.util.find_spec("triton") is None:
        return "not installed"
    try:
        return importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def header_lines(device: torch.device, dtype_name: str, checks: str, rep_ms: float) -> List[str]:
    return [
        f"device: {device_name(device)}  torch {torch.__version__}  triton {triton_version()}",
        f"{dtype_name}; lengths U[0.9N, N), num_targets U[1, 20]; value checks {checks}; "
        f"median of {'triton.testing.do_bench' if device.type == 'cuda' else 'timed calls'} "
        f"over {rep_ms:g} ms; fwd under no_grad, bwd = autograd.grad of the outputs; peak = "
        "memory above the inputs",
    ]


class Table:
    """Fixed-width rows, printed as they are measured."""

    def __init__(self, gpu_state: bool) -> None:
        self.gpu_state = gpu_state

    def header(self) -> str:
        line = (f"{'op':<36} {'N':>6} {'tokens':>9} {'provider':<16} {'mode':<4} "
                f"{'ms':>10} {'throughput':>17} {'peak MiB':>9}")
        return line + (f" {'GPU while timed':>24}" if self.gpu_state else "")

    def line(self, row: Row) -> str:
        start = (f"{row.op:<36} {row.shape.max_seq_len:>6} {row.tokens:>9} {row.label:<16} "
                 f"{row.mode:<4}")
        if row.error is not None:
            return f"{start} {'n/a':>10}  {row.error}"
        if row.tflops is not None:
            rate = f"{row.tflops:.4g} TFLOP/s"
        else:
            rate = f"{row.gbps:.4g} GB/s"
        peak = "n/a" if row.peak_mib is None else f"{row.peak_mib:.0f}"
        line = f"{start} {row.ms:10.4f} {rate:>17} {peak:>9}"
        if self.gpu_state:
            line += f" {row.gpu_state.cell() if row.gpu_state else 'n/a':>24}"
        return line


def _cell(value: Optional[float]) -> str:
    return "" if value is None else f"{value:.6g}"


def append_csv(path: Path, rows: Sequence[Row], device: torch.device, dtype_name: str) -> None:
    """Appends one line per row (the header first when the file is new or empty)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    new = not path.exists() or path.stat().st_size == 0
    stamp = datetime.now(timezone.utc).isoformat(timespec="seconds")
    common = {"timestamp": stamp, "device": device_name(device), "torch": torch.__version__,
              "triton": triton_version(), "dtype": dtype_name}
    with path.open("a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_COLUMNS)
        if new:
            writer.writeheader()
        for row in rows:
            state = row.gpu_state
            writer.writerow({
                **common, **row.shape.describe(), "op": row.op, "provider": row.provider,
                "mode": row.mode, "tokens": row.tokens,
                "value_checks": "on" if row.value_checks else "off",
                "ms": "" if row.error else f"{row.ms:.6g}", "tflops": _cell(row.tflops),
                "gbps": _cell(row.gbps), "peak_mib": _cell(row.peak_mib),
                "sm_clock_mhz": _cell(state.sm_clock_mhz if state else None),
                "max_temperature_c": _cell(state.max_temperature_c if state else None),
                "power_w": _cell(state.power_w if state else None),
                "error": row.error or "",
            })


def require_matplotlib():  # type: ignore[no-untyped-def]
    """matplotlib, or an ImportError naming the extra to install."""
    return require("matplotlib", "tzrec-bench[plot]", "the ops plot (--plot)")


def plot(path: Path, rows: Sequence[Row], title: str) -> Path:
    """One panel per (op, mode): throughput against N, a line per provider (SDPA dashed)."""
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels: Dict[tuple, Dict[str, List[Row]]] = defaultdict(lambda: defaultdict(list))
    for row in rows:
        if row.error is None:
            panels[row.op, row.mode][row.label].append(row)
    if not panels:
        raise ValueError("no point was measured, so there is nothing to plot")
    modes = list(dict.fromkeys(mode for _, mode in panels))  # the sweep's order: fwd, bwd
    ops = list(dict.fromkeys(op for op, _ in panels))
    fig, axes = plt.subplots(len(ops), len(modes), squeeze=False,
                             figsize=(5.5 * len(modes), 3.2 * len(ops)))
    for i, op in enumerate(ops):
        for j, mode in enumerate(modes):
            ax = axes[i][j]
            lines = panels.get((op, mode), {})
            if not lines:
                ax.set_axis_off()
                continue
            for label, points in lines.items():
                xs = [p.shape.max_seq_len for p in points]
                ys = [p.tflops if p.tflops is not None else p.gbps for p in points]
                ax.plot(xs, ys, marker="o", label=label,
                        linestyle="--" if label.startswith(SDPA) else "-")
            unit = "TFLOP/s" if next(iter(lines.values()))[0].tflops is not None else "GB/s"
            ax.set(title=f"{op} {mode}", xlabel="N (max sequence length)", ylabel=unit)
            ax.set_xscale("log", base=2)
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize="small")
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
