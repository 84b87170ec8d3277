"""``tzrec-bench train-speed``: one round of two tiny shipped configs through the trainer, the
table's figures and ratios, two processes under torchrun (on CPUs; on two GPUs with the
captured step beside eager DDP), and bad options refused with the option named."""

from __future__ import annotations

import gc
import re
import weakref

import pytest
import torch
from _torchrun import torchrun_bench

from tzrec_bench.benchmarks import train_speed
from tzrec_bench.cli import main

TINY = ["--set", "synthetic_users=120", "--set", "max_seq_len=12", "--set", "embedding_dim=16",
        "--set", "batch_size=8", "--device", "cpu"]


def test_two_configs_side_by_side(capsys: pytest.CaptureFixture) -> None:
    code = main(["train-speed", "sasrec-synthetic", "hstu-retrieval-synthetic", "--modes", "eager",
                 "--steps", "2", "--rounds", "2", "--warmup", "1", *TINY])
    assert code == 0
    out = capsys.readouterr().out
    assert "median of 2 rounds of 2 steps after 1 warm-up steps" in out
    rows = {m.group(1): m for m in re.finditer(
        r"^(sasrec-synthetic|hstu-retrieval-synthetic)\s+eager\s+(\d+)\s+(\d+)\s+([\d.]+)\s+"
        r"([\d.]+)\s+([\d.]+)\s+([\d.]+)x$", out, re.M)}
    assert set(rows) == {"sasrec-synthetic", "hstu-retrieval-synthetic"}
    for row in rows.values():
        tokens_s, samples_s, step_ms = float(row.group(2)), float(row.group(3)), float(row.group(4))
        assert tokens_s > samples_s > 0  # every user brings several tokens
        # 8 users a step: samples/s and ms/step describe the same rounds
        assert samples_s * step_ms / 1e3 == pytest.approx(8, rel=0.02)
    assert float(rows["sasrec-synthetic"].group(7)) == 1.0
    ratio = float(rows["hstu-retrieval-synthetic"].group(7))
    assert ratio == pytest.approx(
        float(rows["hstu-retrieval-synthetic"].group(2)) / float(rows["sasrec-synthetic"].group(2)),
        abs=0.01)


def test_every_trainer_is_freed_before_the_process_group_is_left(monkeypatch, capsys):
    """A captured step's graphs hold NCCL's communicator, and destroy_process_group waits for
    them on two GPUs: no trainer may outlive the timing (the last one once did, held by a
    loop variable)."""
    made, alive_at_close = [], []

    class Recorded(train_speed.Trainer):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            made.append(weakref.ref(self))

    def close(ctx) -> None:
        gc.collect()
        alive_at_close.extend(ref() is not None for ref in made)

    monkeypatch.setattr(train_speed, "Trainer", Recorded)
    monkeypatch.setattr(train_speed, "close", close)
    assert main(["train-speed", "sasrec-synthetic", "hstu-retrieval-synthetic", "--modes",
                 "eager", "--steps", "1", "--rounds", "1", "--warmup", "1", *TINY]) == 0
    assert len(made) == 2 and alive_at_close == [False, False]
    assert "hstu-retrieval-synthetic" in capsys.readouterr().out


def _rows(out: str, modes: str) -> dict:
    return {(m.group(1), m.group(2)): float(m.group(3)) for m in re.finditer(
        rf"^(sasrec-synthetic|hstu-retrieval-synthetic)\s+({modes})\s+(\d+)\s", out, re.M)}


def test_two_processes_print_one_table_of_the_global_batch():
    run = torchrun_bench("train-speed", "sasrec-synthetic", "hstu-retrieval-synthetic",
                         "--modes", "eager", "--steps", "2", "--rounds", "1", "--warmup", "1",
                         *TINY)
    assert "2 processes" in run.stdout
    rows = _rows(run.stdout, "eager")
    assert set(rows) == {("sasrec-synthetic", "eager"), ("hstu-retrieval-synthetic", "eager")}
    assert all(rate > 0 for rate in rows.values())
    assert run.stdout.count("train-speed on") == 1  # rank 0 alone prints


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_on_two_gpus_the_captured_step_beside_eager_ddp_finishes():
    """The captured step's graphs hold NCCL's communicator (their all-reduce): the group is
    left only after they are freed, or destroy_process_group waits forever."""
    cuda = [arg if arg != "cpu" else "cuda" for arg in TINY]
    run = torchrun_bench("train-speed", "sasrec-synthetic", "hstu-retrieval-synthetic",
                         "--modes", "eager,graph", "--steps", "4", "--rounds", "1",
                         "--warmup", "3", *cuda, timeout=300)
    assert "2 processes" in run.stdout
    assert set(_rows(run.stdout, "eager|graph")) == {
        (name, mode) for name in ("sasrec-synthetic", "hstu-retrieval-synthetic")
        for mode in ("eager", "graph")}, run.stdout


@pytest.mark.parametrize("argv, message", [
    (["--modes", "eager,jit"], "--modes 'eager,jit'"),
    (["--steps", "0"], "--steps must be >= 1"),
    (["--set", "embedding_dims=8"], "--set 'embedding_dims=8': expected KEY=VALUE"),
    (["--set", "embedding_dim=wide"], "embedding_dim expects int values"),
])
def test_bad_options(argv, message, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["train-speed", "sasrec-synthetic", *argv])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
