"""Full-catalogue retrieval metrics and per-task AUC."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from tzrec_bench.train.metrics import RetrievalMetrics, TaskAUC, target_ranks

# item scores for the user [1, 0] are 3, 1, 2, 2, 0: items 2 and 3 tie
ITEMS = torch.tensor([[3.0, 0.0], [1.0, 0.0], [2.0, 0.0], [2.0, 0.0], [0.0, 0.0]])


def test_ranks_count_strictly_higher_items_so_ties_favour_the_target():
    user = torch.tensor([[1.0, 0.0]] * 4 + [[-1.0, 0.0]])
    targets = torch.tensor([2, 0, 4, 1, 4])
    # target 2 (score 2): only item 0 is higher, its tie with item 3 does not count
    assert target_ranks(user, ITEMS, targets).tolist() == [1, 0, 4, 3, 0]


def test_hand_computed_hr_ndcg_mrr():
    metrics = RetrievalMetrics(ks=(1, 2, 4))
    metrics.update(torch.tensor([[1.0, 0.0]] * 4), ITEMS, torch.tensor([2, 0, 4, 1]))
    # ranks 1, 0, 4, 3
    expected = {
        "hr@1": 1 / 4,
        "hr@2": 2 / 4,
        "hr@4": 3 / 4,
        "ndcg@1": 1 / 4,
        "ndcg@2": (1 + 1 / math.log2(3)) / 4,
        "ndcg@4": (1 + 1 / math.log2(3) + 1 / math.log2(5)) / 4,
        "mrr": (1 / 2 + 1 + 1 / 5 + 1 / 4) / 4,
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


@pytest.mark.parametrize("chunk_size", [1, 5, 36])
def test_chunked_ranks_equal_unchunked(chunk_size):
    user, items, targets = _random_case()
    expected = ((user @ items.t()) > (user @ items.t()).gather(1, targets[:, None])).sum(1)
    torch.testing.assert_close(target_ranks(user, items, targets, chunk_size), expected)
    torch.testing.assert_close(target_ranks(user, items, targets, 10_000), expected)


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
