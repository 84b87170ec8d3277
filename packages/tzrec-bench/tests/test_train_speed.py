"""``tzrec-bench train-speed``: one round of two tiny shipped configs through the trainer, the
table's figures and ratios, and bad options refused with the option named."""

from __future__ import annotations

import re

import pytest

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
