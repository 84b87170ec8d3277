"""Tiny models and per-user data for the model and serving tests.

A user is a dict of 1-D tensors (and ``contextual`` [C * Fc], ``query_time`` a 0-D tensor);
:func:`retrieval_batch` and :func:`ranking_batch` put several users into one jagged batch.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Dict, Sequence, Tuple

import pytest
import torch

from tzrec_gr.models import HSTURanking, HSTURetrieval
from tzrec_gr.serving import Histories

NUM_ITEMS = 40
User = Dict[str, torch.Tensor]

TRITON_INTERPRETER = pytest.param(
    "triton",
    marks=pytest.mark.skipif(
        os.environ.get("TRITON_INTERPRET") != "1" or importlib.util.find_spec("triton") is None,
        reason="needs triton and TRITON_INTERPRET=1 (set by conftest without a GPU)",
    ),
)
CPU_BACKENDS = ["pytorch", TRITON_INTERPRETER]

#: the marks of a test that captures real CUDA graphs: selected by ``-m gpu``, skipped
#: without a GPU
GPU_MARKS = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU"),
]


def gpu_test(fn):
    """``fn`` with :data:`GPU_MARKS`."""
    for mark in GPU_MARKS:
        fn = mark(fn)
    return fn


def retrieval_model(backend: str = "pytorch", device: str = "cpu", **kw) -> HSTURetrieval:
    torch.manual_seed(0)
    kw = {"num_layers": 2, "dropout_ratio": 0.0, "max_seq_len": 12, **kw}
    return HSTURetrieval(NUM_ITEMS, 16, backend=backend, device=device, **kw).eval()


def attributed_retrieval_model(backend: str = "pytorch", device: str = "cpu", **kw):
    """``retrieval_model`` with 5 item attributes: item i has attribute i % 5, except items
    0 and 1 (none) and item 2 (attributes 2, 3, 4); the attribute rows are N(0, 1), large
    beside the id rows, so a test that dropped them would notice."""
    lists = [[] if i < 2 else [i % 5] for i in range(NUM_ITEMS)]
    lists[2] = [2, 3, 4]
    offsets = torch.tensor([0] + [len(a) for a in lists]).cumsum(0)
    ids = torch.tensor([a for attrs in lists for a in attrs])
    model = retrieval_model(backend, device, num_attributes=5,
                            num_attribute_links=int(ids.numel()), **kw)
    model.item_attributes.set_links(offsets, ids)
    with torch.no_grad():
        model.item_attributes.table.weight.normal_()
    return model


def ranking_model(backend: str = "pytorch", device: str = "cpu", **kw) -> HSTURanking:
    torch.manual_seed(0)
    kw = {
        "contextual_feature_dim": 3,
        "max_contextual_seq_len": 2,
        "dropout_ratio": 0.0,
        "max_uih_len": 10,
        "max_targets": 4,
        **kw,
    }
    model = HSTURanking(NUM_ITEMS, 8, 16, [1, 2], [1, 2, 4], backend=backend, device=device, **kw)
    return model.eval()


def history_user(length: int, start: int = 1000) -> User:
    """``length`` events with increasing timestamps from ``start`` (seconds)."""
    gaps = torch.randint(30, 4000, (length,))
    return {
        "item_id": torch.randint(0, NUM_ITEMS, (length,)),
        "action": torch.randint(0, 8, (length,)),
        "timestamp": start + torch.cumsum(gaps, 0),
    }


def ranking_user(history: int, candidates: int, context_width: int = 6) -> User:
    user = history_user(history)
    last = int(user["timestamp"][-1]) if history else 1000
    return {
        "uih.item_id": user["item_id"],
        "uih_action.sequence": user["action"],
        "uih_timestamp.sequence": user["timestamp"],
        "candidate.item_id": torch.randint(0, NUM_ITEMS, (candidates,)),
        "candidate_timestamp.sequence": torch.full((candidates,), last + 600),
        "contextual": torch.randn(context_width),
        "query_time": torch.tensor(last + 600),
    }


def retrieval_batch(
    users: Sequence[User], device: str = "cpu"
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(item_ids [L], lengths [B], timestamps [L])."""
    ids = torch.cat([u["item_id"] for u in users]).to(device)
    ts = torch.cat([u["timestamp"] for u in users]).to(device)
    lengths = torch.tensor([u["item_id"].shape[0] for u in users], device=device)
    return ids, lengths, ts


_LENGTH_OF = {
    "uih.sequence_length": "uih.item_id",
    "candidate.sequence_length": "candidate.item_id",
}


def ranking_batch(users: Sequence[User], keys: Sequence[str] = (), device: str = "cpu") -> User:
    """The users' features in one batch (``keys``: only those, lengths included)."""
    keys = list(keys) or list(users[0]) + list(_LENGTH_OF)
    batch: User = {}
    for key in keys:
        if key in _LENGTH_OF:
            batch[key] = torch.tensor([u[_LENGTH_OF[key]].shape[0] for u in users])
        elif key in ("contextual", "query_time"):
            batch[key] = torch.stack([u[key] for u in users])
        else:
            batch[key] = torch.cat([u[key] for u in users])
    return {k: v.to(device) for k, v in batch.items()}


def rows_of(lengths: Sequence[int], user: int) -> slice:
    """The rows of ``user`` in a jagged batch with these lengths."""
    start = sum(lengths[:user])
    return slice(start, start + lengths[user])


def ranking_histories(users: Sequence[User]) -> Histories:
    """The serving ``Histories`` of :func:`ranking_user` users, in their order."""
    return Histories(
        item_ids=torch.cat([u["uih.item_id"] for u in users]),
        lengths=torch.tensor([u["uih.item_id"].numel() for u in users]),
        timestamps=torch.cat([u["uih_timestamp.sequence"] for u in users]),
        actions=torch.cat([u["uih_action.sequence"] for u in users]),
        contextual=(
            None
            if users[0]["contextual"] is None
            else torch.stack([u["contextual"] for u in users])
        ),
        query_time=torch.stack([u["query_time"] for u in users]),
    )
