"""Checkpoint files and random-number-generator state.

A run's folder holds ``checkpoint.pt`` (the latest state: model, optimizer, scheduler, step,
early-stopping state, history, and every rank's RNG state) and ``best.pt`` (the model at the
best validation metric; under ``--ema-decay``, the averaged weights, which checkpoint.pt
holds as ``average`` beside the trained ones). A run with sharded tables (``--sharding
torchrec``) keeps its model and optimizer states in ``checkpoint.dcp/`` (each rank's shards,
written with ``torch.distributed.checkpoint``), named by the ``sharded`` entry of
``checkpoint.pt``; its ``best.pt`` is the plain model, gathered at the end of the run. The
data position is the step: the order of epoch ``e`` is a permutation seeded by ``(seed, e)``,
so a resumed run recomputes it and skips the batches already trained on. Files are written to
a temporary name and renamed, so an interrupted write never leaves a truncated checkpoint
behind; a file damaged later, or one of another kind, is refused by :func:`load` with a
:class:`CheckpointError` naming it. Every file of a run carries the run's id (:data:`RUN_ID`),
so that a resumed run never takes a best.pt that another run left (:func:`check_same_run`).
The format and the files' names are
:mod:`tzrec_gr.checkpoint`'s, which serving and tzrec-acc read through.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple, Union

import numpy as np
import torch

from tzrec_bench.data import DATASETS
from tzrec_bench.data.event_log import Columns
from tzrec_gr.checkpoint import (
    BEST,
    CHECKPOINT,
    FORMAT,
    CheckpointError,
    read_payload,
    write_payload,
)
from tzrec_gr.vocabulary import IdVocabularies, VocabularyError

__all__ = ["BEST", "CHECKPOINT", "FORMAT", "RUN_ID", "CheckpointError", "DataMismatchError",
           "RunFiles", "check_same_data", "check_same_run", "load"]
# what every file written by the trainer holds, and what a checkpoint.pt holds besides
# (what --resume restores); best.pt holds the first set (and model_config, metrics)
KEYS: Tuple[str, ...] = ("config", "step", "model")
RESUME_KEYS: Tuple[str, ...] = ("optimizer", "scheduler", "early_stopping", "history", "rng")
#: a sharded checkpoint.pt names its folder of shards here instead of holding the states
SHARDED = "sharded"
SHARDED_STATES = ("model", "optimizer")
#: checkpoint.pt's averaged weights under --ema-decay (train/averaging.py), beside ``model``
#: (the trained weights, which --resume goes on from); best.pt's ``model`` is the average
AVERAGE = "average"
#: the entry of every file a run writes that names the run (a random hex string)
RUN_ID = "run_id"
EXPECTED = f"a {CHECKPOINT} or {BEST} written by `tzrec-bench train`"


class DataMismatchError(ValueError):
    """Data that is not the data a checkpoint was trained on (other items, users or events):
    refused by ``evaluate`` and ``--resume`` rather than scored; the message says what
    differs."""


def check_same_data(payload: Dict[str, Any], path: Path, data: IdVocabularies,
                    what: str, columns: Optional[str] = None) -> None:
    """Raises :class:`DataMismatchError` when ``data`` (the vocabularies of the data at
    hand, read with the ``--columns`` mapping ``columns``) is not what the checkpoint
    ``payload`` (read from ``path``) was trained on.

    A checkpoint written before vocabularies were saved is compared by its item count. When
    the mapping differs from the checkpoint's, the message says so first: other columns
    read other events, which is the cause, not a changed log.
    """
    try:
        saved = IdVocabularies.from_payload(payload, str(path))
    except VocabularyError as exc:
        raise CheckpointError(str(exc)) from exc
    if saved is None:
        kwargs = payload.get("model_config", {}).get("kwargs", {})
        num_items = kwargs.get("num_items")
        found = ([] if num_items in (None, len(data.items))
                 else [f"{len(data.items)} items instead of {num_items}"])
        source = "its training data"
    else:
        found = saved.differences(data)
        source = saved.source or "its training data"
    trained_on = payload.get("config", {})
    if found and trained_on.get("data") not in DATASETS:  # a named set maps no columns
        found = _columns_first(found, trained_on.get("columns"), columns)
    if found:
        raise DataMismatchError(
            f"{what}: {data.source} is not the data {path} was trained on ({source}): "
            + "; ".join(found)
        )


def _columns_first(found: List[str], saved: Optional[str], given: Optional[str]) -> List[str]:
    """``found`` led by the difference of the two ``--columns`` mappings, if they differ;
    the events' fingerprint then differs because of it and is not named apart."""
    try:
        same = Columns.parse(saved) == Columns.parse(given)
    except ValueError:  # a mapping this version does not read: compare the text
        same = saved == given
    if same:
        return found

    def shown(text: Optional[str]) -> str:
        default = ",".join(p for p in Columns().text().split(",") if not p.endswith("="))
        return text if text else f"the default {default}"

    return [f"the columns differ (--columns {shown(given)} here, {shown(saved)} in "
            "training)", *(d for d in found if not d.startswith("the events differ"))]


def check_same_run(payload: Dict[str, Any], path: Path, run_id: Optional[str],
                   resumed: Path) -> None:
    """Raises :class:`CheckpointError` unless the file ``path`` (its ``payload``) belongs to
    the run of ``resumed`` (its checkpoint.pt), whose id is ``run_id``."""
    theirs = payload.get(RUN_ID)
    if theirs != run_id:
        raise CheckpointError(
            f"{path}: written by another run than {resumed} (run id {theirs or 'none'}, "
            f"not {run_id or 'none'}); a run's folder holds one run: remove {path.name} to "
            "resume, or start a new run with --overwrite"
        )


def seed_everything(seed: int) -> None:
    """Seeds Python's, NumPy's and torch's global generators (CUDA's too)."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def capture_rng() -> Dict[str, Any]:
    """This process's global RNG states, as tensors and tuples (loadable with weights_only)."""
    numpy_state = np.random.get_state(legacy=False)
    state: Dict[str, Any] = {
        "python": random.getstate(),
        "numpy_key": torch.from_numpy(numpy_state["state"]["key"].astype(np.int64)),
        "numpy_rest": (
            int(numpy_state["state"]["pos"]),
            int(numpy_state["has_gauss"]),
            float(numpy_state["gauss"]),
        ),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: Dict[str, Any]) -> None:
    """Puts back what :func:`capture_rng` took."""
    random.setstate(_as_tuples(state["python"]))
    pos, has_gauss, gauss = state["numpy_rest"]
    np.random.set_state(
        {
            "bit_generator": "MT19937",
            "state": {"key": state["numpy_key"].numpy().astype(np.uint32), "pos": pos},
            "has_gauss": has_gauss,
            "gauss": gauss,
        }
    )
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _as_tuples(value: Any) -> Any:
    # random.setstate needs tuples; a state saved by torch may come back with lists
    if isinstance(value, (list, tuple)):
        return tuple(_as_tuples(v) for v in value)
    return value


class RunFiles:
    """A run's folder, where rank 0 writes :data:`CHECKPOINT` and :data:`BEST`.

    Args:
        folder: the run's ``--out-dir``.
        description: what every file holds besides states: ``config`` (the run's settings),
            ``model_config`` (the model's class and constructor arguments, which tzrec-acc
            rebuilds it from) and the data's id vocabularies.
        is_main: whether this process writes (rank 0).
    """

    def __init__(self, folder: Path, description: Dict[str, Any], is_main: bool) -> None:
        self.folder = folder
        self.description = description
        self.is_main = is_main

    def payload(self, step: Optional[int], **entries: Any) -> Dict[str, Any]:
        """The dict a :data:`CHECKPOINT` or :data:`BEST` holds: the description, ``step``
        and ``entries`` (best.pt: ``metrics`` and ``model``; checkpoint.pt: ``world_size``,
        the states and :data:`RESUME_KEYS`)."""
        return {**self.description, "step": step, **entries}

    def write(self, name: str, step: Optional[int], **entries: Any) -> None:
        """Rank 0 writes :meth:`payload` to ``name`` in the folder; other ranks do nothing."""
        if self.is_main:
            write_payload(self.folder / name, self.payload(step, **entries))


def load(path: Union[str, Path]) -> Dict[str, Any]:
    """A checkpoint's payload, tensors on the CPU.

    A file named :data:`CHECKPOINT` must hold what ``--resume`` restores (:data:`KEYS` and
    :data:`RESUME_KEYS`, less the model and optimizer when its :data:`SHARDED` entry names
    the folder that holds them); any other name, :data:`KEYS` (what ``evaluate`` reads).

    Raises:
        FileNotFoundError: no file at ``path``.
        CheckpointError: a file torch cannot load (truncated or damaged), not a dict of
            format :data:`FORMAT`, or missing keys; one line naming ``path``.
    """
    path = Path(path)
    payload = read_payload(path, EXPECTED, required=())
    # the entries a file needs depend on its name and, for checkpoint.pt, on its content
    keys = (*KEYS, *(RESUME_KEYS if path.name == CHECKPOINT else ()))
    if path.name == CHECKPOINT and isinstance(payload.get(SHARDED), dict):
        keys = tuple(k for k in keys if k not in SHARDED_STATES)
    missing = [key for key in keys if key not in payload]
    if missing:
        raise CheckpointError(f"{path}: no {', '.join(missing)} in the file; expected {EXPECTED}")
    for key in ("config", "model"):
        if key in payload and not isinstance(payload[key], dict):
            raise CheckpointError(
                f"{path}: its {key} is a {type(payload[key]).__name__}, not a dict; "
                f"expected {EXPECTED}"
            )
    return payload
