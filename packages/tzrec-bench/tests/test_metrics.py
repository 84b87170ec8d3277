"""Full-catalogue retrieval metrics and per-task AUC."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from tzrec_bench.train.metrics import NonFiniteError, RetrievalMetrics, TaskAUC, target_ranks

# item scores for the user [1, 0] are 3, 1, 2, 2, 0: items 2 and 3 tie
ITEMS = torch.tensor([[3.0, 0.0], [1.0, 0.0], [2.0, 0.0], [2.0, 0.0], [0.0, 0.0]])


def test_ranks_count_higher_items_and_ties_apart():
    scores = torch.tensor([[1.0, 0.0]] * 4 + [[-1.0, 0.0]]) @ ITEMS.t()
    targets = torch.tensor([2, 0, 4, 1, 4])
    higher, ties = target_ranks(scores, targets)
    # target 2 (score 2): item 0 is higher and item 3 ties; for the last user every item
    # scores <= 0 and item 4 (score 0) is the highest
    assert higher.tolist() == [1, 0, 4, 3, 0]
    assert ties.tolist() == [1, 0, 0, 0, 0]


def test_a_tie_is_broken_at_random_in_expectation():
    metrics = RetrievalMetrics(ks=(1, 2, 4))
    # target 2 ties with item 3 behind item 0: rank 1 or 2, each with probability 1/2
    metrics.update(torch.tensor([[1.0, 0.0]]), ITEMS, torch.tensor([2]))
    result = metrics.compute()
    assert result["hr@1"] == 0.0
    assert result["hr@2"] == pytest.approx(0.5, rel=1e-12)
    assert result["hr@4"] == pytest.approx(1.0, rel=1e-12)
    assert result["ndcg@2"] == pytest.approx(0.5 / math.log2(3), rel=1e-12)
    assert result["ndcg@4"] == pytest.approx(0.5 / math.log2(3) + 0.5 / math.log2(4), rel=1e-12)
    assert result["mrr"] == pytest.approx((1 / 2 + 1 / 3) / 2, rel=1e-12)


def test_a_constant_scorer_ranks_targets_in_the_middle_not_first():
    num_items, num_users = 500, 64
    metrics = RetrievalMetrics(ks=(10, 50, 200))
    targets = torch.randint(0, num_items, (num_users,), generator=torch.Generator().manual_seed(0))
    metrics.update_scores(torch.zeros(num_users, num_items), targets)
    result = metrics.compute()
    # a uniform rank on 0 .. I - 1: HR@K = K / I, MRR = H_I / I
    for k in (10, 50, 200):
        assert result[f"hr@{k}"] == pytest.approx(k / num_items, rel=1e-9)
    harmonic = sum(1 / r for r in range(1, num_items + 1))
    assert result["mrr"] == pytest.approx(harmonic / num_items, rel=1e-9)
    higher, ties = target_ranks(torch.zeros(num_users, num_items), targets)
    mean_rank = (higher + ties / 2).double().mean().item()
    assert mean_rank == pytest.approx((num_items - 1) / 2)


def test_expected_metrics_equal_the_mean_over_every_tie_order():
    gen = torch.Generator().manual_seed(3)
    scores = torch.randint(0, 4, (40, 30), generator=gen).double()  # many ties
    targets = torch.randint(0, 30, (40,), generator=gen)
    metrics = RetrievalMetrics(ks=(1, 5, 20))
    metrics.update_scores(scores, targets)
    higher, ties = target_ranks(scores, targets)
    sums = dict.fromkeys(["hr@5", "ndcg@5", "mrr"], 0.0)
    for h, t in zip(higher.tolist(), ties.tolist()):
        places = range(h, h + t + 1)
        sums["hr@5"] += sum(r < 5 for r in places) / len(places)
        sums["ndcg@5"] += sum(1 / math.log2(r + 2) for r in places if r < 5) / len(places)
        sums["mrr"] += sum(1 / (r + 1) for r in places) / len(places)
    result = metrics.compute()
    for name, total in sums.items():
        assert result[name] == pytest.approx(total / 40, rel=1e-9), name


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_scores_raise_instead_of_ranking(bad):
    user, items, targets = _random_case()
    user[5, 0] = bad
    metrics = RetrievalMetrics(ks=(10,))
    metrics.update(user, items, targets)
    with pytest.raises(NonFiniteError, match="1 of 37 evaluated users"):
        metrics.compute()


def test_nan_item_embeddings_raise():
    user, items, targets = _random_case()
    items[0] = math.nan
    metrics = RetrievalMetrics(ks=(10,))
    metrics.update(user, items, targets)
    with pytest.raises(NonFiniteError, match="diverged"):
        metrics.compute()


def test_excluded_items_leave_the_ranking_but_the_target_stays():
    metrics = RetrievalMetrics(ks=(1,))
    scores = torch.tensor([[5.0, 4.0, 3.0, 2.0]])
    excluded = torch.tensor([[True, True, True, False]])  # the target 2 is excluded too
    metrics.update_scores(scores, torch.tensor([2]), excluded)
    assert metrics.compute()["hr@1"] == 1.0


def test_hand_computed_hr_ndcg_mrr():
    metrics = RetrievalMetrics(ks=(1, 2, 4))
    metrics.update(torch.tensor([[1.0, 0.0]] * 4), ITEMS, torch.tensor([2, 0, 4, 1]))
    # ranks {1, 2} (a tie with item 3, each with probability 1/2), 0, 4, 3
    expected = {
        "hr@1": 1 / 4,
        "hr@2": 1.5 / 4,
        "hr@4": 3 / 4,
        "ndcg@1": 1 / 4,
        "ndcg@2": (1 + 0.5 / math.log2(3)) / 4,
        "ndcg@4": (1 + 0.5 / math.log2(3) + 0.5 / math.log2(4) + 1 / math.log2(5)) / 4,
        "mrr": ((1 / 2 + 1 / 3) / 2 + 1 + 1 / 5 + 1 / 4) / 4,
        "count": 4.0,
    }
    result = metrics.compute()
    assert result.keys() == expected.keys()
    for name, value in expected.items():
        assert result[name] == pytest.approx(value, rel=1e-12), name


def test_compute_is_nan_before_any_update_and_reset_clears():
    metrics = RetrievalMetrics(ks=(1,))
    assert math.isnan(metrics.compute()["hr@1"])
    metrics.update_ranks(torch.tensor([0]))
    assert metrics.compute()["hr@1"] == 1.0
    metrics.reset()
    assert metrics.compute()["count"] == 0.0


def _random_case(num_users=37, num_items=101, dim=8):
    gen = torch.Generator().manual_seed(0)
    user = torch.randn(num_users, dim, generator=gen)
    items = torch.randn(num_items, dim, generator=gen)
    targets = torch.randint(0, num_items, (num_users,), generator=gen)
    return user, items, targets


@pytest.mark.parametrize("chunk_size", [1, 5, 36, 10_000])
def test_chunked_updates_equal_one_score_matrix(chunk_size):
    user, items, targets = _random_case()
    whole = RetrievalMetrics(ks=(1, 10, 50))
    whole.update_scores(user @ items.t(), targets)
    chunked = RetrievalMetrics(ks=(1, 10, 50), chunk_size=chunk_size)
    chunked.update(user, items, targets)
    assert chunked.compute() == pytest.approx(whole.compute(), rel=1e-12)


def test_streaming_batches_equal_one_batch():
    user, items, targets = _random_case()
    whole = RetrievalMetrics(ks=(1, 10, 50))
    whole.update(user, items, targets)
    streamed = RetrievalMetrics(ks=(1, 10, 50), chunk_size=4)
    for start in range(0, user.shape[0], 10):
        streamed.update(user[start : start + 10], items, targets[start : start + 10])
    assert streamed.compute() == pytest.approx(whole.compute(), rel=1e-12)


@pytest.mark.skipif(not dist.is_available(), reason="torch built without torch.distributed")
def test_compute_runs_its_all_reduce_in_a_one_process_gloo_group(tmp_path):
    user, items, targets = _random_case()
    local = RetrievalMetrics(ks=(1, 10, 50))
    local.update(user, items, targets)
    expected = local.compute()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        assert local.compute() == pytest.approx(expected, rel=1e-12)
    finally:
        dist.destroy_process_group()


def test_compute_sums_every_rank_before_dividing(monkeypatch):
    # a second rank is simulated by an all-reduce that adds its sums: one real process
    # per rank would cost several seconds of interpreter start-up each
    user, items, targets = _random_case()
    this_rank, other_rank, single = (RetrievalMetrics(ks=(1, 10, 50)) for _ in range(3))
    this_rank.update(user[:30], items, targets[:30])
    other_rank.update(user[30:], items, targets[30:])
    single.update(user, items, targets)
    expected = single.compute()

    def all_reduce(tensor, op):
        assert op == dist.ReduceOp.SUM
        tensor += other_rank._sums

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    assert this_rank.compute() == pytest.approx(expected, rel=1e-12)


def test_task_auc_on_a_hand_example():
    auc = TaskAUC(["click", "like"])
    # click: of the 4 (positive, negative) pairs, 0.35 < 0.4 is the only one ordered wrong
    auc.update(
        {"click": torch.tensor([0.1, 0.4]), "like": torch.tensor([-2.0, 3.0])},
        {"click": torch.tensor([0, 0]), "like": torch.tensor([0, 1])},
    )
    auc.update(
        {"click": torch.tensor([0.35, 0.8]), "like": torch.tensor([0.5, -1.0])},
        {"click": torch.tensor([1, 1]), "like": torch.tensor([1, 0])},
    )
    assert auc.compute() == pytest.approx({"click": 0.75, "like": 1.0})
    auc.reset()
    auc.update(
        {"click": torch.tensor([0.2, 0.9]), "like": torch.tensor([0.2, 0.9])},
        {"click": torch.tensor([1, 0]), "like": torch.tensor([0, 1])},
    )
    assert auc.compute() == pytest.approx({"click": 0.0, "like": 1.0})


def test_task_auc_rejects_duplicate_tasks():
    with pytest.raises(ValueError, match="distinct"):
        TaskAUC(["click", "click"])


def test_task_auc_raises_on_non_finite_scores():
    auc = TaskAUC(["click"])
    auc.update({"click": torch.tensor([0.1, math.nan])}, {"click": torch.tensor([0, 1])})
    with pytest.raises(NonFiniteError, match="1 ranking scores"):
        auc.compute()
