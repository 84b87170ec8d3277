"""The opened users of a :class:`~tzrec_gr.serving.ServingSession`: what it keeps per user,
and the batch cache it assembles from those rows for a request.

Legend: B = users, E = embedding width, C = contextual prefix length, Fc = contextual
feature width.

Each user keeps the events so far on the CPU (what ``extend`` appends to, what ``recommend``
excludes) and their encoded rows on the device (every STU layer's keys and values, the
query time, the contextual features, the retrieval user embedding). A request for opened
users concatenates their rows into one :class:`~tzrec_gr.serving.ServingCache`; the last one
is kept, so the same users, unchanged, asking again reuse it (a CUDA graph then skips
copying it into its buffers).

A user whose new events cannot be appended to the encoded rows (the model's time encoding
or contextual prefix, or a history past the model's bound) is kept *stale*
(:meth:`UserStore.defer`): the events and query time are kept, the encoded rows dropped,
and the session encodes the whole history again when the rows are next needed
(:func:`stored_histories` gives what to encode), once however many extends came before.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import (
    TYPE_CHECKING,
    Callable,
    Dict,
    Hashable,
    Iterable,
    List,
    Optional,
    Sequence,
    Tuple,
    Union,
)

import torch

from tzrec_gr.serving._host import joined_rows, lengths_and_offsets
from tzrec_gr.serving.inputs import Histories
from tzrec_gr.stu import ServingCache
from tzrec_ops.jagged import host_copy

if TYPE_CHECKING:  # the session passes its server; the server's module needs nothing here
    from tzrec_gr.serving.server import ModelServer

__all__ = [
    "UserIds",
    "UserState",
    "UserStore",
    "joined",
    "longer_histories",
    "stored_histories",
    "user_list",
]

UserIds = Union[Sequence[Hashable], torch.Tensor]
_versions = itertools.count()


@dataclasses.dataclass
class UserState:
    """One opened user: the events so far (CPU) and their encoded rows (device); a
    ``stale`` user has no encoded rows (``keys`` and ``values`` empty, ``length`` 0)
    until the session encodes its events again."""

    item_ids: torch.Tensor
    timestamps: torch.Tensor
    actions: Optional[torch.Tensor]
    contextual: Optional[torch.Tensor]  # [C * Fc] device
    query_time: Optional[torch.Tensor]  # 0-D device
    request_time: Optional[int]  # the same on the host (ranking)
    keys: Tuple[torch.Tensor, ...]
    values: Tuple[torch.Tensor, ...]
    length: int  # cached tokens
    user_embedding: Optional[torch.Tensor]  # [E] device (retrieval)
    version: int
    stale: bool = False


def user_list(name: str, user_ids: UserIds) -> List[Hashable]:
    """``user_ids`` as a list of distinct ids.

    Raises:
        ValueError: not a 1-D tensor or a sequence, or an id given twice (named).
    """
    if isinstance(user_ids, torch.Tensor):
        if user_ids.dim() != 1:
            raise ValueError(f"{name} must be 1-D, got shape {tuple(user_ids.shape)}")
        return user_ids.tolist()
    if isinstance(user_ids, (str, bytes)) or not isinstance(user_ids, Iterable):
        raise ValueError(f"{name} must be a sequence of user ids, got {type(user_ids).__name__}")
    ids = list(user_ids)
    seen = set()
    for i, u in enumerate(ids):
        if u in seen:
            raise ValueError(f"{name}[{i}] = {u!r} appears twice; give each user once")
        seen.add(u)
    return ids


def joined(
    old: Optional[torch.Tensor], new: Optional[torch.Tensor], start: int, stop: int, keep: int
) -> Optional[torch.Tensor]:
    """The newest ``keep`` of ``old`` followed by ``new[start:stop]`` (CPU), or None."""
    if old is None or new is None:
        return None
    return torch.cat([old, new[start:stop]])[-keep:]


def _on_host(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    return None if t is None else t.cpu()  # integer events: nothing to detach


def longer_histories(
    states: List[UserState],
    events: Histories,
    bound: int,
    *,
    actions: bool,
    query_time: bool,
) -> Histories:
    """The users' kept events followed by their new ``events`` (row b for ``states[b]``),
    each cut to its newest ``bound``, as one CPU :class:`Histories` (without contextual
    features: those stay with the users' state on the device), not checked again.

    Args:
        actions (bool): keep the action bitmasks (the server's ``needs_actions``).
        query_time (bool): set the query time (the server's ``keeps_query_time``): the
            events' own, else each user's newest event's time (or the kept request time of
            a user without new events).
    """
    offsets = events.offsets.tolist()
    new = [_on_host(t) for t in (events.item_ids, events.timestamps, events.actions)]
    longer = [
        tuple(
            joined(old, rows, offsets[b], offsets[b + 1], bound)
            for old, rows in zip((s.item_ids, s.timestamps, s.actions), new)
        )
        for b, s in enumerate(states)
    ]
    if events.query_time is not None:
        times = events.query_time.cpu()
    else:
        times = torch.tensor(
            [
                int(ts[-1])
                if ts.numel()  # type: ignore[union-attr]
                else s.request_time
                if s.request_time is not None
                else 0
                for (_, ts, _), s in zip(longer, states)
            ]
        )
    return Histories.of_checked(
        torch.tensor([h[0].numel() for h in longer], dtype=torch.int64),  # type: ignore[union-attr]
        item_ids=joined_rows([h[0] for h in longer]),  # type: ignore[misc]
        timestamps=joined_rows([h[1] for h in longer]),  # type: ignore[misc]
        actions=joined_rows([h[2] for h in longer]) if actions else None,  # type: ignore[misc]
        query_time=times if query_time else None,
    )


def stored_histories(states: List[UserState], *, query_time: bool) -> Histories:
    """The users' kept events (row b for ``states[b]``) as one :class:`Histories` (on the
    CPU, but for the contextual features, which stay on the device): what encoding them
    again takes. Not checked again: they were checked when they came.

    Args:
        query_time (bool): set each user's kept request time as the query time (the
            server's ``keeps_query_time``).
    """
    actions = [s.actions for s in states]
    contextual = [s.contextual for s in states]
    return Histories.of_checked(
        torch.tensor([s.item_ids.numel() for s in states], dtype=torch.int64),
        item_ids=joined_rows([s.item_ids for s in states]),
        timestamps=joined_rows([s.timestamps for s in states]),
        actions=None if actions[0] is None else joined_rows(actions),  # type: ignore[arg-type]
        contextual=None if contextual[0] is None else torch.stack(contextual),  # type: ignore[arg-type]
        query_time=(
            torch.tensor([s.request_time or 0 for s in states], dtype=torch.int64)
            if query_time
            else None
        ),
    )


class UserStore:
    """The opened users, in the order they were opened, and the last assembled batch.

    Args:
        device (torch.device): where the encoded rows live.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.users: Dict[Hashable, UserState] = {}
        self._group: Optional[Tuple[Tuple[Tuple[Hashable, int], ...], ServingCache]] = None

    def __contains__(self, user_id: Hashable) -> bool:
        return user_id in self.users

    def __len__(self) -> int:
        return len(self.users)

    def forget(self, ids: Iterable[Hashable]) -> None:
        """Drop these users (unknown ids are ignored)."""
        for u in ids:
            self.users.pop(u, None)
        self._group = None

    def forget_batch(self) -> None:
        """Drop the last assembled batch (its rows came from older weights)."""
        self._group = None

    def store(
        self,
        ids: List[Hashable],
        h: Histories,
        cache: ServingCache,
        request_time: Optional[torch.Tensor],
        *,
        reopen: bool = True,
    ) -> None:
        """Keep user ``ids[b]``'s events (row b of ``h``) and encoded rows (of ``cache``).

        Args:
            ids: the users, one per row of ``h`` and ``cache``.
            h (Histories): their whole histories (what the cache encodes).
            cache (ServingCache): the encoded histories.
            request_time (torch.Tensor | None): [B] CPU query times (ranking), else None.
            reopen (bool): the users move to the end of the opening order (``open`` and
                ``extend``); False keeps their place (a stale user encoded again).
                Default: True.
        """
        offsets = host_copy(cache.offsets).values.tolist()
        hoff = h.offsets.tolist()
        item_ids, timestamps, actions = (_on_host(t) for t in (h.item_ids, h.timestamps, h.actions))
        times = None if request_time is None else request_time.tolist()
        query_time = cache.query_time
        if query_time is None and request_time is not None:
            query_time = request_time.to(self.device)
        for b, u in enumerate(ids):
            start, stop = offsets[b], offsets[b + 1]
            es, ee = hoff[b], hoff[b + 1]
            if reopen:
                self.users.pop(u, None)  # re-opened users move to the end
            self.users[u] = UserState(
                item_ids=item_ids[es:ee],  # type: ignore[index]
                timestamps=timestamps[es:ee],  # type: ignore[index]
                actions=None if actions is None else actions[es:ee],
                contextual=None if cache.contextual is None else cache.contextual[b],
                query_time=None if query_time is None else query_time[b],
                request_time=None if times is None else times[b],
                keys=tuple(k[start:stop] for k in cache.keys),
                values=tuple(v[start:stop] for v in cache.values),
                length=stop - start,
                user_embedding=(
                    None if cache.user_embeddings is None else cache.user_embeddings[b]
                ),
                version=next(_versions),
            )
        self._group = None

    def defer(
        self,
        ids: List[Hashable],
        h: Histories,
        new_events: List[int],
        request_time: Optional[torch.Tensor],
    ) -> None:
        """Keep opened users ``ids[b]``'s events (row b of ``h``, their whole histories)
        without encoding them: the users become stale (their encoded rows dropped, their
        contextual features kept) and move to the end of the opening order. A user with
        no new events (``new_events[b] == 0``) and the same request time is left as it was.

        Args:
            ids: opened users, one per row of ``h``.
            h (Histories): their whole histories.
            new_events (List[int]): events each user got since it was kept.
            request_time (torch.Tensor | None): [B] CPU query times (ranking), else None.
        """
        hoff = h.offsets.tolist()
        item_ids, timestamps, actions = (_on_host(t) for t in (h.item_ids, h.timestamps, h.actions))
        times = None if request_time is None else request_time.tolist()
        for b, u in enumerate(ids):
            old = self.users[u]
            time = None if times is None else times[b]
            if new_events[b] == 0 and time == old.request_time:
                continue
            es, ee = hoff[b], hoff[b + 1]
            del self.users[u]  # extended users move to the end, as when encoded at once
            self.users[u] = UserState(
                item_ids=item_ids[es:ee],  # type: ignore[index]
                timestamps=timestamps[es:ee],  # type: ignore[index]
                actions=None if actions is None else actions[es:ee],
                contextual=old.contextual,
                query_time=None,
                request_time=time,
                keys=(),
                values=(),
                length=0,
                user_embedding=None,
                version=next(_versions),
                stale=True,
            )
        self._group = None

    def encoded(
        self,
        users: UserIds,
        states: List[UserState],
        server: ModelServer,
        prefill: Optional[Callable[[Histories], ServingCache]] = None,
    ) -> List[UserState]:
        """``states`` (of ``users``) with every stale user's kept history encoded again by
        ``prefill`` (default: ``server``'s ``prefill_histories`` on the store's device), in
        one call (the users keep their place in the opening order); ``states`` itself
        when none is stale."""
        stale = [b for b, s in enumerate(states) if s.stale]
        if not stale:
            return states
        ids = user_list("users", users)
        history = stored_histories([states[b] for b in stale], query_time=server.keeps_query_time)
        with torch.no_grad():
            if prefill is None:
                cache = server.prefill_histories(history, self.device)
            else:
                cache = prefill(history)
        again = [ids[b] for b in stale]
        self.store(again, history, cache, server.request_times(history), reopen=False)
        return [self.users[u] for u in ids]

    def states(self, name: str, users: UserIds) -> List[UserState]:
        """The opened users' states, in the order given.

        Raises:
            ValueError: ``users`` is empty, repeats a user or holds one not opened (named).
        """
        ids = user_list(name, users)
        if not ids:
            raise ValueError(f"{name} is empty; give at least one user")
        missing = [u for u in ids if u not in self.users]
        if missing:
            raise ValueError(
                f"{name} holds users that were not opened: {missing[:5]!r}; open them "
                "first (session.open(user_ids, histories)) or pass Histories"
            )
        return [self.users[u] for u in ids]

    def assemble(
        self, users: UserIds, states: List[UserState], *, timed: bool, owner: Optional[int]
    ) -> ServingCache:
        """The users' kept rows as one batch cache (the last one reused when the same
        users, unchanged, come again).

        Args:
            users: the users' ids, as given to :meth:`states`.
            states: their states.
            timed (bool): whether the model encodes time (the cache then holds the users'
                query times).
            owner (int | None): the cache's ``owner`` (the model's transducer).
        """
        key = tuple((u, s.version) for u, s in zip(user_list("users", users), states))
        if self._group is not None and self._group[0] == key:
            return self._group[1]
        if any(s.stale for s in states):
            raise RuntimeError("stale users have no encoded rows: encode them first")
        tokens = [s.length for s in states]
        lengths, offsets = lengths_and_offsets(tokens, self.device)
        layers = len(states[0].keys)
        qt = [s.query_time for s in states]
        ctx = [s.contextual for s in states]
        emb = [s.user_embedding for s in states]
        cache = ServingCache(
            keys=tuple(joined_rows([s.keys[i] for s in states]) for i in range(layers)),
            values=tuple(joined_rows([s.values[i] for s in states]) for i in range(layers)),
            offsets=offsets,
            lengths=lengths,
            query_time=(torch.stack(qt) if qt[0] is not None and timed else None),  # type: ignore[arg-type]
            contextual=torch.stack(ctx) if ctx[0] is not None else None,  # type: ignore[arg-type]
            user_embeddings=torch.stack(emb) if emb[0] is not None else None,  # type: ignore[arg-type]
            max_len=max(tokens),
            owner=owner,
        )
        self._group = (key, cache)
        return cache
