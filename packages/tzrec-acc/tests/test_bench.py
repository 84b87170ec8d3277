"""The benchmark script runs on the CPU at small sizes and prints every comparison.

Two AOTInductor compiles (full forward and serving step) of a one-layer model.
"""

from __future__ import annotations

import subprocess
import sys

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
        [sys.executable, "-m", "tzrec_acc.bench", *SMALL],
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
        [sys.executable, "-m", "tzrec_acc.bench", "--batch", "0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 2 and "--batch must be >= 1, got 0" in run.stderr


def test_movielens_batch_takes_each_user_s_last_ratings_as_candidates(tmp_path):
    import gzip

    import torch
    from _models import ranking

    from tzrec_acc import bench

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
    model = ranking(contextual_feature_dim=0, max_contextual_seq_len=0)  # as the bench's
    (batch,), labels = bench._movielens(str(tmp_path), model, users=5, new=2)
    assert batch["uih.sequence_length"].tolist() == [1, 2]
    assert batch["uih.item_id"].tolist() == [7, 11, 12]  # by time: user 1's first rating
    assert batch["candidate.item_id"].tolist() == [9, 5, 13, 14]
    assert batch["candidate_timestamp.sequence"].tolist() == [20, 30, 7, 8]
    assert batch["uih_action.sequence"].tolist() == [16, 1, 2]  # rating r -> bit r - 1
    assert labels.tolist() == [True, False, True, True]
    with torch.no_grad():
        assert model(batch).shape == (4, 2)
    (tmp_path / "u.data.gz").unlink()
    try:
        bench._movielens(str(tmp_path), model, 5, 2)
    except FileNotFoundError as exc:
        assert "no MovieLens-100K ratings (u.data or u.data.gz) in" in str(exc)
    else:
        raise AssertionError("a folder without ratings must raise FileNotFoundError")


def test_half_precision_parity_reports_the_dtype_spacing():
    import torch

    from tzrec_acc import bench

    line = bench._half_parity(
        [torch.tensor([1.5, -3.2])],
        [torch.tensor([1.5, -3.1875])],
        "bf16",
    )
    # bf16 keeps 8 significant bits: values in [2, 4) are 2**-6 apart
    assert line == "max abs diff 0.0125, largest |output| 3.2 (bf16 spacing there 0.0156)"
