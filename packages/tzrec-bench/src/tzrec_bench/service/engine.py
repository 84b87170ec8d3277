"""The service's answers, without HTTP: requests in, a serving session's calls out.

:class:`Engine` is the :class:`~tzrec_bench.service.batcher.Batcher`'s handler: it takes a
batch of requests, splits it into runs one session call answers (same kind of call and
options, no user twice: :func:`~tzrec_bench.service.batcher.split_in_order`) and answers
them in order. It alone touches the session, the histories and the store (on the batcher's
one thread), so a user's requests see each other's effects in arrival order.

Users are opened in the session lazily, at their first request after a start, from their
whole history (:class:`~tzrec_bench.service.histories.UserHistories`), and at most
``max_cached_users`` stay open (the least recently used are closed). Appended events are
submitted to the store's writer first, then laid on the histories, then (for an open user)
given to the session's ``extend``; if that fails the user is closed and encoded again at
the next request, from the stored events. The request's answer is a future that is done
once the writer has committed the events, so the acknowledgement follows the commit while
this thread goes on answering (a user's later requests already see the events). Should a
commit fail, its events are taken off the users' histories at the next batch and those
users are encoded again; the store then refuses further events.

Scores and top-k lists are futures too: a session call only queues device work, so the
engine queues the copy of its results to the host behind it
(:class:`~tzrec_bench.service.in_flight.InFlight`) and goes on to the next run or batch;
the answers' thread waits for the copies, in order, and makes the answers. Stream order
keeps them exact: later calls' work runs after the copies queued before it.
"""

from __future__ import annotations

import queue
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from tzrec_bench.service.batcher import Overloaded, split_in_order
from tzrec_bench.service.histories import UserHistories
from tzrec_bench.service.in_flight import InFlight
from tzrec_bench.service.store import EventStore, StoredEvent, StoreFailed
from tzrec_gr.serving import Histories

__all__ = ["BadRequest", "Engine", "Events", "NotFound", "Recommend", "Score"]


class BadRequest(ValueError):
    """A request that cannot be answered as given (422), naming the field."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


class NotFound(LookupError):
    """A request about something the service does not know (404), naming the field."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


@dataclass(frozen=True)
class Recommend:
    """The top ``k`` items for ``user`` (a raw id)."""

    user: Any
    k: int
    exclude_seen: bool = True


@dataclass(frozen=True)
class Score:
    """Per-task probabilities of ``candidates`` (raw item ids) for ``user``."""

    user: Any
    candidates: Tuple[Any, ...]


@dataclass(frozen=True)
class Events:
    """New events of ``user``: raw item ids, times (None: now) and actions (None: none)."""

    user: Any
    items: Tuple[Any, ...]
    timestamps: Optional[Tuple[int, ...]] = None
    actions: Optional[Tuple[int, ...]] = None


def _key(request: Any) -> Any:
    if isinstance(request, Recommend):
        return ("recommend", request.k, request.exclude_seen)
    return type(request).__name__


class Engine:
    """Answers batches of :class:`Recommend`, :class:`Score` and :class:`Events`.

    Args:
        session: a :class:`~tzrec_gr.serving.ServingSession` with the checkpoint's
            vocabularies.
        tasks: a name per output of ``score`` (its :class:`Limits`' ``tasks``).
        histories: the users' histories.
        store: where appended events are kept.
        max_cached_users: users kept open in the session at most.

    Attributes:
        counters (dict): ``cache_hits``, ``cache_misses`` (users opened again),
            ``unknown_items`` (appended events whose item the model does not know),
            ``fallbacks`` (answers of popular items).
    """

    def __init__(self, session: Any, tasks: Sequence[str], histories: UserHistories,
                 store: EventStore, max_cached_users: int = 100_000) -> None:
        self.session = session
        self.tasks = tuple(tasks)
        self.histories = histories
        self.store = store
        self.max_cached_users = max_cached_users
        self.needs_actions = bool(session.server.needs_actions)
        self.num_items = len(histories.items)
        self._open: "OrderedDict[Any, None]" = OrderedDict()
        self.counters = {"cache_hits": 0, "cache_misses": 0, "unknown_items": 0,
                         "fallbacks": 0}
        # (user, events) whose commit failed, told by the writer thread; undone here
        self._uncommitted: "queue.SimpleQueue[Tuple[Any, int]]" = queue.SimpleQueue()
        # makes the answers of results on their way from the device, one call at a time
        # (started at the first such call, again after close)
        self._answers: Optional[ThreadPoolExecutor] = None

    def close(self) -> None:
        """Answer what is on its way, then stop the answers' thread."""
        if self._answers is not None:
            self._answers.shutdown(wait=True)
            self._answers = None

    def __call__(self, requests: Sequence[Any]) -> List[Any]:
        """One answer (a dict, or an exception) per request, in order."""
        self._undo_uncommitted()
        answers: List[Any] = [None] * len(requests)
        for run in split_in_order(requests, _key, lambda r: r.user):
            batch = [requests[i] for i in run]
            try:
                if isinstance(batch[0], Recommend):
                    out = self._recommend(batch)
                elif isinstance(batch[0], Score):
                    out = self._score(batch)
                else:
                    out = self._events(batch)
            except Exception as exc:  # this run fails; the batch's other runs are answered
                out = [exc] * len(batch)
            for i, answer in zip(run, out):
                answers[i] = answer
        return answers

    # -- users in the session --------------------------------------------------------------

    def _opened(self, users: Sequence[Any]) -> List[bool]:
        """Open the users not open (from their whole history); which have a model input."""
        session = self.session
        missing, inputs = [], []
        for user in users:
            if user in session:
                self.counters["cache_hits"] += 1
                self._open.move_to_end(user)
                continue
            found = self.histories.model_input(user)
            if found is not None:
                missing.append(user)
                inputs.append(found)
        if missing:
            self.counters["cache_misses"] += len(missing)
            rows, times, actions = (list(part) for part in zip(*inputs))
            session.open(missing, Histories.from_lists(
                rows, times, actions if self.needs_actions else None))
            for user in missing:
                self._open[user] = None
            self._evict(set(users))
        return [user in session for user in users]

    def _evict(self, keep: set) -> None:
        extra = len(self._open) - self.max_cached_users
        if extra > 0:
            old = [u for u in self._open if u not in keep][:extra]
            self.session.close(old)
            for user in old:
                del self._open[user]

    def _undo_uncommitted(self) -> None:
        """Take the events of failed commits off their users' histories and close those
        users in the session (their caches hold the events)."""
        users = set()
        while True:
            try:
                user, count = self._uncommitted.get_nowait()
            except queue.Empty:
                break
            self.histories.drop_newest(user, count)
            users.add(user)
        opened = [user for user in users if user in self.session]
        if opened:
            self._close(opened)

    def _close(self, users: Sequence[Any]) -> None:
        self.session.close(list(users))
        for user in users:
            self._open.pop(user, None)

    # -- the three calls -------------------------------------------------------------------

    def _recommend(self, batch: List[Recommend]) -> List[Any]:
        users = [r.user for r in batch]
        k, exclude_seen = batch[0].k, batch[0].exclude_seen
        opened = self._opened(users)
        answers: Dict[int, Any] = {}
        served = [i for i, ok in enumerate(opened) if ok]
        if served:
            # the session leaves out the items of the events it holds (the newest the model
            # takes); the items of older events are seen too: ask for enough more to drop
            # them after (exact: the order of the rest does not change)
            older = [self.histories.older_items(users[i]) if exclude_seen else set()
                     for i in served]
            wanted = min(k + max(len(o) for o in older), self.num_items)
            top = self.session.recommend([users[i] for i in served], wanted,
                                         exclude_seen=exclude_seen)

            def ranked(host: List[torch.Tensor]) -> List[Any]:
                rows, scores = host[0].tolist(), host[1].float().tolist()
                out = []
                for i, seen, row_ids, row_scores in zip(served, older, rows, scores):
                    kept = [(r, s) for r, s in zip(row_ids, row_scores)
                            if r >= 0 and r not in seen][:k]
                    out.append({"user": users[i],
                                "items": self.histories.items.raw([r for r, _ in kept]),
                                "scores": [s for _, s in kept]})
                return out

            later = self._later(InFlight([top.ids, top.scores]), ranked, len(served))
            answers.update(zip(served, later))
        for i, ok in enumerate(opened):
            if not ok:
                self.counters["fallbacks"] += 1
                ids, scores = self.histories.popular(k)
                answers[i] = {"user": users[i], "items": ids, "scores": scores,
                              "fallback": "popular"}
        return [answers[i] for i in range(len(batch))]

    def _score(self, batch: List[Score]) -> List[Any]:
        answers: List[Any] = [None] * len(batch)
        valid, rows = [], []
        for i, request in enumerate(batch):
            candidates = self.histories.item_rows(list(request.candidates))
            if -1 in candidates:
                p = candidates.index(-1)
                answers[i] = BadRequest(f"candidates[{p}]", f"item {request.candidates[p]!r} "
                                        "is not in the model's catalogue")
            elif not self.histories.known(request.user):
                answers[i] = NotFound("user", f"{request.user!r} has no events")
            else:
                valid.append(i)
                rows.append(candidates)
        opened = self._opened([batch[i].user for i in valid])
        for i, ok in zip(valid, opened):
            if not ok:
                answers[i] = NotFound("user", f"{batch[i].user!r} has no event of an item "
                                      "the model knows")
        served = [(i, r) for i, r, ok in zip(valid, rows, opened) if ok]
        if served:
            probs = self.session.score([batch[i].user for i, _ in served], [r for _, r in served])

            def scored(host: List[torch.Tensor]) -> List[Any]:
                out, start = [], 0
                for i, r in served:
                    part = host[0][start:start + len(r)].tolist()
                    start += len(r)
                    out.append({"user": batch[i].user, "candidates": list(batch[i].candidates),
                                "scores": {t: [p[j] for p in part]
                                           for j, t in enumerate(self.tasks)}})
                return out

            later = self._later(InFlight([probs]), scored, len(served))
            for (i, _), answer in zip(served, later):
                answers[i] = answer
        return answers

    def _later(self, flight: InFlight, make: Callable[[List[torch.Tensor]], List[Any]],
               count: int) -> List[Future]:
        """``count`` futures of the answers ``make`` builds from ``flight``'s results, set on
        the answers' thread once the results are on the host (every one fails with
        ``make``'s exception, if it raises)."""
        futures: List[Future] = [Future() for _ in range(count)]

        def settle() -> None:
            try:
                values = make(flight.wait())
            except Exception as exc:  # the run's requests fail; the service goes on
                for future in futures:
                    future.set_exception(exc)
                return
            for future, value in zip(futures, values):
                future.set_result(value)

        if self._answers is None:
            self._answers = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tzrec-answers")
        self._answers.submit(settle)
        return futures

    def _events(self, batch: List[Events]) -> List[Any]:
        answers: List[Any] = [None] * len(batch)
        accepted: List[Tuple[int, List[StoredEvent]]] = []
        for i, request in enumerate(batch):
            try:
                accepted.append((i, self._checked_events(request)))
            except BadRequest as exc:
                answers[i] = exc
        extend_ids, extend_rows = [], []
        for i, events in accepted:
            user = batch[i].user
            try:
                commit = self.store.submit(events)
            except (Overloaded, StoreFailed) as exc:
                answers[i] = exc
                continue
            rows = self.histories.item_rows([e.item for e in events])
            self.histories.add(user, events)
            unknown = [e.item for e, r in zip(events, rows) if r < 0]
            self.counters["unknown_items"] += len(unknown)
            answers[i] = self._acknowledged(commit, user, len(events), {
                "user": user, "stored": len(events), "unknown_items": unknown})
            known = [(r, e) for r, e in zip(rows, events) if r >= 0]
            if known and user in self.session:
                extend_ids.append(user)
                extend_rows.append(known)
        if extend_ids:
            self._extend(extend_ids, extend_rows)
        return answers

    def _acknowledged(self, commit: Future, user: Any, count: int, answer: Any) -> Future:
        """A future of ``answer`` once ``commit`` is done; a failed commit's exception
        instead, its events queued to be undone."""
        ack: Future = Future()

        def settle(done: Future) -> None:
            error = done.exception()
            if error is None:
                ack.set_result(answer)
            else:
                self._uncommitted.put((user, count))
                ack.set_exception(error)

        commit.add_done_callback(settle)
        return ack

    def _checked_events(self, request: Events) -> List[StoredEvent]:
        """The request's events to store; BadRequest naming the field otherwise."""
        n = len(request.items)
        newest = self.histories.newest(request.user)
        times = request.timestamps
        if times is None:
            now = max(int(time.time()), newest if newest is not None else 0)
            times = (now,) * n
        for name, values in (("timestamps", times), ("actions", request.actions)):
            if values is not None and len(values) != n:
                raise BadRequest(name, f"{len(values)} values for {n} items")
        for p in range(n):
            floor = newest if p == 0 else times[p - 1]
            if floor is not None and times[p] < floor:
                raise BadRequest(f"timestamps[{p}]", f"{times[p]} is older than the user's "
                                 f"event before it ({floor})")
        if self.needs_actions and request.actions is None:
            raise BadRequest("actions", "the model reads an action bitmask per event; give "
                             "one per item")
        actions = request.actions or (None,) * n
        return [StoredEvent(request.user, item, int(t), a)
                for item, t, a in zip(request.items, times, actions)]

    def _extend(self, users: List[Any], known: List[List[Tuple[int, StoredEvent]]]) -> None:
        events = Histories.from_lists(
            [[r for r, _ in k] for k in known], [[e.timestamp for _, e in k] for k in known],
            [[int(e.action or 0) for _, e in k] for k in known] if self.needs_actions else None)
        try:
            self.session.extend(users, events)
        except (ValueError, RuntimeError, torch.cuda.OutOfMemoryError):
            self._close(users)  # encoded again from the stored events at the next request
