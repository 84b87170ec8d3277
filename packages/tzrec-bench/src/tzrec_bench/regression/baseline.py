"""Baseline thresholds, and the verdict on one metric of one config.

A baseline file (TOML, or JSON with the same structure) holds, per config name and metric, the
expected value, a tolerance and which direction is better::

    [hstu-retrieval-synthetic."ndcg@10"]
    value = 0.25          # the mean expected
    tolerance = 0.02      # an absolute margin either side
    direction = "higher"  # "higher" (default) or "lower" is better

A metric's mean over the runs is *improved* when it beats ``value`` by more than
``tolerance``, *regressed* when it falls short by more, *unchanged* in between, and *failed*
when a run raised or did not report the metric (or reported NaN).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Optional, Sequence

from tzrec_bench.regression.configs import RunConfigError, read_table

IMPROVED, UNCHANGED, REGRESSED, FAILED = "improved", "unchanged", "regressed", "failed"
STATUSES = (IMPROVED, UNCHANGED, REGRESSED, FAILED)
DIRECTIONS = ("higher", "lower")


@dataclass(frozen=True)
class Threshold:
    """The expected ``value`` of a metric, ``tolerance`` either side, and the better side."""

    value: float
    tolerance: float
    direction: str = "higher"

    def verdict(self, mean: float) -> str:
        """improved, unchanged or regressed for a (finite) mean."""
        gain = mean - self.value if self.direction == "higher" else self.value - mean
        if gain > self.tolerance:
            return IMPROVED
        if gain < -self.tolerance:
            return REGRESSED
        return UNCHANGED


Baseline = Dict[str, Dict[str, Threshold]]  # config name -> metric -> threshold


def _number(path: Path, where: str, key: str, entry: dict, default: Optional[float]) -> float:
    value = entry.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise RunConfigError(f"{path}: {where}: {key} must be a finite number, got {value!r}")
    return float(value)


def load_baseline(path: Path) -> Baseline:
    """The thresholds in ``path``; raises :class:`RunConfigError` naming the bad entry."""
    baseline: Baseline = {}
    for config, metrics in read_table(path).items():
        if not isinstance(metrics, dict):
            raise RunConfigError(f"{path}: {config}: expected a table of metrics, got "
                                 f"{type(metrics).__name__}")
        baseline[config] = {}
        for metric, entry in metrics.items():
            where = f"{config}.{metric}"
            if not isinstance(entry, dict):
                raise RunConfigError(f"{path}: {where}: expected a table with value, "
                                     f"tolerance and direction, got {entry!r}")
            unknown = sorted(set(entry) - {"value", "tolerance", "direction"})
            if unknown:
                raise RunConfigError(f"{path}: {where}: unknown keys {', '.join(unknown)}")
            tolerance = _number(path, where, "tolerance", entry, 0.0)
            if tolerance < 0:
                raise RunConfigError(f"{path}: {where}: tolerance must be >= 0, got {tolerance}")
            direction = entry.get("direction", "higher")
            if direction not in DIRECTIONS:
                raise RunConfigError(f"{path}: {where}: direction must be higher or lower, "
                                     f"got {direction!r}")
            baseline[config][metric] = Threshold(
                _number(path, where, "value", entry, None), tolerance, direction)
    return baseline


def metric_status(values: Sequence[Optional[float]], runs: int,
                  threshold: Optional[Threshold]) -> Optional[str]:
    """The verdict on one metric: ``values`` holds what each successful run reported (None
    where it did not); ``runs`` is how many runs there were. None: no threshold and nothing
    failed, so nothing to judge."""
    reported = [v for v in values if v is not None and math.isfinite(v)]
    if len(reported) < runs:
        return FAILED
    if threshold is None:
        return None
    return threshold.verdict(sum(reported) / len(reported))
