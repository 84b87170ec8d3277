"""A :class:`~tzrec_gr.serving.ServingSession` request's histories: checked on the host,
moved to the device and encoded (``prefill``); and the normalized catalogue ``recommend``
scans.

Legend: B = users, I = catalogue items, E = embedding width.

Every function takes the model and its kind (``"retrieval"`` or ``"ranking"``), so the
session's public methods read as the steps of a request.
"""

from __future__ import annotations

from typing import Dict, List, Optional

import torch
from torch import nn

from tzrec_gr.features import CONTEXTUAL, UIH_ACTIONS, UIH_ITEM_ID, UIH_LENGTHS, UIH_TIMESTAMPS
from tzrec_gr.serving.cache import ServingCache
from tzrec_gr.serving.inputs import Histories
from tzrec_ops.jagged import to_device

__all__ = [
    "catalogue",
    "check_histories",
    "contextual_width",
    "max_events",
    "on_device",
    "prefill",
    "query_times",
    "timed",
]


def max_events(model: nn.Module, kind: str) -> int:
    """The most events of one user the model takes."""
    return model.max_seq_len if kind == "retrieval" else model.max_uih_len


def contextual_width(model: nn.Module, kind: str) -> int:
    """C * Fc, the width of a user's contextual features (0 without them)."""
    if kind != "ranking" or model.contextual_seq_len == 0:
        return 0
    pre = model.transducer.input_preprocessor
    return pre.contextual_seq_len() * pre.contextual_feature_dim


def timed(model: nn.Module) -> bool:
    """Whether the model encodes time (its caches then hold each user's query time)."""
    encoder = model.transducer.positional_encoder
    return encoder is not None and encoder.use_time_encoding


def check_histories(
    model: nn.Module,
    kind: str,
    histories: Histories,
    *,
    allow_empty: bool = False,
    contextual: bool = True,
    after: Optional[List[Optional[int]]] = None,
) -> None:
    """Check ``histories`` on the host against the model (see :meth:`Histories.check`).

    Args:
        model: the session's model.
        kind (str): ``"retrieval"`` or ``"ranking"``.
        histories (Histories): the request's histories.
        allow_empty (bool): users may have no events (``extend``).
        contextual (bool): require the contextual features (``open``, stateless calls).
        after: per user, the newest timestamp kept (``extend``); None: whole histories,
            which must also fit the model's bound.

    Raises:
        ValueError: a bad history (named, with the user's row).
    """
    if not isinstance(histories, Histories):
        raise ValueError(f"histories must be a Histories, got {type(histories).__name__}")
    ranking = kind == "ranking"
    histories.check(
        model.num_items,
        allow_empty=allow_empty,
        needs_actions=ranking,
        contextual_width=contextual_width(model, kind) if contextual else 0,
        after=after,
    )
    if after is None:
        bound = max_events(model, kind)
        lengths = histories.offsets[1:] - histories.offsets[:-1]
        if bool((lengths > bound).any()):
            b = int((lengths > bound).nonzero()[0, 0])
            raise ValueError(
                f"histories of user {b} has {int(lengths[b])} events, more than the "
                f"model takes ({bound}); keep the newest {bound}"
            )


def on_device(h: Histories, kind: str, device: torch.device) -> Dict[str, torch.Tensor]:
    """The ``uih.*`` features of ``h`` on ``device`` (the lengths' host copy kept)."""
    out = {
        UIH_ITEM_ID: h.item_ids.to(device),
        UIH_LENGTHS: to_device(h.lengths.detach().cpu().to(torch.int64), device),
        UIH_TIMESTAMPS: h.timestamps.to(device),
    }
    if h.actions is not None and kind == "ranking":
        out[UIH_ACTIONS] = h.actions.to(device)
    return out


def query_times(h: Histories) -> torch.Tensor:
    """[B] CPU: the given query times, or each user's newest timestamp."""
    if h.query_time is not None:
        return h.query_time.detach().cpu().to(torch.int64)
    return h.newest_timestamps()


def prefill(model: nn.Module, kind: str, device: torch.device, h: Histories) -> ServingCache:
    """Encode checked histories: the model's ``prefill`` on ``device``."""
    dev = on_device(h, kind, device)
    if kind == "retrieval":
        return model.prefill(dev[UIH_ITEM_ID], dev[UIH_LENGTHS], dev[UIH_TIMESTAMPS])
    if model.contextual_seq_len > 0:
        assert h.contextual is not None
        dtype = next(model.parameters()).dtype
        dev[CONTEXTUAL] = h.contextual.to(device, dtype)
    return model.prefill(dev, query_times(h).to(device))


@torch.no_grad()
def catalogue(
    model: nn.Module, device: torch.device, chunk_size: int, out: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """[I, E] the model's normalized item embeddings, ``chunk_size`` items at a time.

    Args:
        out (torch.Tensor | None): a catalogue to overwrite in place (a captured CUDA graph
            reads that tensor); None: a new one.
    """
    rows = [
        model.item_embedding(torch.arange(s, min(s + chunk_size, model.num_items), device=device))
        for s in range(0, model.num_items, chunk_size)
    ]
    table = torch.cat(rows)
    if out is None:
        return table
    return out.copy_(table)
