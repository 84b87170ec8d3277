"""Ctrl-C under torchrun: every rank stops at one step, rank 0 prints how to go on.

torchrun starts each rank in a session of its own, so a Ctrl-C at the terminal reaches
torchrun alone; its agent sends every rank one SIGINT (``os.killpg``) and SIGKILLs what is
left 30 s later, then raises the signal itself: torchrun prints its own traceback
(``SignalException``) and exits 1 whatever its ranks do. These tests check the ranks: no
traceback, one line and the command from rank 0, exit status 130 on every rank.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import IO, List

import torch

from tzrec_bench.train import checkpoint
from tzrec_bench.train.config import TrainConfig
from tzrec_bench.train.loop import train

# the tiny run of test_trainer.py, dropout off (every rank its own masks), no early stop;
# on the CPU (gloo) wherever it runs, so that one and two processes agree closely
TINY = dict(
    device="cpu", data="synthetic", synthetic_users=48, synthetic_items=120, max_seq_len=16,
    embedding_dim=16, num_layers=1, num_heads=2, num_negatives=16, batch_size=16, lr=1e-2,
    eval_batch_size=64, log_every=1, dropout=0.0, eval_every=3, patience=0, max_steps=12,
)
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
# one thread per rank: two ranks share the two cores of a CI machine
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
INTERRUPTED = "tzrec-bench: interrupted at step "
CONTINUE = "continue with: "


def _args(out_dir: Path) -> List[str]:
    args = ["train", "--out-dir", str(out_dir), "--no-progress", "--no-plot"]
    for name, value in TINY.items():
        args += ["--" + name.replace("_", "-"), str(value)]
    return args


def _read_until(stream: IO[str], text: str) -> str:
    """The lines of ``stream`` up to the first that holds ``text`` (all of it at its end)."""
    lines = []
    for line in stream:
        lines.append(line)
        if text in line:
            break
    return "".join(lines)


def _resume_command(stderr: str) -> List[str]:
    """The command rank 0 printed, as an argv (torchrun as ``python -m torch.distributed.run``,
    which needs no ``torchrun`` on the PATH)."""
    assert stderr.count(CONTINUE) == 1, stderr
    command = shlex.split(stderr.split(CONTINUE)[1].splitlines()[0])
    assert command[:5] == ["torchrun", "--standalone", "--nproc-per-node", "2", "-m"], command
    assert command[5:7] == ["tzrec_bench", "train"] and command[-1] == "--resume", command
    return [*TORCHRUN, *command[1:]]


def _interrupted_step(stderr: str, out_dir: Path) -> int:
    assert stderr.count(INTERRUPTED) == 1, stderr
    line = stderr.split(INTERRUPTED)[1].splitlines()[0]
    step, saved = line.split("; checkpoint saved to ")
    assert saved == str(out_dir / checkpoint.CHECKPOINT)
    assert checkpoint.load(out_dir / checkpoint.CHECKPOINT)["step"] == int(step)
    assert not (out_dir / "metrics.json").exists()
    return int(step)


def test_ctrl_c_under_torchrun_stops_the_ranks_at_one_step_and_the_command_resumes(tmp_path):
    """Ctrl-C as a terminal sends it (SIGINT to torchrun's process group) after step 3 of
    12; the printed torchrun command then finishes the run, on the same global batches as
    an uninterrupted one-process run (the tolerances of test_two_gloo_processes_train_like_one)."""
    out = tmp_path / "two"
    run = subprocess.Popen(
        [*TORCHRUN, "--standalone", "--nproc-per-node", "2", "-m", "tzrec_bench",
         *_args(out)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV,
        start_new_session=True,
    )
    before = _read_until(run.stdout, "step 3: valid")
    os.killpg(run.pid, signal.SIGINT)
    stdout, stderr = run.communicate(timeout=90)
    assert "step 3: valid" in before, before + stdout + stderr
    step = _interrupted_step(stderr, out)
    assert 3 <= step < TINY["max_steps"]
    # torchrun's own traceback is the only one, and the last thing it prints
    assert stderr.count("Traceback") <= 1 and "KeyboardInterrupt" not in stderr, stderr
    assert "Traceback" not in stderr or stderr.index(CONTINUE) < stderr.index("Traceback")
    # every rank ended by itself: torchrun's agent did not have to SIGKILL one after 30 s
    assert "forcefully exiting" not in stderr, stderr

    resumed = subprocess.run(_resume_command(stderr), capture_output=True, text=True,
                             timeout=240, env=ENV)
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-3000:]
    assert f"resumed from {out / checkpoint.CHECKPOINT} at step {step}" in resumed.stdout
    assert json.loads((out / "metrics.json").read_text())["steps"] == TINY["max_steps"]
    one = train(TrainConfig(**{**TINY, "out_dir": str(tmp_path / "one"), "progress": False,
                               "plot": False}))
    history = json.loads((out / "history.json").read_text())
    assert [r["step"] for r in history["train"]] == list(range(1, TINY["max_steps"] + 1))
    torch.testing.assert_close(
        torch.tensor([r["loss"] for r in history["train"]]),
        torch.tensor([r["loss"] for r in one.history["train"]]), rtol=1e-4, atol=1e-5,
    )


def test_a_signal_to_one_rank_stops_every_rank_and_each_exits_130(tmp_path):
    """The ranks started as torchrun starts them (the same variables, a session each), and
    SIGINT to rank 1 alone: rank 0 never sees one, yet both stop at the same step (the
    checkpoint's), rank 0 prints the two lines, rank 1 nothing, and both exit 130."""
    with socket.socket() as probe:  # a free port for the rendezvous of the two ranks
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {**ENV, "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port)}
    out = tmp_path / "run"
    ranks = [
        subprocess.Popen(
            [sys.executable, "-u", "-m", "tzrec_bench", *_args(out)],  # as torchrun does
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)}, start_new_session=True,
        )
        for rank in range(2)
    ]
    before = _read_until(ranks[0].stdout, "step 3: valid")
    os.killpg(ranks[1].pid, signal.SIGINT)
    outputs = [rank.communicate(timeout=90) for rank in ranks]
    assert [rank.returncode for rank in ranks] == [130, 130], (before, outputs)
    (_, err0), (out1, err1) = outputs
    step = _interrupted_step(err0, out)
    assert err0.splitlines() == [
        f"{INTERRUPTED}{step}; checkpoint saved to {out / checkpoint.CHECKPOINT}",
        CONTINUE + shlex.join(["torchrun", "--standalone", "--nproc-per-node", "2", "-m",
                               "tzrec_bench", *_args(out), "--resume"]),
    ]
    assert (out1, err1) == ("", "")


def test_the_resume_command_names_the_launch_and_only_rank_0_prints(monkeypatch, capsys):
    from tzrec_bench import cli
    from tzrec_bench.train import loop

    argv = ["train", "--max-steps", "9"]
    stop = loop.Interrupted(4, Path("run/checkpoint.pt"))
    for name in ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "RANK"):
        monkeypatch.delenv(name, raising=False)
    message = cli._interrupted_message(stop, argv)
    assert message.endswith("\ncontinue with: tzrec-bench train --max-steps 9 --resume")
    monkeypatch.setenv("WORLD_SIZE", "16")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert cli._interrupted_message(stop, argv).splitlines()[1:] == [
        "continue with: torchrun --nnodes 2 --nproc-per-node 8 -m tzrec_bench train "
        "--max-steps 9 --resume",
        "(on every node, with this run's rendezvous options)",
    ]

    def interrupted(config):
        raise stop

    monkeypatch.setattr(loop, "train", interrupted)
    for rank, printed in (("3", ""), ("0", "tzrec-bench: interrupted at step 4; ")):
        monkeypatch.setenv("RANK", rank)
        assert cli.main(["train", "--data", "synthetic"]) == 130
        assert capsys.readouterr().err.startswith(printed)
