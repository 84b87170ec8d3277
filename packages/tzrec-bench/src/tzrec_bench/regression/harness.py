"""Run each config ``repeats`` times (seeds ``seed``, ``seed + 1``, ...), average its test
metrics and judge them against the baseline.

The trainer is a function of a :class:`~tzrec_bench.train.config.TrainConfig` returning the
test metrics (:func:`train_and_test`, the ``tzrec-bench train`` loop, by default), so tests
can stand a fast one in. A run that raises is recorded with its error, and every metric of
its config is then *failed*; the other runs still go ahead. Every raised run, a floor's
included, is counted (``failed runs``) and makes the exit status 1, judged or not.

No table appears without a floor: beside each config, the simple baselines of its task
(:func:`floor_models`: the fitted models of its task in the model registry: most popular,
item transitions and item-kNN for retrieval, item and user popularity for ranking) run on
the same data, split and seeds, through the same trainer and metrics, and the table gives
the config's gain over the best of them (on its task's
:attr:`~tzrec_bench.train.tasks.TaskFacts.table_metrics`).

Where results were published on the config's data set, their rows are shown beside the
config's, marked as published, when the config follows their protocol
(:mod:`tzrec_bench.regression.published`), with its gain over the best of them; they are never
judged.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from tzrec_bench.regression.baseline import (
    FAILED,
    REGRESSED,
    STATUSES,
    Baseline,
    Threshold,
    metric_status,
)
from tzrec_bench.regression.configs import RunConfig, data_dir, missing_data
from tzrec_bench.regression.published import (
    Published,
    published_for,
    published_gains,
    published_lines,
)
from tzrec_bench.train.config import TrainConfig
from tzrec_bench.train.tasks import facts_of_task
from tzrec_gr.models.registry import TASKS, get_model, model_names

Trainer = Callable[[TrainConfig], Mapping[str, float]]

#: the metrics the table compares with the floors, of every task (all are in the JSON)
FLOOR_METRICS_ALL = tuple(dict.fromkeys(
    name for task in TASKS for name in facts_of_task(task).table_metrics))
# the settings a floor shares with its config: the data, its split and the evaluation
FLOOR_SETTINGS = ("data", "data_dir", "cache_dir", "columns", "min_events", "synthetic_users",
                  "synthetic_items", "max_seq_len", "num_candidates", "eval_batch_size",
                  "exclude_seen", "eval_negatives", "test_users", "metric", "device", "seed")


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
    floors: List["ConfigResult"] = field(default_factory=list)  # the simple baselines
    published: Optional[Published] = None  # papers' rows on its data set, never judged


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
            progress=False, overwrite=True,  # the folder of this config's earlier runs
            **({"data_dir": str(folder)} if folder is not None else {}))
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


def floor_models(task: str) -> List[str]:
    """The simple baselines run beside every config of ``task``: its fitted models in the
    model registry, in the order they were registered."""
    return [name for name in model_names(task) if get_model(name).fitted]


def floor_configs(config: RunConfig) -> List[RunConfig]:
    """The simple baselines of ``config``'s task, on its data and split (none for a config
    that is itself a simple baseline)."""
    model = config.settings.get("model", TrainConfig.model)
    if get_model(model).fitted:
        return []
    shared = {k: v for k, v in config.settings.items() if k in FLOOR_SETTINGS}
    return [
        RunConfig(f"floor:{floor}", config.path, f"{floor} on {config.name}'s data",
                  {**shared, "model": floor})
        for floor in floor_models(get_model(model).task)
    ]


def run_configs(configs: Sequence[RunConfig], repeats: int, baseline: Baseline,
                trainer: Trainer = train_and_test, work_dir: Path = Path("."),
                data_root: Optional[str] = None, floors: bool = True) -> List[ConfigResult]:
    """Each config's runs, judged against ``baseline``, with its floors unless ``floors`` is
    False; configs on the same data and split share their floors' runs."""
    done: Dict[str, ConfigResult] = {}
    results = []
    for config in configs:
        result = run_config(config, repeats, baseline.get(config.name, {}), trainer, work_dir,
                            data_root)
        if result.skipped is None:
            result.published = published_for(config.settings)
        if floors and result.skipped is None:
            for floor in floor_configs(config):
                key = repr(sorted(floor.settings.items()))
                if key not in done:
                    folder = work_dir / "floors" / f"{len(done)}-{floor.settings['model']}"
                    done[key] = run_config(floor, repeats, {}, trainer, folder, data_root)
                result.floors.append(done[key])
        results.append(result)
    return results


def floor_gains(result: ConfigResult) -> Dict[str, Tuple[str, float, Optional[float]]]:
    """For each compared metric: (the best floor, its mean, the config's relative gain over
    it); the gain is None when either mean is missing or the floor's is 0."""
    gains = {}
    for name in FLOOR_METRICS_ALL:
        mine = result.metrics.get(name)
        scored = [(f.name, f.metrics[name].mean) for f in result.floors
                  if name in f.metrics and f.metrics[name].mean is not None]
        if mine is None or not scored:
            continue
        best, value = max(scored, key=lambda item: item[1])
        gain = mine.mean / value - 1 if mine.mean is not None and value > 0 else None
        gains[name] = (best, value, gain)
    return gains


def failed_runs(results: Sequence[ConfigResult]) -> int:
    """How many runs raised: the configs' and their floors' (a floor shared by several
    configs is one set of runs, counted once)."""
    floors = {id(f): f for r in results for f in r.floors}
    return sum(len(r.errors) for r in [*results, *floors.values()])


def counts(results: Sequence[ConfigResult]) -> Dict[str, int]:
    """How many metrics got each verdict, how many configs were skipped and how many runs
    raised. A run that raised is counted even where no metric could be judged (every run
    of a config raised with no baseline for it, or a floor's run raised)."""
    tally = {status: 0 for status in STATUSES}
    for r in results:
        for m in r.metrics.values():
            if m.status is not None:
                tally[m.status] += 1
    tally["skipped configs"] = sum(r.skipped is not None for r in results)
    tally["failed runs"] = failed_runs(results)
    return tally


def exit_code(results: Sequence[ConfigResult]) -> int:
    """1 when a metric regressed or failed or a run raised, else 0."""
    tally = counts(results)
    return 1 if tally[REGRESSED] or tally[FAILED] or tally["failed runs"] else 0


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
        lines.extend(_floor_lines(r))
        lines.extend(published_lines(r.published, _means(r)))
    tally = counts(results)
    lines.append(", ".join(f"{n} {status}" for status, n in tally.items()))
    return "\n".join(lines)


def _means(result: ConfigResult) -> Dict[str, Optional[float]]:
    return {name: m.mean for name, m in result.metrics.items()}


def _floor_lines(result: ConfigResult) -> List[str]:
    """The floors' compared metrics under a config, and its gain over the best floor."""
    lines = []
    for floor in result.floors:
        for error in floor.errors:
            lines.append(f"  {floor.name:<26} run failed: {error}")
        for name, m in floor.metrics.items():
            if name in result.metrics and name in FLOOR_METRICS_ALL:
                spread = f"{_fmt(m.mean)} ± {_fmt(m.std)}"
                lines.append(f"  {floor.name:<26} {name:<12} {spread:>20}")
    for name, (best, value, gain) in floor_gains(result).items():
        text = "n/a" if gain is None else f"{gain:+.1%}"
        lines.append(f"  {'gain over best floor':<26} {name:<12} {text:>20}  ({best}, "
                     f"{_fmt(value)})")
    return lines


def summary_json(results: Sequence[ConfigResult], repeats: int) -> Dict[str, object]:
    return {
        "repeats": repeats,
        "counts": counts(results),
        "exit_code": exit_code(results),
        "configs": [
            {**asdict(r), "floor_gains": {
                name: {"floor": best, "floor_mean": value, "relative_gain": gain}
                for name, (best, value, gain) in floor_gains(r).items()},
             "published_gains": {
                name: {"row": best, "value": value, "relative_gain": gain}
                for name, (best, value, gain) in published_gains(r.published,
                                                                 _means(r)).items()}}
            for r in results
        ],
    }
