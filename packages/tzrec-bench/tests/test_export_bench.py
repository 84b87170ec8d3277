"""The export benchmark runs on the CPU at small sizes and prints every comparison.

Two AOTInductor compiles (full forward and serving step) of a one-layer model.
"""

from __future__ import annotations

import gzip
import subprocess
import sys

import torch

from tzrec_bench.benchmarks import export as export_bench
from tzrec_bench.data import load_dataset
from tzrec_gr.models import HSTURanking

MODULE = "tzrec_bench.benchmarks.export"
SMALL = [
    "--batch",
    "2",
    "--history",
    "16",
    "--new",
    "4",
    "--dim",
    "16",
    "--layers",
    "1",
    "--heads",
    "2",
    "--items",
    "100",
    "--repeats",
    "2",
]


def test_bench_prints_comparable_figures():
    run = subprocess.run(
        [sys.executable, "-m", MODULE, *SMALL],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    out = run.stdout
    assert out.startswith("device cpu") and "torch " in out and "triton " in out
    assert (
        "HSTURanking E=16, 2 heads, 1 layers, backend pytorch, fp32; B=2, histories of 16 events"
        in out
    )
    assert out.count("package vs eager: output 0") == 2 and "MISMATCH" not in out
    assert "1. full forward: eager " in out and " ms, AOTInductor package " in out
    assert "2. serving step (4 candidates vs a 16-event cache): package " in out
    assert "3. int8 dense + int8 embeddings (CPU, eager), synthetic" in out and "AUC 1.0000" in out


def test_bench_rejects_bad_sizes():
    run = subprocess.run(
        [sys.executable, "-m", MODULE, "--batch", "0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 2 and "--batch must be >= 1, got 0" in run.stderr


def test_bench_rejects_a_folder_without_ratings_before_compiling(tmp_path):
    run = subprocess.run(
        [sys.executable, "-m", MODULE, *SMALL, "--movielens", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 2, run.stderr[-3000:]
    assert f"error: {tmp_path / 'u.data'} not found (nor u.data.gz)" in run.stderr


def test_movielens_batch_takes_each_user_s_last_ratings_as_candidates(tmp_path):
    # user item rating time; user 3 has too few ratings for 2 candidates and is skipped
    rows = [
        (1, 5, 3, 30),
        (1, 7, 5, 10),
        (1, 9, 4, 20),
        (2, 11, 1, 5),
        (2, 12, 2, 6),
        (2, 13, 5, 7),
        (2, 14, 4, 8),
        (3, 1, 4, 1),
        (3, 2, 4, 2),
    ]
    text = "\n".join("\t".join(map(str, r)) for r in rows)
    (tmp_path / "u.data.gz").write_bytes(gzip.compress(text.encode()))
    ratings = load_dataset("ml-100k", tmp_path, tmp_path / "cache")
    torch.manual_seed(0)
    model = HSTURanking(
        num_items=40,
        item_embedding_dim=8,
        embedding_dim=16,
        task_bitmasks=[1, 2],
        action_weights=[1, 2, 4],
        dropout_ratio=0.0,
        max_uih_len=10,
        max_targets=4,
        backend="pytorch",
    ).eval()
    (batch,), labels = export_bench._movielens(ratings, model, users=5, new=2)
    assert batch["uih.sequence_length"].tolist() == [1, 2]
    # dense item ids in the order of the raw ids (1, 2, 5, 7, 9, 11, 12, 13, 14 -> 0 ... 8),
    # as tzrec-bench train gives a model; by time: user 1's first rating is item 7
    assert batch["uih.item_id"].tolist() == [3, 5, 6]
    assert batch["candidate.item_id"].tolist() == [4, 2, 7, 8]
    assert batch["candidate_timestamp.sequence"].tolist() == [20, 30, 7, 8]
    assert batch["uih_action.sequence"].tolist() == [16, 1, 2]  # rating r -> bit r - 1
    assert labels.tolist() == [True, False, True, True]
    with torch.no_grad():
        assert model(batch).shape == (4, 2)


def test_half_precision_parity_reports_the_dtype_spacing():
    line = export_bench._half_parity(
        [torch.tensor([1.5, -3.2])],
        [torch.tensor([1.5, -3.1875])],
        "bf16",
    )
    # bf16 keeps 8 significant bits: values in [2, 4) are 2**-6 apart
    assert line == "max abs diff 0.0125, largest |output| 3.2 (bf16 spacing there 0.0156)"
