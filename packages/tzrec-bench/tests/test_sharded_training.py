"""Training with the item table sharded by torchrec (``--sharding torchrec``): two gloo
processes against one, resume from every rank's shards, the gathered best.pt and its export.

Needs torchrec and fbgemm-gpu-cpu (the torchrec nox session installs them). Each torchrun
costs ~40 s on two CPU cores, most of it importing torchrec in both processes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import List

import pytest
import torch

pytest.importorskip("torchrec")

from torch.distributed.checkpoint import FileSystemReader  # noqa: E402

from tzrec_bench.train import checkpoint  # noqa: E402
from tzrec_bench.train.config import ConfigError, TrainConfig  # noqa: E402
from tzrec_bench.train.loop import evaluate, train  # noqa: E402

TINY = dict(
    data="synthetic", synthetic_users=48, synthetic_items=120, max_seq_len=16,
    embedding_dim=16, num_layers=1, num_heads=2, num_negatives=16, batch_size=16, lr=1e-2,
    eval_batch_size=64, log_every=1, dropout=0.0, sharding="torchrec", progress=False,
    plot=False,
)
TABLE_KEY = "model.model.item_embeddings.collection.embeddings.item.weight"


def _options(**overrides) -> List[str]:
    args = []
    for field, value in {**TINY, **overrides}.items():
        flag = "--" + field.replace("_", "-")
        if field == "progress":
            args.append("--no-progress")
        elif field == "plot":
            args.append("--no-plot")
        else:
            args += [flag, str(value)]
    return args


def _torchrun(out_dir: Path, *args: str) -> subprocess.CompletedProcess:
    run = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
         "2", "-m", "tzrec_bench", "train", "--out-dir", str(out_dir), *args],
        capture_output=True, text=True, timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    return run


@pytest.fixture(scope="module")
def one(tmp_path_factory):
    """One process, the same sharded setup (a process group of one)."""
    out = tmp_path_factory.mktemp("one")
    return train(TrainConfig(**TINY, out_dir=str(out), max_steps=6, eval_every=3))


def _assert_trains_like(out_dir: Path, one) -> None:
    """The tolerances of test_trainer's two-process test: float rounding only."""
    two = json.loads((out_dir / "metrics.json").read_text())
    history = json.loads((out_dir / "history.json").read_text())
    torch.testing.assert_close(
        torch.tensor([r["loss"] for r in history["train"]]),
        torch.tensor([r["loss"] for r in one.history["train"]]), rtol=1e-4, atol=1e-5,
    )
    for split, metrics in (("valid", one.valid), ("test", one.test)):
        for name, value in metrics.items():
            assert two[split][name] == pytest.approx(value, abs=0.021), (split, name)


def _table_chunks(folder: Path) -> List[tuple]:
    """(row offset, rows) of each saved piece of the item table, one per rank that holds it."""
    meta = FileSystemReader(str(folder)).read_metadata().state_dict_metadata[TABLE_KEY]
    return sorted((c.offsets[0], c.sizes[0]) for c in meta.chunks)


def test_row_wise_on_two_processes_trains_and_resumes_like_one(tmp_path, one):
    out = tmp_path / "two"
    first = _torchrun(out, *_options(max_steps=3, eval_every=3, sharding_type="row_wise"))
    # both ranks hold and write their half of the table
    (start0, rows0), (start1, rows1) = _table_chunks(out / "checkpoint.dcp")
    items = rows0 + rows1
    assert (start0, start1) == (0, rows0) and abs(rows0 - rows1) <= 1
    assert (f"item table {items} x 16 row_wise: rank 0: rows 0-{rows0 - 1}, rank 1: rows "
            f"{rows0}-{items - 1}") in first.stdout
    assert not (out / "checkpoint.dcp.partial").exists()
    payload = checkpoint.load(out / checkpoint.CHECKPOINT)
    assert payload[checkpoint.SHARDED] == {"folder": "checkpoint.dcp"} and "model" not in payload

    _torchrun(out, *_options(max_steps=6, eval_every=3, sharding_type="row_wise"), "--resume")
    _assert_trains_like(out, one)

    # best.pt holds the plain model, gathered: evaluate and tzrec-acc read it as any other
    best = checkpoint.load(out / checkpoint.BEST)
    assert best["model"]["item_embeddings.weight"].shape == (items, 16)
    assert not any("collection" in key for key in best["model"])
    test = evaluate(out, overrides={"sharding": "replicate"})
    for name, value in json.loads((out / "metrics.json").read_text())["test"].items():
        assert test[name] == pytest.approx(value, abs=1e-6), name

    # a sharded checkpoint resumes on as many processes only
    config = TrainConfig(**TINY, out_dir=str(out), max_steps=9, eval_every=3,
                         sharding_type="row_wise", resume=True)
    with pytest.raises(ConfigError, match=r"--resume: .* sharded over 2 process\(es\)"):
        train(config)


def test_table_wise_on_two_processes_trains_like_one(tmp_path, one):
    out = tmp_path / "two"
    run = _torchrun(out, *_options(max_steps=6, eval_every=3, sharding_type="table_wise"))
    assert " x 16 table_wise: rank " in run.stdout
    ((start, rows),) = _table_chunks(out / "best.dcp")  # the whole table on one rank
    assert start == 0 and f"item table {rows} x 16 table_wise" in run.stdout
    _assert_trains_like(out, one)


def test_a_sharded_runs_best_pt_exports_with_tzrec_acc(tmp_path, one):
    package = tmp_path / "model.pt2"
    run = subprocess.run(
        [sys.executable, "-m", "tzrec_acc", "export", "--model",
         str(one.out_dir / checkpoint.BEST), "--format", "fx", "--output", str(package)],
        capture_output=True, text=True, timeout=300,
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    assert "package vs eager" in run.stdout and package.is_file()


def test_ranking_trains_sharded(tmp_path):
    result = train(TrainConfig(**{**TINY, "model": "hstu-ranking", "num_candidates": 4},
                               out_dir=str(tmp_path / "run"), max_steps=4))
    assert 0.0 <= result.test["auc"] <= 1.0
    best = checkpoint.load(tmp_path / "run" / checkpoint.BEST)
    items = best["model_config"]["kwargs"]["num_items"]
    assert best["model"]["item_embeddings.weight"].shape == (items, 16)


@pytest.mark.parametrize(
    "overrides,message",
    [
        ({"model": "sasrec"}, r"--sharding: torchrec shards tzrec-gr's item tables"),
        ({"table_optimizer": "adam"}, r"--table-optimizer: 'adam' has no CPU kernel"),
        ({"num_negatives": 1000}, r"--num-negatives: 1000 >= the 1\d\d items"),
    ],
)
def test_configurations_that_cannot_shard_fail_before_training(tmp_path, overrides, message):
    with pytest.raises(ConfigError, match=message):
        train(TrainConfig(**{**TINY, **overrides}, out_dir=str(tmp_path / "run")))
