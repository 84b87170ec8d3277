"""A run's folder (``--out-dir``) holds one run: its files, never those of an earlier one.

A new run refuses a folder that holds an earlier run's files (:func:`check`) unless told to
replace them (``--overwrite``: :func:`clear` removes them before anything is written);
``--resume`` continues the run whose ``checkpoint.pt`` is there, and takes that run's
settings from it (:func:`resumed_config`) except the options typed again.
"""

from __future__ import annotations

import shutil
import uuid
from pathlib import Path
from typing import Collection, List

from tzrec_bench.data import DATASETS
from tzrec_bench.train import checkpoint
from tzrec_bench.train.config import ConfigError, TrainConfig
from tzrec_bench.train.strategies import BEST_SHARDS, CHECKPOINT_SHARDS

METRICS_FILE = "metrics.json"
HISTORY_FILE = "history.json"
PLOT_FILE = "curves.png"
#: everything a run writes in its folder (a write in progress adds ``.partial`` to a name)
RUN_FILES = (checkpoint.CHECKPOINT, checkpoint.BEST, CHECKPOINT_SHARDS, BEST_SHARDS,
             METRICS_FILE, HISTORY_FILE, PLOT_FILE)


class RunFolderError(ValueError):
    """An ``--out-dir`` holding an earlier run's files that this run would mix with; the
    message names the files and how to go on."""


def new_run_id() -> str:
    return uuid.uuid4().hex


def earlier_files(folder: Path) -> List[str]:
    """The names of :data:`RUN_FILES` (and their ``.partial`` forms) present in ``folder``."""
    names = [name for base in RUN_FILES for name in (base, base + ".partial")]
    return [name for name in names if (folder / name).exists()]


def check(config: TrainConfig) -> None:
    """Raises :class:`RunFolderError` when ``config.out_dir`` holds files of another run
    than this one: any run file for a new run (unless ``--overwrite``), and for
    ``--resume`` run files without the ``checkpoint.pt`` to continue from."""
    folder = Path(config.out_dir)
    found = earlier_files(folder)
    if not found or config.overwrite:
        return
    if config.resume and (folder / checkpoint.CHECKPOINT).is_file():
        return
    where, listed = config.shown("out_dir"), ", ".join(found)
    if config.resume:
        raise RunFolderError(
            f"--resume: {where} has no {checkpoint.CHECKPOINT} to continue from, only an "
            f"earlier run's files ({listed}); --overwrite replaces them with a new run, or "
            "choose another --out-dir"
        )
    raise RunFolderError(
        f"--out-dir: {where} holds an earlier run's files ({listed}); a new run does not mix "
        "with them: --overwrite replaces them, --resume continues that run, or choose "
        "another --out-dir"
    )


def clear(folder: Path) -> List[str]:
    """Removes every run file in ``folder`` (nothing else); returns the names removed."""
    found = earlier_files(folder)
    for name in found:
        path = folder / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()
    return found


def resumed_config(config: TrainConfig, given: Collection[str]) -> TrainConfig:
    """The settings of a resumed run: those stored in ``config.out_dir``'s checkpoint.pt,
    but for the options in ``given`` (those typed on the command line), which are taken
    from ``config`` (``--max-steps`` and ``--epochs`` both, when either is typed).
    ``config`` as is when there is no checkpoint.pt (a new run).

    Raises:
        CheckpointError: checkpoint.pt cannot be read, or holds settings this version does
            not know.
        ConfigError: ``--data`` given as another data set than the checkpoint's (a named
            set differs from any other data; a moved log is compared by content later).
    """
    path = Path(config.out_dir) / checkpoint.CHECKPOINT
    if not path.is_file():
        return config
    stored = checkpoint.load(path)["config"]
    try:
        saved = TrainConfig.from_dict(stored)
    except (TypeError, ValueError) as exc:
        raise checkpoint.CheckpointError(f"{path}: its settings are not those of this "
                                          f"version ({exc})") from None
    if "data" in given and config.data != saved.data and (
        config.data in DATASETS or saved.data in DATASETS
    ):
        raise ConfigError("data", f"{config.data} here but {saved.shown('data')} in {path}: "
                          "a resumed run trains on its own data (leave --data out to take "
                          "the checkpoint's, or start a new run in another --out-dir)")
    # --max-steps and --epochs say together how long the run is: either typed sets both
    length = {"max_steps", "epochs"}
    kept = {field: getattr(config, field)
            for field in {*given, *(length if length & set(given) else ())}}
    kept.update(out_dir=config.out_dir, resume=True, overwrite=config.overwrite)
    return saved.replaced(**kept)
