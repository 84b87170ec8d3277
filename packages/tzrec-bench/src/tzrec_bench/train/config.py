"""The settings of one training run: a dataclass that the CLI fills and checkpoints store.

Each field is a ``tzrec-bench train`` option of the same name (``batch_size`` is
``--batch-size``), so :class:`ConfigError` names the option a user typed.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional

from tzrec_bench.data import DATASETS
from tzrec_bench.data.load import DataOptionError, check_data_options
from tzrec_bench.train.tasks import TaskFacts, facts_of_task, task_facts
from tzrec_gr.models.registry import get_model, model_names

DEFAULT_EPOCHS = 10
AMP_MODES = ("auto", "bf16", "off")
DEVICES = ("auto", "cpu", "cuda")
SHARDINGS = ("replicate", "torchrec")
SHARDING_TYPES = ("auto", "row_wise", "table_wise")
TABLE_OPTIMIZER_NAMES = ("rowwise-adagrad", "adagrad", "sgd", "adam")

# options that may change when a run is resumed: they do not change what the next step does
# (where the data is read from may change: its vocabularies and fingerprint are compared)
RESUMABLE_CHANGES = frozenset(
    {
        "data", "columns", "data_dir", "cache_dir", "device", "backend", "out_dir", "resume",
        "overwrite", "paths_as_typed",
        "max_steps", "epochs", "eval_batch_size", "exclude_seen", "patience", "min_delta",
        "checkpoint_every", "log_every", "plot", "progress", "compile", "cuda_graphs",
        "eval_negatives",
        "test_users",
    }
)
#: --cuda-graphs: auto captures the training step where it can (graphed_step.py)
CUDA_GRAPHS = ("auto", "on", "off")
#: the settings that name files or folders, stored absolute (see TrainConfig.with_absolute_paths)
PATH_FIELDS = ("data", "data_dir", "cache_dir", "out_dir", "item_attributes")


class ConfigError(ValueError):
    """A setting out of range; ``option`` is its command-line flag, e.g. ``--batch-size``."""

    def __init__(self, field: str, message: str) -> None:
        self.option = option_name(field)
        super().__init__(f"{self.option}: {message}")


def model_choices() -> List[str]:
    """The models ``--model`` accepts: every registered model with a trainer builder
    (:mod:`tzrec_gr.models.registry`; importing :mod:`tzrec_bench.train` registers
    tzrec-bench's baselines)."""
    return [name for name in model_names() if get_model(name).trainer_kwargs is not None]


def option_name(field: str) -> str:
    return "--" + field.replace("_", "-")


def metric_names(task: str) -> List[str]:
    """The metrics a task reports, each usable as ``--metric``."""
    return list(facts_of_task(task).metrics)


@dataclass
class TrainConfig:
    """Every setting of a run; defaults are those of ``tzrec-bench train``."""

    # what to train, on what
    model: str = "hstu-retrieval"
    data: str = "synthetic"
    data_dir: Optional[str] = None
    cache_dir: Optional[str] = None
    columns: Optional[str] = None
    min_events: int = 0
    synthetic_users: int = 2000
    synthetic_items: int = 4000
    # model
    max_seq_len: int = 200
    embedding_dim: int = 64
    num_layers: int = 2
    num_heads: int = 2
    dropout: float = 0.2
    num_negatives: int = 128
    temperature: float = 0.05
    num_candidates: int = 8
    input_projection: bool = True
    linear_terms: bool = False
    # a JSON file: raw item id -> list of attributes (data/item_attributes.py)
    item_attributes: Optional[str] = None
    # optimisation
    batch_size: int = 128
    lr: float = 1e-3
    weight_decay: float = 0.01
    warmup_steps: int = 0
    clip_grad_norm: float = 1.0
    # an exponential moving average of the weights for validation, best.pt and the test
    # (train/averaging.py); 0: off
    ema_decay: float = 0.0
    amp: str = "auto"
    compile: bool = False
    cuda_graphs: str = "auto"
    epochs: Optional[int] = None
    max_steps: Optional[int] = None
    # the item table across processes (train/sharding.py)
    sharding: str = "replicate"
    sharding_type: str = "auto"
    table_optimizer: str = "rowwise-adagrad"
    storage_reservation: float = 0.15
    # evaluation and early stopping
    eval_every: Optional[int] = None
    eval_users: Optional[int] = None
    test_users: Optional[int] = None
    eval_batch_size: int = 256
    exclude_seen: bool = False
    eval_negatives: int = 0
    metric: Optional[str] = None
    patience: int = 5
    min_delta: float = 0.0
    # the run
    device: str = "auto"
    backend: Optional[str] = None
    seed: int = 0
    out_dir: str = "tzrec-bench-runs/run"
    resume: bool = False
    overwrite: bool = False
    checkpoint_every: Optional[int] = None
    log_every: int = 10
    plot: bool = True
    progress: bool = True
    # the paths of PATH_FIELDS as the user typed them, where they were made absolute
    paths_as_typed: Dict[str, str] = dataclasses.field(default_factory=dict)

    @property
    def task(self) -> str:
        """``"retrieval"`` or ``"ranking"``."""
        return get_model(self.model).task

    @property
    def facts(self) -> TaskFacts:
        """What the trainer knows about the task of ``model``."""
        return task_facts(self.model)

    @property
    def key_metric(self) -> str:
        """The validation metric that early stopping and the best checkpoint follow."""
        return self.metric or self.facts.key_metric

    def shown(self, field: str) -> str:
        """A path setting as the user typed it (for messages), or the setting itself."""
        return self.paths_as_typed.get(field, str(getattr(self, field)))

    def replaced(self, **changes: Any) -> "TrainConfig":
        """``dataclasses.replace``, forgetting the typed form of each path that changes."""
        typed = {k: v for k, v in self.paths_as_typed.items() if k not in changes}
        return dataclasses.replace(self, **changes, paths_as_typed=typed)

    def with_absolute_paths(self) -> "TrainConfig":
        """This config with the paths of :data:`PATH_FIELDS` absolute, so that a checkpoint
        read from another folder still finds its data; the typed forms are kept for
        messages in ``paths_as_typed``. A named data set is a name, not a path."""
        changed: Dict[str, str] = {}
        for field in PATH_FIELDS:
            value = getattr(self, field)
            if value is None or (field == "data" and value in DATASETS):
                continue
            absolute = str(Path(value).expanduser().absolute())
            if absolute != value:
                changed[field] = absolute
        typed = {**self.paths_as_typed,
                 **{f: self.paths_as_typed.get(f, getattr(self, f)) for f in changed}}
        return dataclasses.replace(self, **changed, paths_as_typed=typed)

    def total_steps(self, steps_per_epoch: int) -> int:
        """Optimizer steps of the whole run: ``max_steps``, ``epochs``, whichever ends first."""
        limits = [self.max_steps] if self.max_steps is not None else []
        if self.epochs is not None or not limits:
            limits.append((self.epochs or DEFAULT_EPOCHS) * steps_per_epoch)
        return min(limits)

    def check(self) -> None:
        """Raises :class:`ConfigError` naming the first option out of range."""
        if self.model not in model_choices():
            raise ConfigError("model", f"unknown model {self.model!r}; expected one of "
                              f"{', '.join(model_choices())}")
        try:  # where a named set's files are is known when it is read (a run config's later)
            check_data_options(self.data, self.data_dir, self.columns, self.min_events,
                               folders=False)
        except DataOptionError as exc:
            raise ConfigError(exc.field, exc.message) from None
        for field in ("synthetic_users", "synthetic_items", "max_seq_len", "embedding_dim",
                      "num_layers", "num_heads", "num_negatives", "num_candidates",
                      "batch_size", "eval_batch_size", "log_every"):
            _at_least(field, getattr(self, field), 1)
        for field in ("epochs", "max_steps", "eval_every", "eval_users", "test_users",
                      "checkpoint_every"):
            if getattr(self, field) is not None:
                _at_least(field, getattr(self, field), 1)
        for field in ("warmup_steps", "patience", "seed", "min_events", "eval_negatives"):
            _at_least(field, getattr(self, field), 0)
        if self.embedding_dim % self.num_heads:
            raise ConfigError("num_heads", f"must divide --embedding-dim "
                              f"({self.embedding_dim}); got {self.num_heads}")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError("dropout", f"must be in [0, 1); got {self.dropout}")
        for field in ("temperature", "lr"):
            if not getattr(self, field) > 0:
                raise ConfigError(field, f"must be > 0; got {getattr(self, field)}")
        for field in ("weight_decay", "clip_grad_norm", "min_delta"):
            if not getattr(self, field) >= 0:
                raise ConfigError(field, f"must be >= 0; got {getattr(self, field)}")
        if not 0.0 <= self.ema_decay < 1.0:
            raise ConfigError("ema_decay", f"must be in [0, 1) (0: no weight average); got "
                              f"{self.ema_decay}")
        if self.amp not in AMP_MODES:
            raise ConfigError("amp", f"expected one of {', '.join(AMP_MODES)}; got {self.amp!r}")
        if self.device not in DEVICES:
            raise ConfigError("device", f"expected one of {', '.join(DEVICES)}; got "
                              f"{self.device!r}")
        for field, choices in (("sharding", SHARDINGS), ("sharding_type", SHARDING_TYPES),
                               ("table_optimizer", TABLE_OPTIMIZER_NAMES)):
            if getattr(self, field) not in choices:
                raise ConfigError(field, f"expected one of {', '.join(choices)}; got "
                                  f"{getattr(self, field)!r}")
        if not 0.0 <= self.storage_reservation < 1.0:
            raise ConfigError("storage_reservation", f"must be in [0, 1); got "
                              f"{self.storage_reservation}")
        if self.compile and get_model(self.model).fitted:
            trained = [name for name in model_choices() if not get_model(name).fitted]
            raise ConfigError("compile", f"{self.model} is fitted from counts and takes no "
                              "gradient steps: there is no training step to compile; drop "
                              f"--compile or train {', '.join(trained[:-1])} or {trained[-1]}")
        if self.ema_decay and get_model(self.model).fitted:
            raise ConfigError("ema_decay", f"{self.model} is fitted from counts and takes no "
                              "gradient steps: there are no weights to average; drop "
                              "--ema-decay")
        if self.ema_decay and self.sharding == "torchrec":
            raise ConfigError("ema_decay", "not supported with --sharding torchrec (its item "
                              "table is updated by torchrec's fused optimizer, split over the "
                              "processes, where no average is kept); expected --sharding "
                              "replicate, or --ema-decay 0")
        if self.compile and self.sharding == "torchrec":
            raise ConfigError("compile", "not supported with --sharding torchrec (its sharded "
                              "tables run outside torch.compile); expected --sharding "
                              "replicate, or no --compile")
        if self.cuda_graphs not in CUDA_GRAPHS:
            raise ConfigError("cuda_graphs", f"expected one of {', '.join(CUDA_GRAPHS)}; got "
                              f"{self.cuda_graphs!r}")
        if self.overwrite and self.resume:
            raise ConfigError("overwrite", "--resume continues the run in --out-dir and "
                              "--overwrite replaces it: give one of them")
        if self.eval_negatives and not self.facts.eval_negatives:
            raise ConfigError("eval_negatives", f"the sampled protocol ranks retrieval targets; "
                              f"{self.model} is a {self.task} model")
        if self.eval_negatives and self.sharding == "torchrec":
            raise ConfigError("eval_negatives", "not with --sharding torchrec (its evaluation "
                              "reads the catalogue in chunks); expected --sharding replicate")
        if not self.input_projection and not get_model(self.model).takes("input_projection"):
            raise ConfigError("input_projection", f"{self.model} has no input projection to "
                              "leave out; drop --no-input-projection (input_projection = "
                              "false in a config)")
        if self.linear_terms and not get_model(self.model).takes("linear_terms"):
            raise ConfigError("linear_terms", f"{self.model} has no head to add linear terms "
                              "to; drop --linear-terms (linear_terms = true in a config)")
        if self.item_attributes is not None and not get_model(self.model).takes(
            "num_attributes"
        ):
            raise ConfigError("item_attributes", f"{self.model} takes no item attributes; "
                              "expected a model with an attribute table (hstu-retrieval, "
                              "sasrec), or no --item-attributes")
        if self.metric is not None and self.metric not in self.facts.metrics:
            raise ConfigError("metric", f"{self.metric!r} is not a metric of {self.model}; "
                              f"expected one of {', '.join(self.facts.metrics)}")

    def to_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> "TrainConfig":
        """The config ``values`` describe (as :meth:`to_dict` gives); unknown keys are errors."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown settings: {', '.join(unknown)}")
        return cls(**values)

    def resume_conflicts(self, saved: "TrainConfig") -> List[str]:
        """Options that differ from the checkpoint's and would change the resumed run."""
        return [
            f"{option_name(f.name)} is {getattr(self, f.name)!r} here but "
            f"{getattr(saved, f.name)!r} in the checkpoint"
            for f in dataclasses.fields(self)
            if f.name not in RESUMABLE_CHANGES and getattr(self, f.name) != getattr(saved, f.name)
        ]


def _at_least(field: str, value: int, least: int) -> None:
    if value < least:
        raise ConfigError(field, f"must be at least {least}; got {value}")
