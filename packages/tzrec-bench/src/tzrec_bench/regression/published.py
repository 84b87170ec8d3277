"""Published results beside our runs: papers' rows on a named data set, under its protocol.

``regression/published/<data set>.toml`` (shipped in the package, never read from the data's
folder at run time) holds ``source`` and ``protocol`` in words, ``[kinds]`` (what each kind
of row is: ``reported``, ``calculated``) and ``[[rows]]``, each with a ``name``, a ``kind``
and metrics by the trainer's names::

    [[rows]]
    name = "SASRec+SS"
    kind = "calculated"
    "hr@10" = 0.0921
    "ndcg@10" = 0.0531

``run-configs`` shows a data set's rows under each config run on it, marked as published,
when the config's runs follow the published protocol (:func:`protocol_gap`), and says why
not otherwise. They are never judged: no verdict, no exit status, no floor.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Tuple

from tzrec_bench.regression.configs import RunConfigError, read_table
from tzrec_bench.train.config import TrainConfig


@dataclass
class PublishedRow:
    name: str
    kind: str
    metrics: Dict[str, float]


@dataclass
class Published:
    """A data set's published rows, as shown beside one config's runs: ``shown`` False (with
    ``reason``) when the runs do not follow the published protocol; ``caveat`` what the
    config uses that the rows do not (item attributes)."""

    data: str
    source: str
    protocol: str
    kinds: Dict[str, str]
    rows: List[PublishedRow] = field(default_factory=list)
    shown: bool = True
    reason: Optional[str] = None
    caveat: Optional[str] = None


def published_dir() -> Path:
    """The folder of the shipped published rows, one TOML file per data set."""
    return Path(str(resources.files("tzrec_bench") / "regression" / "published"))


def _text(path: Path, where: str, entry: Mapping[str, Any], key: str) -> str:
    value = entry.get(key)
    if not isinstance(value, str) or not value:
        raise RunConfigError(f"{path}: {where}{key} must be a non-empty string, got {value!r}")
    return value


def load_published(path: Path) -> Published:
    """The rows of ``path``; raises :class:`RunConfigError` naming the bad entry."""
    table = read_table(path)
    unknown = sorted(set(table) - {"source", "protocol", "kinds", "rows"})
    if unknown:
        raise RunConfigError(f"{path}: unknown keys {', '.join(unknown)}")
    kinds = table.get("kinds")
    if not isinstance(kinds, dict) or not kinds or not all(
            isinstance(v, str) and v for v in kinds.values()):
        raise RunConfigError(f"{path}: [kinds] must map each kind of row to its meaning")
    entries = table.get("rows")
    if not isinstance(entries, list) or not entries:
        raise RunConfigError(f"{path}: expected [[rows]] tables, got {entries!r}")
    rows = []
    for number, entry in enumerate(entries, start=1):
        where = f"row {number}: "
        if not isinstance(entry, dict):
            raise RunConfigError(f"{path}: {where}expected a table, got {entry!r}")
        name, kind = _text(path, where, entry, "name"), _text(path, where, entry, "kind")
        if kind not in kinds:
            raise RunConfigError(f"{path}: {where}kind {kind!r} is not one of [kinds] "
                                 f"({', '.join(kinds)})")
        metrics = {k: v for k, v in entry.items() if k not in ("name", "kind")}
        for metric, value in metrics.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
                    math.isfinite(value)):
                raise RunConfigError(f"{path}: {where}{metric} must be a finite number, "
                                     f"got {value!r}")
        if not metrics:
            raise RunConfigError(f"{path}: {where}no metrics")
        rows.append(PublishedRow(name, kind, {k: float(v) for k, v in metrics.items()}))
    return Published(path.stem, _text(path, "", table, "source"),
                     _text(path, "", table, "protocol"), dict(kinds), rows)


def protocol_gap(settings: Mapping[str, Any]) -> Optional[str]:
    """Why runs with these ``[train]`` settings do not follow the published protocol
    (leave-one-out, which every run uses; full ranking with the user's earlier items
    excluded; every user evaluated; the data as published), or None when they do."""
    gaps = []
    if not settings.get("exclude_seen", TrainConfig.exclude_seen):
        gaps.append("exclude_seen is false (the published rows exclude the user's earlier "
                    "items from the ranking)")
    if settings.get("min_events", TrainConfig.min_events):
        gaps.append(f"min_events = {settings['min_events']} filters the data")
    if settings.get("test_users", TrainConfig.test_users) is not None:
        gaps.append(f"test_users = {settings['test_users']} evaluates a sample of the users")
    return "; ".join(gaps) or None


def published_for(settings: Mapping[str, Any]) -> Optional[Published]:
    """The published rows of the data set of these ``[train]`` settings (None: none are
    shipped for it), marked not shown when the runs do not follow the protocol."""
    path = published_dir() / f"{settings.get('data', TrainConfig.data)}.toml"
    if not path.is_file():
        return None
    published = load_published(path)
    gap = protocol_gap(settings)
    if gap is not None:
        published.rows, published.shown, published.reason = [], False, gap
    elif settings.get("item_attributes"):
        published.caveat = (f"this config reads item attributes ({settings['item_attributes']}), "
                            "which none of the published rows uses")
    return published


def published_gains(published: Optional[Published], means: Mapping[str, Optional[float]]
                    ) -> Dict[str, Tuple[str, float, Optional[float]]]:
    """For each metric of the rows that the config reports: (the best row, its value, the
    config's mean's relative gain over it); the gain is None when the mean is missing."""
    gains: Dict[str, Tuple[str, float, Optional[float]]] = {}
    if published is None or not published.shown:
        return gains
    for metric in dict.fromkeys(m for row in published.rows for m in row.metrics):
        if metric not in means:
            continue
        best = max((row for row in published.rows if metric in row.metrics),
                   key=lambda row: row.metrics[metric])
        value, mine = best.metrics[metric], means[metric]
        gain = mine / value - 1 if mine is not None and value > 0 else None
        gains[metric] = (f"{best.name} ({best.kind})", value, gain)
    return gains


def published_lines(published: Optional[Published], means: Mapping[str, Optional[float]]
                    ) -> List[str]:
    """The table's lines of the published rows under one config, marked as published."""
    if published is None:
        return []
    if not published.shown:
        return [f"  published rows of {published.data} not shown: {published.reason}"]
    lines = [f"  published rows, under the same protocol: {published.protocol}",
             f"  published source: {published.source}",
             *([f"  published rows, caveat: {published.caveat}"] if published.caveat else []),
             "  published kinds: " + "; ".join(f"{kind}: {meaning}"
                                               for kind, meaning in published.kinds.items())]
    for row in published.rows:
        for metric, value in row.metrics.items():
            label = f"published: {row.name}"
            lines.append(f"  {label:<26} {metric:<12} {value:>20.4f}  ({row.kind})")
    for metric, (best, value, gain) in published_gains(published, means).items():
        text = "n/a" if gain is None else f"{gain:+.1%}"
        lines.append(f"  {'gain over best published':<26} {metric:<12} {text:>20}  ({best}, "
                     f"{value:.4f})")
    return lines
