"""Plain-text reports: the metrics table and the throughput line printed after a run, the
progress bars of training and evaluation, and the training bar's layout while early stopping
decides the run's length."""

from __future__ import annotations

import math
import statistics
import sys
from typing import Any, Dict, Mapping, Optional, Sequence

from tqdm import tqdm


def _cell(name: str, value: float) -> str:
    if math.isnan(value):
        return "n/a"
    return str(int(value)) if name == "count" else f"{value:.4f}"


def seen_items_rule(exclude_seen: bool) -> str:
    """How a retrieval evaluation treated the items already in a user's history, in words
    (``exclude_seen`` is ``TrainConfig.exclude_seen``, the ``--exclude-seen`` option)."""
    if exclude_seen:
        return ("seen items: excluded (each target is ranked among the items not in the "
                "user's history, the target itself kept; --exclude-seen)")
    return ("seen items: not excluded (each target is ranked among the whole catalogue, "
            "the user's history items included)")


def metrics_table(
    columns: Mapping[str, Mapping[str, float]],
    exclude_seen: Optional[bool] = None,
    users_of: Optional[Mapping[str, int]] = None,
) -> str:
    """One row per metric, one column per evaluation (e.g. ``valid`` and ``test``).

    ``count`` (users evaluated) is shown as ``users``; where ``users_of`` gives a column's
    users in all (its split's) and fewer were evaluated (``--eval-users``, ``--test-users``),
    the cell says so: ``2000 of 9000``. A metric missing from a column is left blank.
    ``exclude_seen`` (retrieval) adds a last line with :func:`seen_items_rule`; None
    (ranking, where no item is ranked against the catalogue) adds none.
    """
    names: Dict[str, None] = {}
    for values in columns.values():
        names.update(dict.fromkeys(values))
    header = ["metric", *columns]

    def shown(column: str, name: str) -> str:
        values = columns[column]
        if name not in values:
            return ""
        text = _cell(name, values[name])
        total = (users_of or {}).get(column)
        if name == "count" and total is not None and values[name] < total:
            text += f" of {total}"
        return text

    rows = [["users" if name == "count" else name, *(shown(column, name) for column in columns)]
            for name in names]
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip()
             for row in [header, *rows]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    if exclude_seen is not None:
        lines.append(seen_items_rule(exclude_seen))
    return "\n".join(lines)


def evaluated_users(
    metrics: Mapping[str, Mapping[str, float]], users_of: Mapping[str, int]
) -> Dict[str, Dict[str, int]]:
    """metrics.json's ``users``: for each split, the users evaluated and the split's users
    in all, e.g. ``{"test": {"evaluated": 2000, "of": 9000}}``."""
    return {split: {"evaluated": int(values["count"]), "of": users_of[split]}
            for split, values in metrics.items() if "count" in values}


def progress_bar(enabled: bool, **options: Any) -> tqdm:
    """A tqdm bar on stderr, drawn alike by training and evaluation; ``enabled`` False (not
    rank 0, or ``--no-progress``) draws nothing.

    A log file (not a terminal) gets a redraw every 10 s, not a line of them per second.
    """
    return tqdm(dynamic_ncols=True, mininterval=0.5 if sys.stderr.isatty() else 10.0,
                disable=not enabled, **options)


def evaluation_progress(enabled: bool, split: str, users: int) -> tqdm:
    """The bar of one evaluation of ``split`` over ``users`` users (this process's), e.g.
    ``evaluating test:  40%|####      | 800/2000 [00:03<00:04, 262users/s]``; it is cleared
    when done (the metrics follow), and under training it is drawn below the training bar."""
    return progress_bar(enabled, total=users, desc=f"evaluating {split}", unit="users",
                        leave=False)


def open_ended_progress(
    step: int, total: int, eval_every: int, patience: int, bad_evaluations: int
) -> Optional[str]:
    """The progress bar's ``bar_format`` while early stopping can still end the run before
    ``total`` steps, or None once the run's length is fixed (then the bar shows
    ``step/total`` and an ETA).

    Early stopping ends a run at a validation before step ``total`` once ``patience``
    validations in a row bring no gain; it can no longer do so when fewer validations are
    left before ``total`` than the ``patience - bad_evaluations`` it still needs (and a gain
    only raises that need again). While it can, the bar has no total, no fill and no ETA:
    the steps so far, the cap ``total`` as text and the validations without gain, e.g.
    ``sasrec: 375 steps of at most 3000 (early stopping: 2/5 validations without gain)
    [02:10, 2.88step/s, loss=...]``. ``patience`` 0 (never stops) is a fixed length.
    """
    left = (total - 1) // eval_every - step // eval_every  # validations in (step, total)
    if patience == 0 or left < patience - bad_evaluations:
        return None
    return (
        f"{{desc}}: {{n_fmt}} steps of at most {total} (early stopping: "
        f"{bad_evaluations}/{patience} validations without gain) "
        "[{elapsed}, {rate_fmt}{postfix}]"
    )


def throughput_line(steps: int, seconds: float, tokens: int, device: str, backend: str) -> str:
    """``trained 80 steps in 95.1 s: 5.2k tokens/s (cpu, ops backend pytorch)``."""
    rate = tokens / seconds if seconds > 0 else math.nan
    return (
        f"trained {steps} steps in {seconds:.1f} s: {_si(rate)} tokens/s "
        f"({device}, {backend})"
    )


def steady_state(windows: Sequence[Mapping[str, float]]) -> Optional[str]:
    """Throughput of the log windows after the first, or None with fewer than two.

    The first window pays the one-time costs (Triton compiles one kernel variant per new
    shape class, autotuning, allocator warm-up), which can dominate a short GPU run. A later
    window can still meet a new shape class (a batch whose token count falls in a size
    bucket not seen before) and compile again, so the line gives the median window's rate
    next to the mean over all of them.
    """
    later = [w for w in windows[1:] if w.get("seconds")]
    seconds = sum(w["seconds"] for w in later)
    if not later or seconds <= 0:
        return None
    tokens = sum(w["tokens"] for w in later)
    steps = later[-1]["step"] - windows[0]["step"]
    median_tokens = statistics.median(w["tokens"] / w["seconds"] for w in later)
    median_samples = statistics.median(w["samples"] / w["seconds"] for w in later)
    return (
        f"after the first log window (compiles, warm-up): {steps} steps, "
        f"{_si(median_tokens)} tokens/s, {_si(median_samples)} samples/s (median of "
        f"{len(later)} windows; mean {_si(tokens / seconds)} tokens/s)"
    )


def _si(value: float) -> str:
    for limit, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if value >= limit:
            return f"{value / limit:.1f}{suffix}"
    return f"{value:.0f}"
