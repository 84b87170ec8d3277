"""The models' sequence bounds and input errors.

A user's output must not depend on the call's bounds nor on who else is in the batch: the
models fix the attention divisor to the bounds they are built with. Checked on pytorch
(CPU), on triton in the interpreter, and on triton on a GPU (``-m gpu``), each against the
user alone on the same backend, within the dtype's tolerance.
"""

from __future__ import annotations

import math

import pytest
import torch
from _models import (
    CPU_BACKENDS,
    NUM_ITEMS,
    history_user,
    ranking_batch,
    ranking_model,
    ranking_user,
    retrieval_batch,
    retrieval_model,
    rows_of,
)

from tzrec_gr import HSTUTransducer, STULayer
from tzrec_gr.models import HSTURanking, HSTURetrieval
from tzrec_ops import set_value_checks
from tzrec_ops.testing.tolerances import assert_close


def _retrieval_invariance(backend: str, device: str, dtype: torch.dtype) -> None:
    model = retrieval_model(backend, device).to(dtype)
    users = [history_user(n) for n in (4, 9, 1, 12, 6)]
    alone = model(*retrieval_batch(users[:1], device))
    for bound in (4, 7, None):
        out = model(*retrieval_batch(users[:1], device), bound)
        assert_close(out, alone.double(), dtype, name=f"max_seq_len={bound}")
    for order in ([1, 0, 2], [3, 4, 0], [0, 0, 3]):
        batch = [users[i] for i in order]
        lengths = [u["item_id"].shape[0] for u in batch]
        out = model(*retrieval_batch(batch, device), max(lengths))
        assert_close(out[rows_of(lengths, order.index(0))], alone.double(), dtype, name=f"{order}")


def _ranking_invariance(backend: str, device: str, dtype: torch.dtype) -> None:
    model = ranking_model(backend, device).to(dtype)
    users = [ranking_user(h, t) for h, t in ((3, 2), (10, 4), (0, 1), (6, 0), (7, 3))]
    for user in users:
        user["contextual"] = user["contextual"].to(dtype)
    alone = model(ranking_batch(users[:1], device=device))
    for bounds in ((3, 2), (5, 4), (None, None)):
        out = model(ranking_batch(users[:1], device=device), *bounds)
        assert_close(out, alone.double(), dtype, name=f"bounds {bounds}")
    for order in ([1, 0, 2], [3, 4, 0], [2, 0, 1, 3]):
        batch = [users[i] for i in order]
        targets = [u["candidate.item_id"].shape[0] for u in batch]
        out = model(ranking_batch(batch, device=device))
        mine = out[rows_of(targets, order.index(0))]
        assert_close(mine, alone.double(), dtype, name=f"users {order}")


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_retrieval_user_output_is_independent_of_bound_and_batch(backend):
    _retrieval_invariance(backend, "cpu", torch.float32)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_ranking_user_logits_are_independent_of_bounds_and_batch(backend):
    _ranking_invariance(backend, "cpu", torch.float32)


def test_invariance_holds_in_float64():
    _retrieval_invariance("pytorch", "cpu", torch.float64)
    _ranking_invariance("pytorch", "cpu", torch.float64)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_models_are_batch_and_bound_invariant_on_triton_gpu(dtype):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    _retrieval_invariance("triton", "cuda", dtype)
    _ranking_invariance("triton", "cuda", dtype)


def test_models_fix_the_attention_divisor_to_their_bounds():
    """One place computes the bound: C + events, doubled by interleaving."""
    retrieval = retrieval_model(max_seq_len=12)
    assert {layer.scaling_seqlen for layer in retrieval.transducer.stu.stu_layers} == {12}
    ranking = ranking_model(max_uih_len=10, max_targets=4)
    assert {layer.scaling_seqlen for layer in ranking.transducer.stu.stu_layers} == {2 + 14}
    interleaved = ranking_model(max_uih_len=10, max_targets=4, enable_interleaving=True)
    layers = interleaved.transducer.stu.stu_layers
    assert {layer.scaling_seqlen for layer in layers} == {2 + 2 * 14}


def test_transducer_keeps_an_explicit_divisor_and_checks_call_bounds():
    model = ranking_model()
    transducer = model.transducer
    layer = STULayer(16, 2, 8, 8, scaling_seqlen=99, backend="pytorch")
    stack = type(transducer.stu)([layer])
    built = HSTUTransducer(transducer.input_preprocessor, stack, max_uih_len=5, max_targets=1)
    assert layer.scaling_seqlen == 99 and built.max_seq_len == 2 + 6
    with pytest.raises(ValueError, match=r"max_targets \(2\) must be <= the max_targets this"):
        built({}, 5, 2)
    with pytest.raises(ValueError, match=r"max_targets \(3\) needs max_uih_len"):
        HSTUTransducer(transducer.input_preprocessor, stack, max_targets=3)
    with pytest.raises(ValueError, match="max_uih_len is required"):
        HSTUTransducer(transducer.input_preprocessor, stack)({})


# -- errors in the models' own vocabulary ---------------------------------------------------


def _retrieval_inputs():
    return torch.tensor([1, 2, 3, 4, 5]), torch.tensor([2, 3]), torch.arange(5)


@pytest.mark.parametrize(
    "change, match",
    [
        ({"lengths": torch.tensor([-1, 6])}, r"lengths\[0\] must be >= 0, got -1"),
        ({"lengths": torch.tensor([2.0, 3.0])}, r"lengths must be an integer tensor, got "),
        ({"lengths": torch.tensor([1, 3])}, r"lengths sums to 4 but item_ids has 5 rows"),
        ({"lengths": torch.tensor([0, 5]), "max_seq_len": 4}, r"lengths\[1\] \(5\) must be <= "),
        ({"timestamps": torch.arange(5.0)}, r"timestamps must be an integer tensor, got "),
        ({"timestamps": torch.arange(4)}, r"timestamps has 4 rows but item_ids has 5"),
        ({"item_ids": torch.tensor([1, 2, 40, 4, 5])}, r"item_ids must be in \[0, num_items=40"),
        ({"item_ids": torch.tensor([1, -2, 3, 4, 5])}, r"got item_ids\[1\] = -2"),
        ({"item_ids": torch.tensor([[1, 2, 3, 4, 5]])}, r"item_ids must be 1-D, got shape"),
        ({"max_seq_len": 13}, r"max_seq_len \(13\) must be <= the max_seq_len the model was"),
        ({"max_seq_len": 4.0}, r"max_seq_len must be an int >= 0, got 4.0"),
    ],
)
def test_retrieval_input_errors_name_the_argument(change, match):
    model = retrieval_model()
    ids, lengths, ts = _retrieval_inputs()
    args = {"item_ids": ids, "lengths": lengths, "timestamps": ts, "max_seq_len": None, **change}
    with pytest.raises(ValueError, match=match):
        model(**args)
    with pytest.raises(ValueError, match=match):
        model.loss(**args)


def test_retrieval_negatives_are_checked():
    model = retrieval_model()
    with pytest.raises(ValueError, match=r"negatives must be in \[0, num_items=40\)"):
        model.loss(*_retrieval_inputs(), negatives=torch.tensor([3, 41]))


def test_retrieval_full_softmax_is_the_loss_over_every_item_float64():
    """With num_negatives at least the catalogue and no negatives given, the loss is the
    full softmax over the whole table, as explicit negatives listing every item give it."""
    runs = []
    for negatives in (None, torch.arange(NUM_ITEMS)):
        model = retrieval_model(num_negatives=NUM_ITEMS).double()
        loss = model.loss(*_retrieval_inputs(), negatives=negatives)
        loss.backward()
        runs.append([loss.detach()] + [p.grad for p in model.parameters()])
    for got, want in zip(*runs):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def _ranking_inputs():
    return ranking_batch([ranking_user(3, 2), ranking_user(2, 1)])


@pytest.mark.parametrize(
    "key, value, match",
    [
        ("uih.sequence_length", [-1, 6], r"batch\['uih.sequence_length'\]\[0\] must be >= 0"),
        ("uih.sequence_length", [1, 3], r"'uih.sequence_length'\] sums to 4 but batch\['uih.item"),
        ("candidate.sequence_length", [0, 2], r"'candidate.sequence_length'\] sums to 2 but"),
        ("candidate.sequence_length", [2, 1, 0], r"has B = 3 users but the history has 2"),
        ("candidate.sequence_length", [2.0, 1.0], r"must be an integer tensor, got torch.float"),
        ("candidate_timestamp.sequence", [1.5, 2.0, 3.0], r"\['candidate_timestamp.sequence'\] "),
        ("uih_timestamp.sequence", [1, 2], r"has 2 rows but batch\['uih.item_id'\] has 5"),
        ("candidate.item_id", [0, 1, 40], r"batch\['candidate.item_id'\] must be in \[0, num_"),
        ("uih.item_id", [0, 1, 2, 3, -4], r"got batch\['uih.item_id'\]\[4\] = -4"),
        ("contextual", [[1, 2, 3, 4, 5, 6]] * 2, r"batch\['contextual'\] must be a float tensor"),
        ("query_time", [5.0, 6.0], r"batch\['query_time'\] must be an integer tensor"),
    ],
)
def test_ranking_input_errors_name_the_feature(key, value, match):
    batch = {**_ranking_inputs(), key: torch.tensor(value)}
    with pytest.raises(ValueError, match=match):
        ranking_model()(batch)


def test_ranking_bounds_are_checked_in_its_own_terms():
    model, batch = ranking_model(), _ranking_inputs()
    with pytest.raises(
        ValueError,
        match=r"\['candidate.sequence_length'\]\[0\] \(2\) must be <= "
        r"max_targets \(1\)",
    ):
        model(batch, max_targets=1)
    with pytest.raises(ValueError, match=r"max_uih_len \(11\) must be <= the max_uih_len"):
        model(batch, max_uih_len=11)
    with pytest.raises(KeyError, match="batch is missing 'uih_action.sequence'"):
        model({k: v for k, v in batch.items() if k != "uih_action.sequence"})
    with pytest.raises(ValueError, match="max_targets must be an int >= 1, got 0"):
        ranking_model(max_targets=0)


def test_nan_in_contextual_features_stays_with_its_user_unless_checked():
    """Documented: users never mix, so a NaN spoils only its own user's logits;
    validate_inputs=True rejects it instead."""
    batch = _ranking_inputs()
    batch["contextual"][1, 2] = math.nan
    logits = ranking_model()(batch)
    assert torch.isfinite(logits[:2]).all() and torch.isnan(logits[2:]).all()
    with pytest.raises(ValueError, match=r"batch\['contextual'\] has a NaN or inf in row 1"):
        ranking_model(validate_inputs=True)(batch)


def test_value_checks_off_skips_the_item_id_check():
    ids, lengths, ts = _retrieval_inputs()
    set_value_checks(False)
    try:
        with pytest.raises(IndexError):
            retrieval_model()(ids + 40, lengths, ts)
    finally:
        set_value_checks(None)


def test_item_ids_on_a_device_are_read_only_with_validate_inputs():
    """Off the CPU the range check is a device read: only with validate_inputs=True (a
    meta tensor has no values, so reading it fails)."""
    from tzrec_gr.models.inputs import check_item_ids

    meta = torch.empty(2, dtype=torch.int64, device="meta")
    check_item_ids("item_ids", meta, NUM_ITEMS, validate_inputs=False)
    with pytest.raises((RuntimeError, NotImplementedError)):
        check_item_ids("item_ids", meta, NUM_ITEMS, validate_inputs=True)


def test_constructor_bound_errors():
    with pytest.raises(ValueError, match="max_seq_len must be an int > 0, got 0"):
        HSTURetrieval(10, 8, max_seq_len=0)
    with pytest.raises(ValueError, match="max_uih_len must be an int >= 0, got -1"):
        HSTURanking(10, 4, 8, [1], [1], max_uih_len=-1)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["retrieval", "ranking"])
def test_a_compiled_training_step_with_dropout_on_triton_gpu(kind):
    """Dropout 0.2 in the Triton kernels under ``torch.compile`` (Inductor): they read their
    dropout seed from a device tensor drawn in the graph, so the step compiles; one training
    step gives a finite loss and finite gradients, and the masks are live (two torch seeds,
    two losses)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    torch._dynamo.reset()
    if kind == "retrieval":
        model = retrieval_model("triton", "cuda", dropout_ratio=0.2).train()
        users = [history_user(n) for n in (4, 9, 1, 12, 6)]
        inputs = retrieval_batch(users, "cuda")
        negatives = torch.arange(1, 17, device="cuda")

        def step():
            return model.loss(*inputs, negatives=negatives)

    else:
        model = ranking_model("triton", "cuda", dropout_ratio=0.2).train()
        users = [ranking_user(h, t) for h, t in ((3, 2), (10, 4), (6, 1), (7, 3))]
        batch = ranking_batch(users, device="cuda")
        labels = torch.randint(0, 8, (batch["candidate.item_id"].shape[0],), device="cuda")

        def step():
            return model.loss(model(batch), labels)

    compiled = torch.compile(step)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    losses = []
    for seed in (1, 2):
        optimizer.zero_grad()
        torch.manual_seed(seed)
        loss = compiled()
        loss.backward()
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        assert grads and all(torch.isfinite(g).all() for g in grads)
        losses.append(loss.item())
    optimizer.step()
    assert all(math.isfinite(x) for x in losses), losses
    assert losses[0] != losses[1], losses
    torch._dynamo.reset()
