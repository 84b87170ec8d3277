"""The edges of the command lines: a run that raises fails ``run-configs`` (judged or not,
a floor's too), every ``--device`` takes the same choices, ``auto`` included, and a bad
option is one line on stderr, exit status 2, with ``--help`` unchanged."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tzrec_bench.cli import build_parser, main
from tzrec_bench.regression.command import run
from tzrec_bench.regression.harness import FLOORS

CONFIG = """description = "a stand-in"
[train]
model = "hstu-retrieval"
data = "{data}"
seed = 3
"""


def _run_configs(argv, trainer):
    parser, subparsers = build_parser()
    return run(parser.parse_args(["run-configs", *argv]), subparsers["run-configs"], trainer)


def _raising(only_floors: bool = False):
    """A trainer whose runs raise (a floor's only, with ``only_floors``)."""

    def trainer(config):
        if only_floors and config.model not in FLOORS["retrieval"]:
            return {"ndcg@10": 0.5}
        raise OSError(f"the cache entry of seed {config.seed} could not be read back")

    return trainer


@pytest.mark.parametrize("judged", [False, True])
def test_a_run_that_raises_fails_with_or_without_a_baseline(tmp_path, capsys, judged):
    (tmp_path / "c.toml").write_text(CONFIG.format(data="synthetic"))
    (tmp_path / "baseline.toml").write_text("")  # judged, but no threshold for this config
    summary = tmp_path / "summary.json"
    argv = [str(tmp_path / "c.toml"), "--repeats", "2", "--no-floors", "--out", str(summary),
            "--work-dir", str(tmp_path / "runs"),
            *(["--baseline", str(tmp_path / "baseline.toml")] if judged else ["--no-baseline"])]
    assert _run_configs(argv, _raising()) == 1
    out, err = capsys.readouterr()
    assert "run failed: seed 3: OSError: the cache entry of seed 3" in out
    assert out.rstrip().splitlines()[-2].endswith("0 failed, 0 skipped configs, 2 failed runs")
    assert err == "run-configs: 2 run(s) raised (their 'run failed' lines above)\n"
    written = json.loads(summary.read_text())
    assert written["exit_code"] == 1 and written["counts"]["failed runs"] == 2


def test_a_floor_run_that_raises_fails_the_command(tmp_path, capsys):
    (tmp_path / "c.toml").write_text(CONFIG.format(data="synthetic"))
    argv = [str(tmp_path / "c.toml"), "--repeats", "1", "--no-baseline",
            "--work-dir", str(tmp_path / "runs")]
    assert _run_configs(argv, _raising(only_floors=True)) == 1
    out = capsys.readouterr().out
    assert out.count("run failed: seed 3: OSError") == len(FLOORS["retrieval"])
    assert f"{len(FLOORS['retrieval'])} failed runs" in out


def test_run_configs_on_data_that_raises_inside_the_run_exits_1(tmp_path, capsys):
    """The real trainer, through ``tzrec-bench``: the log cannot be read once the run starts."""
    (tmp_path / "events.parquet").write_bytes(b"not a parquet file")
    (tmp_path / "c.toml").write_text(CONFIG.format(data=tmp_path / "events.parquet"))
    summary = tmp_path / "summary.json"
    code = main(["run-configs", str(tmp_path / "c.toml"), "--no-baseline", "--no-floors",
                 "--repeats", "1", "--work-dir", str(tmp_path / "runs"), "--out", str(summary)])
    assert code == 1
    assert "run failed: seed 3: DataFormatError: " in capsys.readouterr().out
    assert json.loads(summary.read_text())["exit_code"] == 1
