"""What the trainer knows about each task a model is trained on (its record's
:attr:`~tzrec_gr.models.registry.ModelRecord.task`), in one :class:`TaskFacts` each.

Retrieval ranks the whole catalogue for each user; ranking scores the candidates it is given
against their labels. The trainer, the report and the regression harness ask a model's
facts (:func:`task_facts`) instead of testing its task's name. This module is light to
import: the trainer class of a task (its module imports the data pipeline and the metrics)
is imported when it is asked for.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional, Tuple

from tzrec_gr.models.registry import get_model

__all__ = [
    "RANKING",
    "RANKING_TASKS",
    "RETRIEVAL",
    "RETRIEVAL_KS",
    "TaskFacts",
    "facts_of_task",
    "task_facts",
]

#: the cut-offs of the retrieval metrics (hr@10, ndcg@50, ...)
RETRIEVAL_KS = (10, 50, 200)
#: the ranking model's tasks, each with an AUC of its own (auc_click, ...)
RANKING_TASKS = ("click", "like", "long_view")


@dataclass(frozen=True)
class TaskFacts:
    """One task as the trainer sees it.

    Attributes:
        name: the task, one of :data:`tzrec_gr.models.registry.TASKS`.
        trainer: ``"module:Class"`` of the task's trainer (a
            :class:`~tzrec_bench.train.task.Task`), imported by :meth:`trainer_class`.
        metrics: the metrics it reports, each usable as ``--metric``.
        key_metric: the default ``--metric`` (early stopping and best.pt follow it).
        excludes_seen: ``--exclude-seen`` applies: evaluation ranks the whole catalogue,
            which holds the user's own history.
        eval_negatives: the sampled protocol (``--eval-negatives``) applies: each target is
            also ranked against sampled items the user never interacted with.
        catalogue_softmax: the loss is a softmax over the catalogue, which a sharded item
            table (``--sharding torchrec``) must sample rather than read whole.
        plotted: the metrics the curves show beside the key metric; None: every metric
            the run reports.
        table_metrics: the metrics a regression table compares with the floors (those
            that a run did not report, e.g. the sampled ones without ``--eval-negatives``,
            are left out).
    """

    name: str
    trainer: str
    metrics: Tuple[str, ...]
    key_metric: str
    excludes_seen: bool
    eval_negatives: bool
    catalogue_softmax: bool
    plotted: Optional[Tuple[str, ...]]
    table_metrics: Tuple[str, ...]

    def trainer_class(self) -> type:
        """The task's trainer class (imported now: its module is heavy)."""
        module, name = self.trainer.split(":")
        return getattr(importlib.import_module(module), name)

    def plot_metrics(self, key_metric: str, reported: Iterable[str]) -> List[str]:
        """The curves of a run with ``key_metric`` whose evaluations report ``reported``."""
        shown = ([key_metric, *self.plotted] if self.plotted is not None
                 else [name for name in reported if name != "count"])
        return list(dict.fromkeys(shown))


RETRIEVAL = TaskFacts(
    name="retrieval",
    trainer="tzrec_bench.train.retrieval:RetrievalTask",
    metrics=(*(f"{m}@{k}" for m in ("hr", "ndcg") for k in RETRIEVAL_KS), "mrr"),
    key_metric="ndcg@10",
    excludes_seen=True,
    eval_negatives=True,
    catalogue_softmax=True,
    plotted=("hr@10",),
    table_metrics=("hr@10", "ndcg@10", "sampled_hr@10", "sampled_ndcg@10"),
)
RANKING = TaskFacts(
    name="ranking",
    trainer="tzrec_bench.train.ranking:RankingTask",
    metrics=("auc", *(f"auc_{name}" for name in RANKING_TASKS)),
    key_metric="auc",
    excludes_seen=False,
    eval_negatives=False,
    catalogue_softmax=False,
    plotted=None,
    table_metrics=("auc",),
)
_FACTS: Dict[str, TaskFacts] = {facts.name: facts for facts in (RETRIEVAL, RANKING)}


def facts_of_task(task: str) -> TaskFacts:
    """The facts of ``task`` (one of :data:`tzrec_gr.models.registry.TASKS`).

    Raises:
        ValueError: an unknown task, naming the known ones.
    """
    if task not in _FACTS:
        raise ValueError(f"unknown task {task!r}; expected one of {', '.join(_FACTS)}")
    return _FACTS[task]


def task_facts(model: str) -> TaskFacts:
    """The facts of the task that the registered model ``model`` is trained on."""
    return facts_of_task(get_model(model).task)
