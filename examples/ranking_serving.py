"""Train HSTURanking for a few steps on synthetic data, then serve one user.

    python examples/ranking_serving.py

Serving (a ``RankingServer`` over the trained model) encodes the user's history once
(``prefill``, anchored at the request time) and
scores any number of candidate sets against it (``score``), each equal to the full forward
over history + candidates. A model built with ``use_time_encoding=False`` can also append
new events to the cache (``extend``); with time encoding the history is prefilled again.
Runs on the CPU in a few seconds.
"""

from __future__ import annotations

from typing import Dict

import torch

from tzrec_gr.models import HSTURanking
from tzrec_gr.serving import RankingServer

NUM_ITEMS, MAX_UIH_LEN, MAX_TARGETS = 100, 24, 4
CLICK, LIKE = 1, 2
torch.manual_seed(0)


def synthetic_batch(batch: int) -> Dict[str, torch.Tensor]:
    """Users like even items: a candidate with an even id is clicked (and liked if < 50)."""
    uih = torch.randint(4, MAX_UIH_LEN + 1, (batch,))
    cand = torch.randint(1, MAX_TARGETS + 1, (batch,))
    ids = torch.randint(0, NUM_ITEMS, (int(uih.sum()),))
    cand_ids = torch.randint(0, NUM_ITEMS, (int(cand.sum()),))
    labels = (cand_ids % 2 == 0) * CLICK + ((cand_ids % 2 == 0) & (cand_ids < 50)) * LIKE
    return {
        "uih.item_id": ids,
        "uih.sequence_length": uih,
        "uih_action.sequence": (ids % 2 == 0) * CLICK,
        "uih_timestamp.sequence": torch.arange(ids.shape[0]) * 600,
        "candidate.item_id": cand_ids,
        "candidate.sequence_length": cand,
        "candidate_timestamp.sequence": torch.full_like(cand_ids, ids.shape[0] * 600),
        "labels": labels,
    }


def build(**kw) -> HSTURanking:
    torch.manual_seed(1)
    return HSTURanking(
        NUM_ITEMS,
        16,
        32,
        task_bitmasks=[CLICK, LIKE],
        action_weights=[CLICK, LIKE],
        dropout_ratio=0.1,
        backend="pytorch",
        max_uih_len=MAX_UIH_LEN,  # with max_targets, fixes the attention divisor
        max_targets=MAX_TARGETS,
        **kw,
    )


model = build()
optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
for step in range(30):
    batch = synthetic_batch(16)
    loss = model.loss(model(batch), batch.pop("labels"))
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    if step % 10 == 0 or step == 29:
        print(f"step {step:2d}  loss {loss.item():.3f}")

# -- serve one user: one cache, two candidate sets -----------------------------------------
server = RankingServer(model.eval())
user = synthetic_batch(1)
user.pop("labels")
history = {k: v for k, v in user.items() if k.startswith("uih")}
now = user["candidate_timestamp.sequence"][:1]  # the request time anchors every time gap
cache = server.prefill(history, query_time=now)
for cand_ids in (torch.tensor([2, 3, 40]), torch.tensor([71, 60])):
    candidates = {
        "candidate.item_id": cand_ids,
        "candidate.sequence_length": torch.tensor([cand_ids.shape[0]]),
        "candidate_timestamp.sequence": now.expand(cand_ids.shape[0]),
    }
    logits = server.score(cache, candidates)
    full = model({**history, **candidates, "query_time": now})
    gap = (logits - full).abs().max().item()
    assert gap < 1e-4, gap
    clicks = torch.sigmoid(logits[:, 0]).tolist()
    print(
        f"candidates {cand_ids.tolist()}: p(click) {[round(p, 2) for p in clicks]} "
        f"(cached vs full forward: {gap:.1e})"
    )

# -- appending events needs forward positions: use_time_encoding=False ---------------------
plain = build(use_time_encoding=False).eval()
plain_server = RankingServer(plain)
cache = plain_server.prefill(history)
event = {
    "uih.item_id": torch.tensor([8]),
    "uih.sequence_length": torch.tensor([1]),
    "uih_action.sequence": torch.tensor([CLICK]),
    "uih_timestamp.sequence": now,
}
cache = plain_server.extend(cache, event)
longer = {k: torch.cat([history[k], event[k]]) for k in history if k != "uih.sequence_length"}
longer["uih.sequence_length"] = history["uih.sequence_length"] + 1
logits = plain_server.score(cache, candidates)
gap = (logits - plain({**longer, **candidates})).abs().max().item()
assert gap < 1e-4, gap
print(f"appended one event without re-encoding the history (cached vs full: {gap:.1e})")
