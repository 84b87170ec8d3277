"""The eager part of :meth:`ServingSession.warm_up <tzrec_gr.serving.ServingSession.warm_up>`:
run the calls of encoding whole histories (``open``, extended users encoded again) and of
the incremental ``extend`` once per request shape, on synthetic histories, through the
session's CUDA graphs where they were captured and eager elsewhere, so that the backend's
kernels are compiled and autotuned before the first request instead of inside it.

Legend: B = users of a call, n = events per user, Δ = new events per user.

The Triton backend tunes each kernel per power of two of its batch and row counts (and of
the bound on sequence lengths), so running the powers of two between the smallest and the
largest sizes of the requests (with those two) covers every request in between.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from tzrec_gr.serving.inputs import Histories
from tzrec_gr.serving.server import ModelServer
from tzrec_gr.stu import ServingCache

__all__ = ["encoding_sizes", "synthetic_histories", "warm_up_encoding"]

#: seconds between two synthetic events
_GAP_S = 60


def synthetic_histories(server: ModelServer, users: int, events: int, start: int = 0) -> Histories:
    """Valid histories of the server's model for warming up: ``users`` users of ``events``
    events each, item ids cycling through the catalogue, one event every minute from
    ``start`` (seconds), zero actions and contextual features where the model reads them,
    queried at the newest event. Not a real user's: the answers are not meant to be read.
    """
    num_items = server.model.num_items
    total = users * events
    width = server.contextual_width
    return Histories(
        item_ids=torch.arange(total, dtype=torch.int64) % num_items,
        lengths=torch.full((users,), events, dtype=torch.int64),
        timestamps=start + _GAP_S * torch.arange(events, dtype=torch.int64).repeat(users),
        actions=torch.zeros(total, dtype=torch.int64) if server.needs_actions else None,
        contextual=torch.zeros(users, width) if width > 0 else None,
    )


def encoding_sizes(
    server: ModelServer, histories: Sequence[int], events: Sequence[int]
) -> Tuple[List[int], List[int]]:
    """``histories`` and ``events`` checked, sorted and without repeats.

    Raises:
        ValueError: a size that is not an int in ``[1, max_events]`` (named).
    """
    bound = server.max_events
    out = []
    for name, values in (("histories", histories), ("events", events)):
        if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
            raise ValueError(f"{name} must be a sequence of ints, got {values!r}")
        for v in values:
            if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= bound:
                raise ValueError(
                    f"{name} must be ints in [1, {bound}] (the model's max_events), got {v!r}"
                )
        out.append(sorted(set(values)))
    return out[0], out[1]


@torch.no_grad()
def warm_up_encoding(
    server: ModelServer,
    device: torch.device,
    batch_sizes: Sequence[int],
    histories: Sequence[int],
    events: Sequence[int],
    prefill: Optional[Callable[[Histories], ServingCache]] = None,
    extend: Optional[Callable[[ServingCache, Histories], ServingCache]] = None,
) -> Dict[str, Any]:
    """Encode ``B`` synthetic users of ``n`` events for every ``B`` in ``batch_sizes`` and
    ``n`` in ``histories``; where the server extends incrementally, also append ``Δ``
    events for every ``Δ`` in ``events`` to each of those caches.

    Args:
        server (ModelServer): the session's server (its model in eval mode on ``device``).
        device (torch.device): the session's device.
        batch_sizes (Sequence[int]): users per call.
        histories (Sequence[int]): events per user of the encoded histories, in
            ``[1, max_events]``.
        events (Sequence[int]): new events per user of the extends, each with the
            history within ``max_events`` (the combinations past it are left out).
        prefill: encodes histories (the session's: a CUDA graph where one was captured).
            Default: the server's ``prefill_histories`` on ``device``.
        extend: appends events to a cache (the session's: a CUDA graph where one was
            captured). Default: the server's ``extend_histories`` on ``device``.

    Returns:
        Dict[str, Any]: ``encoded`` (``{"batch", "events"}`` of each encoding),
        ``extended`` (``{"batch", "history", "events"}`` of each extend) and
        ``encode_seconds`` (wall time, the device synchronized).

    Raises:
        ValueError: a size outside its range (named).
    """
    started = time.perf_counter()
    bound = server.max_events
    lengths, extra = encoding_sizes(server, histories, events)
    report: Dict[str, Any] = {"encoded": [], "extended": []}
    for batch in sorted(set(batch_sizes)):
        for n in lengths:
            h = synthetic_histories(server, batch, n)
            cache = server.prefill_histories(h, device) if prefill is None else prefill(h)
            report["encoded"].append({"batch": batch, "events": n})
            if not server.extends_incrementally:
                continue
            for delta in extra:
                if n + delta > bound:
                    continue
                new = synthetic_histories(server, batch, delta, start=_GAP_S * n)
                if extend is None:
                    server.extend_histories(cache, new, device)
                else:
                    extend(cache, new)
                report["extended"].append({"batch": batch, "history": n, "events": delta})
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    report["encode_seconds"] = time.perf_counter() - started
    return report
