"""A service's parts, loaded once: the model's session, the histories, the store, the
engine and the batcher (:func:`open_service`); nothing here needs the HTTP extra.

The model is a ``tzrec-bench train`` checkpoint loaded as ``predict`` loads it
(:func:`tzrec_bench.predict.load_session`: weights and vocabularies checked, a model with a
registered server); the users' histories come from the run's log
(:func:`tzrec_bench.predict_users.load_run_data`) and the database.
"""

from __future__ import annotations

import gc
import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from tzrec_bench.data import SequenceDataset
from tzrec_bench.predict_users import load_run_data
from tzrec_bench.service.batcher import Batcher
from tzrec_bench.service.engine import Engine
from tzrec_bench.service.histories import UserHistories
from tzrec_bench.service.store import EventStore

__all__ = ["Service", "ServiceError", "assemble_service", "freeze_heap", "open_service"]


class ServiceError(ValueError):
    """A model or data the service cannot serve (the message says why)."""


@dataclass
class Service:
    """What the HTTP layer serves.

    Attributes:
        engine: answers batches (:class:`~tzrec_bench.service.engine.Engine`).
        batcher: gathers requests for the engine; started by the app.
        limits: the model's :class:`~tzrec_gr.serving.files.Limits` (what a request may
            ask: ``predicts.takes_k``, ``max_candidates``, ``num_items``, ``tasks``).
        info: what ``GET /info`` answers (model and data fingerprints, model name, task).
        notes: lines worth printing at start (e.g. the data differs from the model's).
    """

    engine: Engine
    batcher: Batcher
    limits: Any
    info: Dict[str, Any]
    notes: List[str] = field(default_factory=list)

    @property
    def recommends(self) -> bool:
        """The model's predictions are each user's top ``k`` (``GET /recommend``)."""
        return bool(self.limits.predicts.takes_k)

    @property
    def scores(self) -> bool:
        """The model's predictions score given candidates (``POST /score``)."""
        return "candidates" in self.limits.predicts.columns

    def warm_up(self) -> Dict[str, Any]:
        """Capture the session's CUDA graphs of every batch bucket (up to ``max_batch``
        users) before the first request, so that no request waits for a capture or a
        Triton autotune (:meth:`~tzrec_gr.serving.ServingSession.warm_up`; on a CPU nothing
        is captured and the report says why). Returns the session's report."""
        session = self.engine.session
        most = self.batcher.max_batch
        smaller = [size for size in session.batch_buckets if size < most]
        holding = [size for size in session.batch_buckets if size >= most][:1]
        return session.warm_up(batch_sizes=smaller + holding)

    def close(self) -> None:
        """Stop the batcher, let the engine answer what is on its way, close the store."""
        self.batcher.stop()
        self.engine.close()
        self.engine.store.close()


def freeze_heap() -> bool:
    """Collect the garbage, then move every object left (the model, the session, the loaded
    histories, the imported modules) into the GC's permanent generation, so that a full
    collection while serving walks only what was made since instead of the whole heap (on
    a GPU server, hundreds of thousands of objects: tens of milliseconds, inside whichever
    request it falls in). Call it once warm-up is done. Returns True."""
    gc.collect()
    gc.freeze()
    return True


def file_digest(path: Path) -> str:
    """A BLAKE2 digest of a file's bytes (read in chunks)."""
    digest = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def open_service(checkpoint: str, data: Optional[str], db: str, *, device: Any = "cpu",
                 backend: Optional[str] = None, max_batch: int = 32,
                 max_wait_ms: float = 2.0, max_queue: int = 1024,
                 max_cached_users: int = 100_000, encode_graphs: bool = True,
                 max_pending: int = 4096) -> Service:
    """Load the model, the log and the database; the batcher is not started yet.
    ``encode_graphs``: the session's (False: whole histories encoded eagerly);
    ``max_pending``: the store's (appends waiting for the database before refusal).

    Raises:
        ServiceError: a model the service cannot answer by user id; CheckpointError,
            FileNotFoundError, DataFormatError, StoreMismatch: as their messages say.
    """
    from tzrec_bench.predict import load_session
    from tzrec_gr.checkpoint import resolve_checkpoint

    file = resolve_checkpoint(checkpoint)
    if not file.is_file():
        raise FileNotFoundError(f"RUN_OR_CHECKPOINT: no checkpoint at {file}")
    session, tasks, config = load_session(file, device, backend, encode_graphs=encode_graphs)
    vocabularies = session.vocabularies
    if vocabularies is None:
        raise ServiceError(f"{file} carries no id vocabulary; the service answers in the "
                           "log's raw ids (train it again with this version)")
    if session.server.predict_limits(tasks).contextual_width:
        raise ServiceError(f"{file}: the model reads contextual features besides the "
                           "histories, which the event log does not hold")
    run = load_run_data(config, data)
    dataset = run.dataset
    if session.server.needs_actions and dataset.actions is None:
        raise ServiceError(f"the model reads an action per event and {run.source} has none")
    notes = []
    differences = vocabularies.differences(dataset.id_vocabularies(run.source))
    if differences:
        notes.append(f"{run.source} is not the model's training data ({'; '.join(differences)})"
                     ": items the model does not know are left out of its input")
    # data without a fingerprint (a generated set) is told apart by its name
    service = assemble_service(session, tasks, dataset, db, source=run.source,
                               data_key=dataset.fingerprint or f"unfingerprinted {run.source}",
                               max_batch=max_batch, max_wait_ms=max_wait_ms,
                               max_queue=max_queue, max_cached_users=max_cached_users,
                               max_pending=max_pending)
    service.info.update({
        "model": config.get("model", type(session.model).__name__),
        "checkpoint": str(file),
        "model_fingerprint": file_digest(file),
        "training_data_fingerprint": vocabularies.fingerprint,
    })
    service.notes.extend(notes)
    return service


def assemble_service(session: Any, tasks: Optional[Sequence[str]], dataset: SequenceDataset,
                     db: str, *, source: str, data_key: str = "", max_batch: int = 32,
                     max_wait_ms: float = 2.0, max_queue: int = 1024,
                     max_cached_users: int = 100_000, max_pending: int = 4096) -> Service:
    """A service over a session and an event log already in memory (the batcher not
    started): what :func:`open_service` does after loading its checkpoint and log, and how
    the load test serves a model it built itself.

    Args:
        session: a :class:`~tzrec_gr.serving.ServingSession` with ``vocabularies`` (the
            answers are raw ids).
        tasks: a name per output of ``score`` (None: ``task_0``, ...).
        dataset: the users' histories before any appended event.
        db: the SQLite file of appended events (``":memory:"``: none kept).
        source: the log, in words (``/info``'s ``data``).
        data_key: what the database must have been made for (empty: no check).
        max_pending: appends waiting for the database's writer before more are refused
            (:class:`~tzrec_bench.service.store.EventStore`).
    """
    from tzrec_gr.serving.files import session_limits

    limits = session_limits(session, tasks)
    store = EventStore(db, data_key, max_pending=max_pending)
    histories = UserHistories(dataset, session.vocabularies.items, store.by_user(),
                              limits.max_events)
    engine = Engine(session, limits.tasks, histories, store, max_cached_users)
    batcher = Batcher(engine, max_batch=max_batch, max_wait_s=max_wait_ms / 1000.0,
                      max_queue=max_queue)
    info = {
        "model": type(session.model).__name__,
        "task": limits.kind,
        "data": source,
        "data_fingerprint": dataset.fingerprint,
        "items": limits.num_items,
        "max_events": limits.max_events,
        "max_candidates": limits.max_candidates,
        "tasks": list(limits.tasks),
        "users_in_log": len(dataset.user_raw_ids),
        "database": str(db),
        "device": str(session.device),
    }
    return Service(engine, batcher, limits, info)
