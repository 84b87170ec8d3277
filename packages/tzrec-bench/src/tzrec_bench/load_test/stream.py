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
        index (int): its place in the stream (due at ``index / rate`` seconds).
        user (int): the user.
        kind (str): ``"open"`` (first sight: ``item_ids`` is the starting history),
            ``"extend"`` (new events) or ``"score"`` (``item_ids`` are the candidates of a
            ranking model; empty for ``recommend``).
        item_ids (torch.Tensor): [n] int64.
        timestamps (torch.Tensor): [n] int64 (events only).
        actions (torch.Tensor): [n] int64 action bitmasks (events of a ranking model).
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
    was served (the newest events the model takes) and what the session answered."""

    request: Request
    item_ids: torch.Tensor
    timestamps: torch.Tensor
    actions: torch.Tensor
    served: Optional[Tuple[torch.Tensor, ...]] = None


def make_stream(args: argparse.Namespace, count: int) -> Tuple[List[Request], List[Check]]:
    """``count`` requests drawn from ``args`` (seeded), and the scoring requests to check.

    Request i happens at simulated time ``i * GAP_S`` seconds: its new events carry that
    time, a starting history ends at it (one event per ``GAP_S`` before). The histories
    are followed on the host (the newest ``--max-history`` events, as the session keeps
    them), so every ``--check-every``-th scoring request carries the history it is served
    against.
    """
    gen = torch.Generator().manual_seed(args.seed)
    weights = torch.arange(1, args.users + 1, dtype=torch.float64).pow(-args.zipf)
    users = torch.multinomial(weights, count, replacement=True, generator=gen).tolist()
    extend = (torch.rand(count, generator=gen, dtype=torch.float64) < args.extend_fraction)
    ranking = args.model == "ranking"
    histories: Dict[int, Tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
    requests: List[Request] = []
    checks: List[Check] = []
    scored = 0
    empty = torch.zeros(0, dtype=torch.int64)
    for i, user in enumerate(users):
        now = i * GAP_S
        if user not in histories or bool(extend[i]):
            first = user not in histories
            n = args.history if first else int(torch.randint(1, args.events + 1, (1,),
                                                             generator=gen))
            ids = torch.randint(0, args.items, (n,), generator=gen)
            times = (now - GAP_S * torch.arange(n - 1, -1, -1)) if first else torch.full((n,), now)
            actions = torch.randint(0, 8, (n,), generator=gen)
            requests.append(Request(i, user, "open" if first else "extend", ids, times, actions))
            if first:
                histories[user] = (ids, times, actions)
            else:
                histories[user] = tuple(  # type: ignore[assignment]
                    torch.cat([old, new])[-args.max_history:]
                    for old, new in zip(histories[user], (ids, times, actions))
                )
            continue
        cands = empty
        if ranking:
            cands = torch.randint(0, args.items, (args.candidates,), generator=gen)
        req = Request(i, user, "score", cands, empty, empty)
        requests.append(req)
        if scored % args.check_every == 0:
            checks.append(Check(req, *histories[user]))
        scored += 1
    return requests, checks


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
