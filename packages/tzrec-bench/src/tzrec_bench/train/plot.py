"""The training-curve PNG: loss by step, and the validation metrics by step.

matplotlib is optional (``pip install 'tzrec-bench[plot]'``): without it the plot is skipped
and the caller prints why. The figure is drawn on matplotlib's object API (``Figure``) rather
than pyplot, so no global state or GUI backend is touched.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from tzrec_ops.extras import require


def plot_curves(
    history: Dict[str, List[Dict[str, Any]]],
    metrics: Sequence[str],
    path: Path,
    title: str,
    best_step: Optional[int] = None,
) -> Path:
    """Writes the curves of ``history`` (as the training loop records it) to ``path``.

    Args:
        history: ``{"train": [{"step", "loss", ...}], "valid": [{"step", <metric>: ...}]}``.
        metrics: validation metrics to draw, e.g. ("hr@10", "ndcg@10").
        path: the PNG to write.
        title: the figure's title.
        best_step: the step of the kept (best) weights, marked on both panels.

    Raises:
        ImportError: matplotlib is not installed (the message names the extra).
    """
    require("matplotlib", "tzrec-bench[plot]", "the training-curve plot")
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 4), layout="constrained")
    loss_ax, metric_ax = fig.subplots(1, 2)
    train = history.get("train", [])
    loss_ax.plot([r["step"] for r in train], [r["loss"] for r in train], color="tab:blue")
    loss_ax.set(title="training loss", xlabel="step", ylabel="loss")
    valid = history.get("valid", [])
    for name in metrics:
        points = [(r["step"], r[name]) for r in valid if name in r]
        if points:
            steps, values = zip(*points)
            metric_ax.plot(steps, values, marker="o", label=name)
    metric_ax.set(title="validation", xlabel="step", ylabel="metric")
    for ax in (loss_ax, metric_ax):
        if best_step is not None:
            ax.axvline(best_step, color="tab:green", linestyle="--",
                       label=f"best weights (step {best_step})")
        ax.grid(alpha=0.3)
    if metric_ax.has_data():
        metric_ax.legend()
    if best_step is not None:
        loss_ax.legend()
    fig.suptitle(title)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    return path
