"""One training step of the ranking model on each CPU backend against a float64 oracle.

The trainer's ranking settings (two STU layers, two heads, every action bit embedded, two
tasks) at tiny shapes. The triton backend runs in the CPU interpreter and refuses float64,
so each backend runs in float32 and is held, with the float32 tolerances of
:mod:`tzrec_ops.tolerances`, to the pytorch backend in float64 with the same weights: the
loss, the logits and every parameter's gradient. Dropout is off: the backends draw their
masks differently (the triton kernels from a seed taken from torch's generator), which
makes two runs of one seed diverge by itself; the masks' contract is tzrec-ops' test.
"""

from __future__ import annotations

import pytest
import torch
from _models import CPU_BACKENDS, NUM_ITEMS, ranking_batch, ranking_user

from tzrec_gr.models import HSTURanking
from tzrec_ops.testing.tolerances import assert_close

MAX_UIH, MAX_TARGETS = 12, 4


def _model(backend: str, dtype: torch.dtype) -> HSTURanking:
    torch.manual_seed(0)
    model = HSTURanking(
        NUM_ITEMS, 32, 32, [4, 2], [1 << bit for bit in range(8)], num_heads=2, num_layers=2,
        dropout_ratio=0.0, backend=backend, max_uih_len=MAX_UIH, max_targets=MAX_TARGETS,
    )
    return model.to(dtype).train()


def _step(model: HSTURanking, batch, labels):
    logits = model(batch, MAX_UIH, MAX_TARGETS)
    loss = model.loss(logits, labels)
    loss.backward()
    grads = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), logits.detach(), grads


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_ranking_training_step_matches_float64_oracle(backend):
    torch.manual_seed(1)
    users = [ranking_user(h, c) for h, c in ((7, 3), (1, 4), (12, 2))]
    for user in users:
        user["uih_action.sequence"] = torch.randint(0, 256, user["uih_action.sequence"].shape)
        del user["contextual"], user["query_time"]  # no contextual features, as trained
    batch = ranking_batch(users)
    labels = torch.randint(0, 8, batch["candidate.item_id"].shape)
    model = _model(backend, torch.float32)
    oracle = _model("pytorch", torch.float64)
    oracle.load_state_dict(model.state_dict())
    loss, logits, grads = _step(model, batch, labels)
    loss64, logits64, grads64 = _step(oracle, batch, labels)
    assert_close(loss, loss64, name="loss")
    assert_close(logits, logits64, name="logits")
    assert sorted(grads) == sorted(grads64)
    assert len(grads) == len(list(model.parameters())), "some parameter got no gradient"
    for name, grad in grads.items():
        assert_close(grad, grads64[name], grad=True, name=f"{name}.grad")
