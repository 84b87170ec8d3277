"""The sweep: every (length, op, provider, value-check setting, mode) point, in that order.

Inputs are built once per (length, op, provider) and shared by its modes and value-check
settings. A point that raises (out of memory, a backend refusing the shape) becomes a row with
its error and the sweep goes on, so one failure does not hide the rest.
"""

from __future__ import annotations

import gc
import math
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

import tzrec_ops
from tzrec_bench.benchmarks.opbench.cases import CASES, FORWARD_ONLY, SDPA, Case, Inputs, sdpa_case
from tzrec_bench.benchmarks.opbench.shapes import Shape, jagged_batch
from tzrec_bench.benchmarks.opbench.timing import measure
from tzrec_bench.gpu_state import GpuState


@dataclass(frozen=True)
class Plan:
    """What to time (the ``ops`` command's options, checked)."""

    ops: Sequence[str]
    #: per op, the providers in order: backend names, then ``sdpa`` for attention
    providers: Dict[str, List[str]]
    modes: Sequence[str]
    seq_lens: Sequence[int]
    dtype: torch.dtype
    device: torch.device
    batch: int
    heads: int
    attn_dim: int
    hidden_dim: int
    embedding: int
    value_checks: Sequence[bool] = (True,)
    rep_ms: float = 200.0
    seed: int = 1001
    #: provider -> the longest N it runs at (longer ones are skipped)
    max_seq_len: Dict[str, int] = field(default_factory=dict)

    def shape(self, n: int) -> Shape:
        return Shape(self.batch, n, self.heads, self.attn_dim, self.hidden_dim,
                     self.embedding, self.seed)

    def points(self) -> Iterator[Tuple[int, str, str]]:
        """``(N, op, provider)`` in sweep order, limits applied."""
        for n in self.seq_lens:
            for op in self.ops:
                for provider in self.providers[op]:
                    if n <= self.max_seq_len.get(provider, n):
                        yield n, op, provider

    def modes_of(self, op: str) -> List[str]:
        """The modes ``op`` is timed in (forward-only ops skip ``bwd``)."""
        return [m for m in self.modes if m == "fwd" or op not in FORWARD_ONLY]

    def size(self) -> int:
        """Timed measurements in the sweep (for the progress bar)."""
        return sum(len(self.modes_of(op)) for _, op, _ in self.points()) * len(
            self.value_checks)


@dataclass
class Row:
    """One measured (or failed) point."""

    op: str
    provider: str
    mode: str
    value_checks: bool
    shape: Shape
    tokens: int
    ms: float = math.nan
    tflops: Optional[float] = None  # compute-bound ops
    gbps: Optional[float] = None  # memory-bound ops
    peak_mib: Optional[float] = None  # None on the CPU
    gpu_state: Optional[GpuState] = None
    error: Optional[str] = None

    @property
    def label(self) -> str:
        """The provider, marked ``[off]`` when timed with the value checks off."""
        return self.provider if self.value_checks else f"{self.provider}[off]"


def one_line(exc: BaseException) -> str:
    """``Type: message`` on one line, at most 200 characters of message."""
    return f"{type(exc).__name__}: {' '.join(str(exc).split())[:200]}"


def _build(op: str, provider: str, inputs: Inputs) -> Case:
    return sdpa_case(inputs) if provider == SDPA else CASES[op](inputs, provider)


def run(plan: Plan, on_row: Callable[[Row], None],
        sample: Callable[[float, float], Optional[GpuState]] = lambda start, end: None,
        ) -> List[Row]:
    """Times every point of ``plan``; ``on_row`` sees each row as it is measured and
    ``sample`` gives the GPU's state over a timed window."""
    rows: List[Row] = []
    try:
        for n, op, provider in plan.points():
            shape = plan.shape(n)
            batch = jagged_batch(shape)
            try:
                case: Optional[Case] = _build(
                    op, provider, Inputs(shape, batch, plan.dtype, plan.device))
                setup_error = None
            except Exception as exc:  # a bad shape for this op: report, go on
                case, setup_error = None, one_line(exc)
            for checked in plan.value_checks:
                tzrec_ops.set_value_checks(checked)
                for mode in plan.modes_of(op):
                    row = Row(op, provider, mode, checked, shape, batch.tokens)
                    if case is None:
                        row.error = setup_error
                    else:
                        _fill(row, case, plan, sample)
                    rows.append(row)
                    on_row(row)
            del case
            gc.collect()
            if plan.device.type == "cuda":
                torch.cuda.empty_cache()
    finally:
        tzrec_ops.set_value_checks(None)
    return rows


def _fill(row: Row, case: Case, plan: Plan,
          sample: Callable[[float, float], Optional[GpuState]]) -> None:
    try:
        m = measure(case, row.mode, plan.device, plan.rep_ms)
    except Exception as exc:  # out of memory, a backend refusing the call: report, go on
        row.error = one_line(exc)
        return
    row.ms, row.peak_mib = m.ms, m.peak_mib
    if case.flops is not None:
        row.tflops = case.flops(row.mode) / m.ms / 1e9
    else:
        row.gbps = m.traffic_bytes / m.ms / 1e6
    row.gpu_state = sample(*m.window)
