"""The load test's request stream, drawn before the clock starts, and its grouping into
session calls."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Dict, List, Optional, Tuple

import torch

__all__ = ["GAP_S", "Check", "Request", "make_stream"]

#: simulated seconds between two requests of the stream (the events' timestamps)
GAP_S = 60


@dataclasses.dataclass(frozen=True)
class Request:
    """One request of the stream.

    Attributes:
        index (int): its place in the stream (the opens first, served before the clock).
        user (int): the user.
        kind (str): ``"open"`` (``item_ids`` is the starting history),
            ``"extend"`` (new events) or ``"score"`` (``item_ids`` are the candidates of a
            model that scores candidates; empty for one that answers the top-k).
        item_ids (torch.Tensor): [n] int64.
        timestamps (torch.Tensor): [n] int64 (events only).
        actions (torch.Tensor): [n] int64 action bitmasks (events; read by a model that
            reads actions).
    """

    index: int
    user: int
    kind: str
    item_ids: torch.Tensor
    timestamps: torch.Tensor
    actions: torch.Tensor


@dataclasses.dataclass
class Check:
    """A scoring request to answer again with the full forward: the user's history when it
    was served (the newest events the model takes), the items of every event of the user
    so far (``seen``, sorted) and what the session answered."""

    request: Request
    item_ids: torch.Tensor
    timestamps: torch.Tensor
    actions: torch.Tensor
    seen: torch.Tensor
    served: Optional[Tuple[torch.Tensor, ...]] = None


def make_stream(args: argparse.Namespace, count: int) -> Tuple[List[Request], List[Check]]:
    """``count`` requests drawn from ``args`` (seeded) after the opening of their users, and
    the scoring requests to check.

    The stream starts with one ``"open"`` request per user it names (in the order of their
    first request, all at simulated time ``T0 = --history * GAP_S``: a ``--history``-event
    starting history, one event per ``GAP_S`` up to ``T0``), which the load test serves
    before the clock. Then come the ``count`` requests, each an ``"extend"`` (with
    probability ``--extend-fraction``) or a ``"score"``; request j of them happens at
    simulated time ``T0 + (j + 1) * GAP_S``, and its new events carry that time. The
    histories are followed on the host (the newest ``--max-history`` events, as the
    session keeps them), so every ``--check-every``-th scoring request carries the history
    it is served against. A scoring request carries ``--candidates`` candidates where the
    model scores candidates (``args.served``, set when the options are resolved).
    """
    gen = torch.Generator().manual_seed(args.seed)
    weights = torch.arange(1, args.users + 1, dtype=torch.float64).pow(-args.zipf)
    users = torch.multinomial(weights, count, replacement=True, generator=gen).tolist()
    extend = (torch.rand(count, generator=gen, dtype=torch.float64) < args.extend_fraction)
    candidates = args.served.candidates  # scoring requests carry candidates
    start = args.history * GAP_S
    histories: Dict[int, Tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
    seen: Dict[int, set] = {}
    opens: List[Request] = []
    for user in dict.fromkeys(users):  # once each, in order of first appearance
        n = args.history
        ids = torch.randint(0, args.items, (n,), generator=gen)
        times = start - GAP_S * torch.arange(n - 1, -1, -1)
        actions = torch.randint(0, 8, (n,), generator=gen)
        opens.append(Request(len(opens), user, "open", ids, times, actions))
        histories[user] = (ids, times, actions)
        seen[user] = set(ids.tolist())
    requests: List[Request] = []
    checks: List[Check] = []
    scored = 0
    empty = torch.zeros(0, dtype=torch.int64)
    for j, user in enumerate(users):
        index, now = len(opens) + j, start + (j + 1) * GAP_S
        if bool(extend[j]):
            n = int(torch.randint(1, args.events + 1, (1,), generator=gen))
            ids = torch.randint(0, args.items, (n,), generator=gen)
            times = torch.full((n,), now)
            actions = torch.randint(0, 8, (n,), generator=gen)
            requests.append(Request(index, user, "extend", ids, times, actions))
            seen[user].update(ids.tolist())
            histories[user] = tuple(  # type: ignore[assignment]
                torch.cat([old, new])[-args.max_history:]
                for old, new in zip(histories[user], (ids, times, actions))
            )
            continue
        cands = empty
        if candidates:
            cands = torch.randint(0, args.items, (args.candidates,), generator=gen)
        req = Request(index, user, "score", cands, empty, empty)
        requests.append(req)
        if scored % args.check_every == 0:
            checks.append(Check(req, *histories[user], torch.tensor(sorted(seen[user]))))
        scored += 1
    return opens + requests, checks


def _calls(window: List[Request], max_batch: int) -> List[Tuple[str, List[Request]]]:
    """The window's requests as session calls: one kind per call, at most ``max_batch``
    users, a user at most once per call, each user's requests in stream order (a request
    goes into the first call of its kind after its user's previous call)."""
    calls: List[Tuple[str, List[Request]]] = []
    members: List[set] = []
    last: Dict[int, int] = {}
    for req in window:
        start = last.get(req.user, -1) + 1
        for c in range(start, len(calls)):
            kind, group = calls[c]
            if kind == req.kind and req.user not in members[c] and len(group) < max_batch:
                break
        else:
            c = len(calls)
            calls.append((req.kind, []))
            members.append(set())
        calls[c][1].append(req)
        members[c].add(req.user)
        last[req.user] = c
    return calls
