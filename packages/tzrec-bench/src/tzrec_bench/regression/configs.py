"""Run configs: a TOML file each, naming the settings of ``tzrec-bench train``.

A config file holds a ``description`` and a ``[train]`` table whose keys are
:class:`~tzrec_bench.train.config.TrainConfig` fields (the ``train`` options with ``_`` for
``-``)::

    description = "HSTU retrieval, small synthetic data set, CPU: seconds"
    [train]
    model = "hstu-retrieval"
    data = "synthetic"
    max_steps = 30

The config's name is the file's stem. The package ships a few (:func:`shipped_configs`):
synthetic ones, tiny and pinned to the CPU so that their shipped baselines hold anywhere, and
ones on named sets (MovieLens-100K, the Amazon sets), which read their files from their folder
under ``--data-root``/``$TZREC_BENCH_DATA``.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Dict, Mapping, Optional

from tzrec_bench.data import item_attributes
from tzrec_bench.data.load import DATA_ENV, SOURCES
from tzrec_bench.data.text_format import find_file
from tzrec_bench.train.config import ConfigError, TrainConfig

if sys.version_info >= (3, 11):
    import tomllib
else:  # a dependency on Python 3.10 (pyproject.toml)
    import tomli as tomllib

SHIPPED_BASELINES = "baselines.toml"


class RunConfigError(ValueError):
    """A config or baseline file that cannot be used; the message names the file."""


@dataclass(frozen=True)
class RunConfig:
    """One named config: its file, description and training settings."""

    name: str
    path: Path
    description: str
    settings: Mapping[str, Any] = field(default_factory=dict)

    def train_config(self, seed_offset: int = 0, **overrides: Any) -> TrainConfig:
        """The settings as a checked :class:`TrainConfig`, its seed moved by ``seed_offset``."""
        values = {**self.settings, **overrides}
        values["seed"] = values.get("seed", TrainConfig.seed) + seed_offset
        attributes, data_dir = values.get("item_attributes"), values.get("data_dir")
        if attributes and data_dir and not Path(attributes).is_absolute():
            # a config names its attribute file in the data set's folder
            values["item_attributes"] = str(Path(data_dir) / attributes)
        config = TrainConfig.from_dict(values)
        config.check()
        return config


def shipped_dir() -> Path:
    """The folder of the configs and baselines shipped with the package."""
    return Path(str(resources.files("tzrec_bench") / "configs"))


def shipped_configs() -> Dict[str, Path]:
    """Name -> path of every shipped config."""
    return {p.stem: p for p in sorted(shipped_dir().glob("*.toml"))
            if p.name != SHIPPED_BASELINES}


def read_table(path: Path) -> Dict[str, Any]:
    """A TOML (``.toml``) or JSON (any other suffix) file as a dict."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise RunConfigError(f"{path}: cannot read it ({exc.strerror})") from None
    try:
        data = tomllib.loads(text) if path.suffix == ".toml" else json.loads(text)
    except (tomllib.TOMLDecodeError, json.JSONDecodeError) as exc:
        kind = "TOML" if path.suffix == ".toml" else "JSON"
        raise RunConfigError(f"{path}: not valid {kind}: {exc}") from None
    if not isinstance(data, dict):
        raise RunConfigError(f"{path}: expected a table at the top, got {type(data).__name__}")
    return data


def load_config(name_or_path: str) -> RunConfig:
    """A config by shipped name (``hstu-retrieval-synthetic``) or by path to its file."""
    path = Path(name_or_path)
    if not path.is_file():
        shipped = shipped_configs()
        if name_or_path not in shipped:
            raise RunConfigError(
                f"config {name_or_path!r}: no such file, and not a shipped config (shipped: "
                f"{', '.join(shipped)})")
        path = shipped[name_or_path]
    data = read_table(path)
    unknown = sorted(set(data) - {"description", "train"})
    if unknown:
        raise RunConfigError(f"{path}: unknown keys {', '.join(unknown)}; expected "
                             "description and a [train] table")
    settings = data.get("train", {})
    if not isinstance(settings, dict):
        raise RunConfigError(f"{path}: [train] must be a table, got {type(settings).__name__}")
    config = RunConfig(path.stem, path, str(data.get("description", "")), settings)
    try:
        config.train_config()
    except (ConfigError, ValueError, TypeError) as exc:
        raise RunConfigError(f"{path}: [train] {exc}") from None
    return config


def data_dir(config: RunConfig, data_root: Optional[str]) -> Optional[Path]:
    """Where the config's data set is read from (None: synthetic, or nowhere given)."""
    data = config.settings.get("data", TrainConfig.data)
    if data == "synthetic" or data not in SOURCES:  # generated, or an event log's own path
        return None
    if config.settings.get("data_dir"):
        return Path(config.settings["data_dir"])
    root = data_root or os.environ.get(DATA_ENV)
    return Path(root) / SOURCES[data].folder if root else None


def missing_data(config: RunConfig, data_root: Optional[str]) -> Optional[str]:
    """Why the config's data cannot be read (the run is then skipped), or None."""
    data = config.settings.get("data", TrainConfig.data)
    if data == "synthetic":
        return None
    if data not in SOURCES:
        return None if Path(data).exists() else f"{data}: no such file or folder"
    folder = data_dir(config, data_root)
    if folder is None:
        return f"{data}: no data folder (pass --data-root, or set {DATA_ENV})"
    try:
        SOURCES[data].files(folder)
    except FileNotFoundError as exc:
        return f"{data}: {exc}"
    attributes = config.settings.get("item_attributes")
    if attributes:
        try:
            find_file(folder, attributes, item_attributes.FILE_DESCRIPTION)
        except FileNotFoundError as exc:
            return f"{data}: {exc}"
    return None
