"""Evaluation that shows progress and costs what it should: the full-catalogue scoring reuses
its [B, I] buffers (same metrics as scoring each batch afresh), validation, test and
``evaluate`` draw a progress bar, and ``--test-users`` bounds the test users, with the number
evaluated in the table and metrics.json."""

from __future__ import annotations

import json
import math
import re
import resource
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from tzrec_bench.cli import main
from tzrec_bench.data import load_dataset, make_eval_batch
from tzrec_bench.train.config import TrainConfig
from tzrec_bench.train.distributed import init_distributed
from tzrec_bench.train.factory import build_model, make_task
from tzrec_bench.train.loop import evaluate, train
from tzrec_bench.train.metrics import RetrievalMetrics, ScoreBuffers, non_finite_rows
from tzrec_bench.train.retrieval import seen_pairs
from tzrec_bench.train.sampled import SampledMetrics
from tzrec_bench.train.task import autocast, chunks, eval_rows
from tzrec_bench.train.tasks import RETRIEVAL_KS

TINY = dict(
    data="synthetic", synthetic_users=48, synthetic_items=120, max_seq_len=16,
    embedding_dim=16, num_layers=1, num_heads=2, num_negatives=16, num_candidates=4,
    batch_size=16, lr=1e-2, eval_batch_size=20, log_every=1, progress=False, plot=False,
    device="cpu",
)


def _config(tmp_path: Path, **overrides) -> TrainConfig:
    return TrainConfig(**{**TINY, "out_dir": str(tmp_path / "run"), **overrides})


def _unbuffered_metrics(task, model, split: str) -> dict:
    """The evaluation as it was before the buffers: each batch's scores, masks and counts
    allocated afresh (``user @ items.T`` under autocast, a dense mask of the seen items,
    bool comparisons summed)."""
    config, held = task.config, getattr(task.split, split)
    metrics = RetrievalMetrics(RETRIEVAL_KS, device=torch.device("cpu"))
    sampled = SampledMetrics(torch.device("cpu")) if config.eval_negatives else None
    score_catalogue = getattr(model, "catalogue_scores", None)
    with torch.no_grad(), autocast(torch.device("cpu"), task._amp):
        if score_catalogue is None:
            items = model.item_embedding(torch.arange(task.num_items)).float()
        for chunk in chunks(eval_rows(len(held), None, config.seed), config.eval_batch_size):
            cpu = make_eval_batch(held, chunk, config.max_seq_len)
            history = task._history(cpu)
            if score_catalogue is None:
                scores = model.user_embedding(*history).float() @ items.t()
            else:
                scores = score_catalogue(*history).float()
            targets = cpu.targets
            if sampled is not None:
                drawn = torch.from_numpy(task._sampled_negatives(split, held)[chunk])
                sampled.update(scores.gather(1, targets.unsqueeze(1)).squeeze(1),
                               scores.gather(1, drawn))
            non_finite = (~torch.isfinite(scores).all(dim=1)).sum()
            if config.exclude_seen:
                seen = torch.zeros(len(chunk), task.num_items, dtype=torch.bool)
                seen[seen_pairs(held.history, chunk)] = True
                seen[torch.arange(len(chunk)), targets] = False
                scores = scores.masked_fill(seen, -math.inf)
            target_score = scores.gather(1, targets.unsqueeze(1))
            higher = (scores > target_score).sum(dim=1)
            ties = (scores == target_score).sum(dim=1) - 1
            metrics.update_ranks(higher, ties, non_finite)
    return {**metrics.compute(), **(sampled.compute() if sampled is not None else {})}


@pytest.mark.parametrize(
    ("model", "settings"),
    [
        ("hstu-retrieval", {}),
        ("hstu-retrieval", {"exclude_seen": True, "eval_negatives": 7}),
        ("hstu-retrieval", {"amp": "bf16"}),  # autocast multiplies in bf16: so do the buffers
        ("sasrec", {"exclude_seen": True}),
        ("item-knn", {"exclude_seen": True, "eval_negatives": 7}),
        ("most-popular", {}),
    ],
)
def test_buffered_scoring_gives_exactly_the_metrics_of_fresh_tensors(tmp_path, model, settings):
    """Exact equality, not a tolerance: the same products and comparisons, only written into
    reused buffers (the batch of 20 leaves a short last batch of 8 of the 48 users)."""
    config = _config(tmp_path, model=model, **settings)
    ctx = init_distributed("cpu")
    torch.manual_seed(0)
    dataset = load_dataset("synthetic", None, None, 0, num_users=48, num_items=120)
    task = make_task(config, dataset, ctx)
    net = build_model(config, task.num_items, task.task_bits, ctx.device).eval()
    if hasattr(net, "fit"):
        net.fit(task.split.train)
    for split in ("valid", "test"):
        assert task.evaluate(net, split, None) == _unbuffered_metrics(task, net, split)


class _LastItem(nn.Module):
    """A user is the embedding of its last item, so that the scoring is the whole cost."""

    def __init__(self, num_items: int, dim: int) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        self.table = nn.Parameter(torch.randn(num_items, dim, generator=generator))

    def item_embedding(self, ids: torch.Tensor) -> torch.Tensor:
        return self.table[ids]

    def user_embedding(self, item_ids, lengths, timestamps, max_seq_len) -> torch.Tensor:
        return self.table[item_ids[torch.cumsum(lengths, 0) - 1]]


def test_batches_reuse_the_score_buffers_instead_of_faulting_in_fresh_pages(tmp_path):
    """10 batches of 128 users x ~10k items: scoring each batch afresh allocated [B, I]
    tensors above glibc's mmap threshold (scores, comparison masks and their int64 sums),
    whose pages fault in again on every batch, ~6 scores' worth per batch. The buffers are
    allocated once: far fewer minor page faults than one scores tensor per batch."""
    config = _config(tmp_path, synthetic_users=3000, synthetic_items=14000, eval_batch_size=128,
                     exclude_seen=True)
    ctx = init_distributed("cpu")
    dataset = load_dataset("synthetic", None, None, 0, num_users=3000, num_items=14000)
    task = make_task(config, dataset, ctx)
    model = _LastItem(task.num_items, 16)
    task.evaluate(model, "test", 128)  # the libraries' first-call costs
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    task.evaluate(model, "test", 1280)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    scores_pages = 128 * task.num_items * 4 // 4096
    assert task.num_items > 8000
    assert faults < 10 * scores_pages, (faults, scores_pages)


def test_score_buffers_multiply_into_one_buffer_and_count_non_finite_rows():
    buffers = ScoreBuffers(4, 6, torch.float32)
    user, items = torch.randn(3, 5), torch.randn(6, 5)
    scores = buffers.dot(user, items)
    assert scores.data_ptr() == buffers.scores.data_ptr() and scores.shape == (3, 6)
    assert torch.equal(scores, user @ items.t())
    again = buffers.dot(user[:2], items)
    assert again.data_ptr() == scores.data_ptr()
    bad = torch.zeros(4, 3)
    bad[0, 1], bad[2, 0], bad[3, 2] = math.nan, math.inf, -math.inf
    assert int(non_finite_rows(bad)) == 3


def test_seen_pairs_leave_out_each_rows_own_target():
    dataset = load_dataset("synthetic", None, None, 0, num_users=10, num_items=30)
    history = dataset  # any sequences: row r's history is its whole sequence here
    rows = np.array([0, 3])
    user, item = seen_pairs(history, rows)
    targets = np.array([history.sequence(0)[0], history.sequence(3)[-1]])
    kept_user, kept_item = seen_pairs(history, rows, targets)
    dropped = {(u, i) for u, i in zip(user.tolist(), item.tolist())} - set(
        zip(kept_user.tolist(), kept_item.tolist()))
    assert dropped == {(0, int(targets[0])), (1, int(targets[1]))}
    assert not ((kept_item.numpy() == targets[kept_user.numpy()]).any())


def _frames(err: str) -> list:
    return [frame.strip() for frame in re.split(r"[\r\n]", err) if frame.strip()]


@pytest.mark.parametrize("model", ["hstu-retrieval", "hstu-ranking", "most-popular"])
def test_validation_test_and_evaluate_draw_a_progress_bar(tmp_path, capsys, model):
    capsys.readouterr()
    train(_config(tmp_path, model=model, max_steps=2, progress=True))
    frames = _frames(capsys.readouterr().err)
    for split, users in (("valid", 48), ("test", 48)):
        assert any(re.match(rf"evaluating {split}: .*/{users} \[", f) for f in frames), frames
    evaluate(tmp_path / "run", "valid")
    assert any(f.startswith("evaluating valid: ") for f in _frames(capsys.readouterr().err))


def test_no_progress_draws_no_evaluation_bar(tmp_path, capsys):
    capsys.readouterr()
    train(_config(tmp_path, max_steps=2))
    evaluate(tmp_path / "run", "test", {"progress": False})
    assert "evaluating" not in capsys.readouterr().err
    main(["evaluate", str(tmp_path / "run"), "--no-progress"])
    captured = capsys.readouterr()
    assert "evaluating" not in captured.err and "users     48" in captured.out


@pytest.mark.parametrize("model", ["hstu-retrieval", "hstu-ranking"])
def test_test_users_bound_the_test_and_every_report_says_how_many(tmp_path, capsys, model):
    result = train(_config(tmp_path, model=model, max_steps=2, eval_users=30, test_users=20))
    assert result.test["count"] == 20 and result.valid["count"] == 30
    out = capsys.readouterr().out
    assert "48 evaluated users (validation on 30, test on 20)" in out
    assert re.search(r"^users +30 of 48 +20 of 48$", out, re.M), out
    summary = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert summary["users"] == {"valid": {"evaluated": 30, "of": 48},
                                "test": {"evaluated": 20, "of": 48}}
    assert summary["test"]["count"] == 20
    # evaluate --max-users N takes the same fixed subset: the same metrics
    assert evaluate(tmp_path / "run", "test", max_users=20) == result.test
    assert re.search(r"^users +20 of 48$", capsys.readouterr().out, re.M)


def test_the_test_users_option_on_the_command_line(tmp_path, capsys):
    args = ["train", "--data", "synthetic", "--synthetic-users", "48", "--synthetic-items",
            "120", "--max-seq-len", "16", "--embedding-dim", "16", "--num-layers", "1",
            "--batch-size", "16", "--max-steps", "1", "--no-plot", "--no-progress",
            "--device", "cpu", "--out-dir", str(tmp_path / "run")]
    assert main([*args, "--test-users", "12"]) == 0
    assert re.search(r"^users +48 +12 of 48$", capsys.readouterr().out, re.M)
    assert main(["evaluate", str(tmp_path / "run"), "--max-users", "12", "--no-progress"]) == 0
    assert re.search(r"^users +12 of 48$", capsys.readouterr().out, re.M)
    with pytest.raises(SystemExit) as exit_info:
        main([*args, "--test-users", "0"])
    assert exit_info.value.code == 2
    assert "--test-users" in capsys.readouterr().err
