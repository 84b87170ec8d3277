"""Model registry: one :class:`ModelRecord` per model, looked up by its name or its class.

A model's own module registers its record when it is imported (``register_model`` at the
bottom of the module); tzrec-gr's HSTU models are registered by importing
:mod:`tzrec_gr.models`. A third-party package registers its models through the
``tzrec_gr.models`` entry-point group: each entry point names a module, and importing it
registers its records::

    [project.entry-points."tzrec_gr.models"]
    my-model = "my_package.my_model"

Plugins are discovered lazily, once, on the first lookup. A plugin that fails to import is
skipped with a warning naming its distribution and version, and listed by
:func:`failed_model_plugins` (``TZREC_GR_STRICT_PLUGINS=1`` makes that an error). Two records
with one name, or with one class name (checkpoints store a model's class name), is an error
naming both origins.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import inspect
import os
import sys
import threading
import warnings
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple, Union

from torch import nn

from tzrec_ops.registry import FailedPlugin

__all__ = [
    "ENTRY_POINT_GROUP",
    "STRICT_PLUGINS_ENV",
    "TASKS",
    "FailedModelPlugin",
    "ModelRecord",
    "ModelRegistryError",
    "TrainerKwargs",
    "failed_model_plugins",
    "get_model",
    "model_names",
    "record_for_class",
    "register_model",
]

ENTRY_POINT_GROUP = "tzrec_gr.models"
STRICT_PLUGINS_ENV = "TZREC_GR_STRICT_PLUGINS"
#: the tasks a model is trained on, in the order :func:`model_names` lists them
TASKS = ("retrieval", "ranking")

#: ``(settings, num_items, task_bits) -> constructor kwargs`` (without ``device``): settings
#: is any object with a trainer's attributes (``embedding_dim``, ``max_seq_len``,
#: ``num_heads``, ``num_layers``, ``dropout``, ``num_negatives``, ``temperature``,
#: ``num_candidates``, ``backend``); task_bits is a ranking model's label bit per task.
TrainerKwargs = Callable[[Any, int, Sequence[int]], Dict[str, Any]]


class ModelRegistryError(ValueError):
    """An invalid or duplicate record, an unknown model, or (in strict mode) a model plugin
    that failed to load."""


@dataclasses.dataclass(frozen=True)
class ModelRecord:
    """What the packages need to know about one model.

    Attributes:
        name: the user-facing name, e.g. ``"hstu-retrieval"`` (``tzrec-bench train --model``).
        model_class: the ``nn.Module`` class.
        task: ``"retrieval"`` or ``"ranking"``.
        fitted: fitted from counts (``model.fit(train)``) rather than trained by gradients.
        shardable: its trainer may shard its embedding tables with torchrec (``tzrec-bench
            train --sharding torchrec``): its constructor takes ``embedding_tables``.
        graph_step: its ``loss`` takes ``loss_mask`` (the real tokens of a batch padded to
            a fixed size) and reads nothing back from the device, so a trainer may capture
            its whole training step in a CUDA graph (``tzrec-bench train --cuda-graphs``).
        trainer_kwargs: the constructor kwargs from a trainer's settings (see
            :data:`TrainerKwargs`); None for a model no trainer builds.
        description: one line on what the model is.
        server: builds the serving server of a model instance (a
            :class:`tzrec_gr.serving.ModelServer`), for a model whose module stands above
            serving (a plugin); None: the server registered for this name with
            :func:`tzrec_gr.serving.server.register_server` (tzrec-gr's own models, which
            serving stands above), or none (the model is not served).
    """

    name: str
    model_class: type
    task: str
    fitted: bool = False
    shardable: bool = False
    graph_step: bool = False
    trainer_kwargs: Optional[TrainerKwargs] = None
    description: str = ""
    server: Optional[Callable[[nn.Module], Any]] = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ModelRegistryError(
                f"a model's name must be a non-empty string, got {self.name!r}"
            )
        if not (isinstance(self.model_class, type) and issubclass(self.model_class, nn.Module)):
            raise ModelRegistryError(
                f"model {self.name!r}: model_class must be an nn.Module class, got "
                f"{self.model_class!r}"
            )
        if self.task not in TASKS:
            raise ModelRegistryError(
                f"model {self.name!r}: task must be one of {', '.join(TASKS)}, got {self.task!r}"
            )
        if not isinstance(self.shardable, bool):
            raise ModelRegistryError(
                f"model {self.name!r}: shardable must be True or False, got {self.shardable!r}"
            )
        if self.trainer_kwargs is not None and not callable(self.trainer_kwargs):
            raise ModelRegistryError(
                f"model {self.name!r}: trainer_kwargs must be callable or None"
            )
        if self.server is not None and not callable(self.server):
            raise ModelRegistryError(f"model {self.name!r}: server must be callable or None")

    def takes(self, name: str) -> bool:
        """The model class's constructor has a parameter called ``name`` (a named one:
        ``**kwargs`` does not count), so a caller may pass it, e.g. ``backend``."""
        parameter = inspect.signature(self.model_class).parameters.get(name)
        return parameter is not None and parameter.kind not in (
            inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)


class FailedModelPlugin(FailedPlugin):
    """A ``tzrec_gr.models`` entry point whose module failed to import (the fields of a
    failed backend plugin)."""

    def describe(self) -> str:
        return f"model {super().describe()}"


@dataclasses.dataclass
class _State:
    records: Dict[str, ModelRecord] = dataclasses.field(default_factory=dict)
    origins: Dict[str, str] = dataclasses.field(default_factory=dict)  # name -> who registered
    failed: List[FailedModelPlugin] = dataclasses.field(default_factory=list)
    discovered: bool = False
    loading: Optional[str] = None  # the plugin being imported, as its records' origin


_STATE = _State()
_LOCK = threading.RLock()  # a plugin registers its records while discovery holds the lock


def _strict() -> bool:
    return os.environ.get(STRICT_PLUGINS_ENV, "").lower() in ("1", "true", "yes")


def _entry_points() -> Iterable[importlib.metadata.EntryPoint]:
    return importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)


def _distribution(ep: importlib.metadata.EntryPoint) -> Tuple[str, str]:
    dist = getattr(ep, "dist", None)
    if dist is None:
        return "<unknown distribution>", "<unknown version>"
    return dist.metadata["Name"] or "<unknown distribution>", dist.version


def register_model(record: ModelRecord) -> ModelRecord:
    """Add ``record`` to the registry (registering an equal record again does nothing).

    Returns:
        ModelRecord: ``record``.

    Raises:
        ModelRegistryError: another record has its name or its class name; the message
            names where each was registered.
    """
    caller = sys._getframe(1).f_globals.get("__name__", "<unknown module>")
    with _LOCK:
        state = _STATE
        origin = state.loading or caller
        if state.records.get(record.name) == record:
            return record
        if record.name in state.records:
            raise ModelRegistryError(
                f"two models are named {record.name!r}: one registered by "
                f"{state.origins[record.name]}, one by {origin}; model names must be unique"
            )
        class_name = record.model_class.__name__
        for other in state.records.values():
            if other.model_class.__name__ == class_name:
                raise ModelRegistryError(
                    f"models {other.name!r} (registered by {state.origins[other.name]}) and "
                    f"{record.name!r} (registered by {origin}) both have the class "
                    f"{class_name!r}; checkpoints name a model by its class, so each model "
                    f"needs a class of its own name"
                )
        state.records[record.name] = record
        state.origins[record.name] = origin
    return record


def _discover() -> _State:
    """The registry, with the entry-point plugins imported once."""
    state = _STATE
    if state.discovered:
        return state
    with _LOCK:
        if state.discovered or state.loading is not None:  # done, or a plugin looking up
            return state
        for ep in _entry_points():
            dist, version = _distribution(ep)
            before = set(state.records)
            state.loading = f"model plugin {ep.name!r} from distribution {dist} {version}"
            try:
                ep.load()
            except Exception as exc:
                for name in set(state.records) - before:  # a plugin is loaded whole or not
                    del state.records[name], state.origins[name]
                if isinstance(exc, ModelRegistryError):
                    raise
                failure = FailedModelPlugin(ep.name, ep.value, dist, version, repr(exc))
                if _strict():
                    raise ModelRegistryError(
                        f"failed to load tzrec_gr {failure.describe()} ({STRICT_PLUGINS_ENV} "
                        f"is set)"
                    ) from exc
                warnings.warn(f"skipping tzrec_gr {failure.describe()}", RuntimeWarning,
                              stacklevel=4)
                state.failed.append(failure)
            finally:
                state.loading = None
        state.discovered = True
    return state


def _unknown(what: str, known: Iterable[str], state: _State) -> ModelRegistryError:
    failed = "".join(f"\n  failed {f.describe()}" for f in state.failed)
    return ModelRegistryError(f"unknown {what}; registered: {', '.join(known) or 'none'}{failed}")


def get_model(name: str) -> ModelRecord:
    """The record registered under ``name``.

    Raises:
        ModelRegistryError: no model has that name; the message lists the registered names
            and the plugins that failed to load.
    """
    state = _discover()
    if name not in state.records:
        raise _unknown(f"model {name!r}", model_names(), state)
    return state.records[name]


def model_names(task: Optional[str] = None) -> List[str]:
    """The registered models' names (of one task if given): trained models before fitted
    ones, retrieval before ranking, then in the order they were registered."""
    if task is not None and task not in TASKS:
        raise ModelRegistryError(f"task must be one of {', '.join(TASKS)}, got {task!r}")
    records = list(_discover().records.values())
    records.sort(key=lambda r: (r.fitted, TASKS.index(r.task)))  # stable: keeps the order
    return [r.name for r in records if task is None or r.task == task]


def record_for_class(name_or_class: Union[str, type]) -> ModelRecord:
    """The record of a model class, given the class or its name (what a checkpoint stores,
    e.g. ``"HSTURanking"``).

    Raises:
        ModelRegistryError: no registered model has that class.
    """
    state = _discover()
    for record in state.records.values():
        if isinstance(name_or_class, str):
            if record.model_class.__name__ == name_or_class:
                return record
        elif record.model_class is name_or_class:
            return record
    shown = name_or_class if isinstance(name_or_class, str) else name_or_class.__qualname__
    known = [r.model_class.__name__ for r in state.records.values()]
    raise _unknown(f"model class {shown!r}", known, state)


def failed_model_plugins() -> List[FailedModelPlugin]:
    """The ``tzrec_gr.models`` plugins that failed to import (each was skipped)."""
    return list(_discover().failed)
