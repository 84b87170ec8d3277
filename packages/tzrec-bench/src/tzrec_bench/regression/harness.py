"""Run each config ``repeats`` times (seeds ``seed``, ``seed + 1``, ...), average its test
metrics and judge them against the baseline.

The trainer is a function of a :class:`~tzrec_bench.train.config.TrainConfig` returning the
test metrics (:func:`train_and_test`, the ``tzrec-bench train`` loop, by default), so tests
can stand a fast one in. A run that raises is recorded with its error, and every metric of
its config is then *failed*; the other runs still go ahead.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Mapping, Optional, Sequence

from tzrec_bench.regression.baseline import (
    FAILED,
    REGRESSED,
    STATUSES,
    Baseline,
    Threshold,
    metric_status,
)
from tzrec_bench.regression.configs import RunConfig, data_dir, missing_data
from tzrec_bench.train.config import TrainConfig

Trainer = Callable[[TrainConfig], Mapping[str, float]]


def train_and_test(config: TrainConfig) -> Mapping[str, float]:
    """Trains with ``tzrec-bench train``'s loop; the test metrics of the best weights."""
    from tzrec_bench.train.loop import train

    return train(config).test


@dataclass
class MetricResult:
    values: List[Optional[float]]  # per successful run; None where missing or not finite
    mean: Optional[float]
    std: Optional[float]  # sample standard deviation (0 for one run)
    threshold: Optional[Threshold]
    status: Optional[str]  # improved / unchanged / regressed / failed; None: not judged


@dataclass
class ConfigResult:
    name: str
    path: str
    description: str
    seeds: List[int] = field(default_factory=list)
    skipped: Optional[str] = None  # why it did not run (its data is absent)
    errors: List[str] = field(default_factory=list)  # one line per run that raised
    metrics: Dict[str, MetricResult] = field(default_factory=dict)


def _summarize(values: List[Optional[float]], runs: int,
               threshold: Optional[Threshold]) -> MetricResult:
    status = metric_status(values, runs, threshold)
    values = [v if v is not None and math.isfinite(v) else None for v in values]
    finite = [v for v in values if v is not None]
    mean = statistics.fmean(finite) if finite else None
    std = statistics.stdev(finite) if len(finite) > 1 else (0.0 if finite else None)
    return MetricResult(values, mean, std, threshold, status)


def run_config(config: RunConfig, repeats: int, thresholds: Mapping[str, Threshold],
               trainer: Trainer, work_dir: Path, data_root: Optional[str] = None
               ) -> ConfigResult:
    """``repeats`` runs of ``config``, their metrics judged against ``thresholds``."""
    result = ConfigResult(config.name, str(config.path), config.description)
    reason = missing_data(config, data_root)
    if reason is not None:
        result.skipped = reason
        return result
    folder = data_dir(config, data_root)
    runs: List[Mapping[str, float]] = []
    for repeat in range(repeats):
        train_config = config.train_config(
            repeat, out_dir=str(work_dir / config.name / f"repeat{repeat}"), plot=False,
            progress=False, **({"data_dir": str(folder)} if folder is not None else {}))
        result.seeds.append(train_config.seed)
        try:
            runs.append(dict(trainer(train_config)))
        except Exception as exc:  # a failed run is a verdict, not the end of the harness
            result.errors.append(f"seed {train_config.seed}: {type(exc).__name__}: "
                                 f"{' '.join(str(exc).split())[:300]}")
    names = list(dict.fromkeys([m for run in runs for m in run] + list(thresholds)))
    for name in names:
        values = [run.get(name) for run in runs]
        result.metrics[name] = _summarize(values, repeats, thresholds.get(name))
    return result


def run_configs(configs: Sequence[RunConfig], repeats: int, baseline: Baseline,
                trainer: Trainer = train_and_test, work_dir: Path = Path("."),
                data_root: Optional[str] = None) -> List[ConfigResult]:
    return [run_config(c, repeats, baseline.get(c.name, {}), trainer, work_dir, data_root)
            for c in configs]


def counts(results: Sequence[ConfigResult]) -> Dict[str, int]:
    """How many metrics got each verdict, and how many configs were skipped."""
    tally = {status: 0 for status in STATUSES}
    for r in results:
        for m in r.metrics.values():
            if m.status is not None:
                tally[m.status] += 1
    tally["skipped configs"] = sum(r.skipped is not None for r in results)
    return tally


def exit_code(results: Sequence[ConfigResult]) -> int:
    """1 when a metric regressed or failed, else 0."""
    tally = counts(results)
    return 1 if tally[REGRESSED] or tally[FAILED] else 0


def _fmt(value: Optional[float]) -> str:
    return "n/a" if value is None or not math.isfinite(value) else f"{value:.4f}"


def summary_table(results: Sequence[ConfigResult]) -> str:
    """One line per (config, metric): mean ± std over the runs, the baseline and verdict."""
    lines = [f"{'config':<28} {'metric':<12} {'mean ± std':>20} {'baseline':>25} verdict"]
    for r in results:
        if r.skipped is not None:
            lines.append(f"{r.name:<28} skipped: {r.skipped}")
            continue
        for error in r.errors:
            lines.append(f"{r.name:<28} run failed: {error}")
        for name, m in r.metrics.items():
            spread = f"{_fmt(m.mean)} ± {_fmt(m.std)}"
            t = m.threshold
            base = "-" if t is None else (
                f"{t.value:.4f} ± {t.tolerance:.4f} {t.direction}")
            lines.append(f"{r.name:<28} {name:<12} {spread:>20} {base:>25} {m.status or '-'}")
    tally = counts(results)
    lines.append(", ".join(f"{n} {status}" for status, n in tally.items()))
    return "\n".join(lines)


def summary_json(results: Sequence[ConfigResult], repeats: int) -> Dict[str, object]:
    return {
        "repeats": repeats,
        "counts": counts(results),
        "exit_code": exit_code(results),
        "configs": [asdict(r) for r in results],
    }
