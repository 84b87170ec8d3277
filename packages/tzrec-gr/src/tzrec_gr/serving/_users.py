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
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Dict, Hashable, Iterable, List, Optional, Sequence, Tuple, Union

import torch

from tzrec_gr.serving.inputs import Histories
from tzrec_gr.stu import ServingCache
from tzrec_ops.jagged import host_copy, mirror, offsets_from_lengths, to_device

__all__ = ["UserIds", "UserState", "UserStore", "joined", "longer_histories", "user_list"]

UserIds = Union[Sequence[Hashable], torch.Tensor]
_versions = itertools.count()


@dataclasses.dataclass
class UserState:
    """One opened user: the events so far (CPU) and their encoded rows (device)."""

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
    return torch.cat([old, new[start:stop].detach().cpu()])[-keep:]


def longer_histories(
    states: List[UserState],
    events: Histories,
    bound: int,
    *,
    actions: bool,
    query_time: bool,
) -> Histories:
    """The users' kept events followed by their new ``events`` (row b for ``states[b]``),
    each cut to its newest ``bound``, as one CPU :class:`Histories`.

    Args:
        actions (bool): keep the action bitmasks (the server's ``needs_actions``).
        query_time (bool): set the query time (the server's ``keeps_query_time``): the
            events' own, else each user's newest event's time (or the kept request time of
            a user without new events).
    """
    offsets = events.offsets
    longer = [
        tuple(
            joined(old, new, int(offsets[b]), int(offsets[b + 1]), bound)
            for old, new in (
                (s.item_ids, events.item_ids),
                (s.timestamps, events.timestamps),
                (s.actions, events.actions),
            )
        )
        for b, s in enumerate(states)
    ]
    if events.query_time is not None:
        times = events.query_time.detach().cpu()
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
    return Histories(
        item_ids=torch.cat([h[0] for h in longer]),  # type: ignore[misc]
        lengths=torch.tensor([h[0].numel() for h in longer], dtype=torch.int64),  # type: ignore[union-attr]
        timestamps=torch.cat([h[1] for h in longer]),  # type: ignore[misc]
        actions=torch.cat([h[2] for h in longer]) if actions else None,  # type: ignore[misc]
        contextual=(
            None
            if states[0].contextual is None
            else torch.stack([s.contextual for s in states]).cpu()  # type: ignore[misc]
        ),
        query_time=times if query_time else None,
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
    ) -> None:
        """Keep user ``ids[b]``'s events (row b of ``h``) and encoded rows (of ``cache``).

        Args:
            ids: the users, one per row of ``h`` and ``cache``.
            h (Histories): their whole histories (what the cache encodes).
            cache (ServingCache): the encoded histories.
            request_time (torch.Tensor | None): [B] CPU query times (ranking), else None.
        """
        offsets = host_copy(cache.offsets).values
        hoff = h.offsets
        query_time = cache.query_time
        if query_time is None and request_time is not None:
            query_time = request_time.to(self.device)
        for b, u in enumerate(ids):
            start, stop = int(offsets[b]), int(offsets[b + 1])
            es, ee = int(hoff[b]), int(hoff[b + 1])
            self.users.pop(u, None)  # re-opened users move to the end
            self.users[u] = UserState(
                item_ids=h.item_ids[es:ee].detach().cpu(),
                timestamps=h.timestamps[es:ee].detach().cpu(),
                actions=None if h.actions is None else h.actions[es:ee].detach().cpu(),
                contextual=None if cache.contextual is None else cache.contextual[b],
                query_time=None if query_time is None else query_time[b],
                request_time=None if request_time is None else int(request_time[b]),
                keys=tuple(k[start:stop] for k in cache.keys),
                values=tuple(v[start:stop] for v in cache.values),
                length=stop - start,
                user_embedding=(
                    None if cache.user_embeddings is None else cache.user_embeddings[b]
                ),
                version=next(_versions),
            )
        self._group = None

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
        lengths_host = torch.tensor([s.length for s in states], dtype=torch.int64)
        lengths = to_device(lengths_host, self.device)
        layers = len(states[0].keys)
        qt = [s.query_time for s in states]
        ctx = [s.contextual for s in states]
        emb = [s.user_embedding for s in states]
        cache = ServingCache(
            keys=tuple(torch.cat([s.keys[i] for s in states]) for i in range(layers)),
            values=tuple(torch.cat([s.values[i] for s in states]) for i in range(layers)),
            offsets=mirror(offsets_from_lengths, lengths),
            lengths=lengths,
            query_time=(torch.stack(qt) if qt[0] is not None and timed else None),  # type: ignore[arg-type]
            contextual=torch.stack(ctx) if ctx[0] is not None else None,  # type: ignore[arg-type]
            user_embeddings=torch.stack(emb) if emb[0] is not None else None,  # type: ignore[arg-type]
            max_len=int(lengths_host.max()),
            owner=owner,
        )
        self._group = (key, cache)
        return cache
