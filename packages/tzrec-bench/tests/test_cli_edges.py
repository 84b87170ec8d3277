"""The edges of the command lines: a run that raises fails ``run-configs`` (judged or not,
a floor's too), every ``--device`` takes the same choices, ``auto`` included, and a bad
option is one line on stderr, exit status 2, with ``--help`` unchanged."""

from __future__ import annotations

import json

import pytest
import torch

from tzrec_bench.cli import build_parser, main
from tzrec_bench.regression.command import run
from tzrec_bench.regression.harness import floor_models

#: the simple baselines run beside a retrieval config
RETRIEVAL_FLOORS = floor_models("retrieval")

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
        if only_floors and config.model not in RETRIEVAL_FLOORS:
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
    assert out.count("run failed: seed 3: OSError") == len(RETRIEVAL_FLOORS)
    assert f"{len(RETRIEVAL_FLOORS)} failed runs" in out


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


# -- one --device rule -----------------------------------------------------------------------


def _no_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def _parsers():
    """(name, a parser of a command taking --device, its other required arguments);
    ``python -m tzrec_acc export`` is tzrec-acc's own test (test_cli_edges.py there)."""
    from tzrec_bench.benchmarks import export as export_bench
    from tzrec_bench.benchmarks import load_test
    from tzrec_bench.benchmarks import serving as serving_bench

    return [
        ("serving_bench", serving_bench._parser(), []),
        ("export_bench", export_bench._parser(), []),
        ("load_test", load_test._parser(), []),
    ]


@pytest.mark.parametrize("index", range(3))
def test_every_device_option_resolves_auto_once(monkeypatch, index):
    _no_cuda(monkeypatch)
    name, parser, required = _parsers()[index]
    args = parser.parse_args([*required, "--device", "auto"])
    assert args.device == torch.device("cpu"), name  # resolved as parsed, not the raw string
    args = parser.parse_args([*required, "--device", "cpu"])
    assert args.device == torch.device("cpu"), name


def test_plan_and_train_take_auto(monkeypatch):
    _no_cuda(monkeypatch)
    parser, _ = build_parser()
    plan = ["plan", "--items", "1e5", "--embedding-dim", "8", "--world-size", "2"]
    assert parser.parse_args([*plan, "--device", "auto"]).device == "cpu"  # this machine's
    assert parser.parse_args([*plan, "--device", "cuda:3"]).device == "cuda"  # a kind, no GPU
    assert parser.parse_args(["train", "--device", "auto"]).device == "auto"  # per rank, later
    assert parser.parse_args(["evaluate", "run", "--device", "auto"]).device == "auto"


@pytest.mark.parametrize("module",
                         ["benchmarks.serving", "benchmarks.load_test", "benchmarks.export"])
def test_a_device_this_machine_lacks_is_the_options_one_line_error(monkeypatch, capsys, module):
    _no_cuda(monkeypatch)
    main_of = __import__(f"tzrec_bench.{module}", fromlist=["main"]).main
    with pytest.raises(SystemExit) as info:
        main_of(["--device", "cuda"])
    prog = f"python -m tzrec_bench.{module}"
    assert info.value.code == 2
    assert capsys.readouterr().err == (
        f"{prog}: error: argument --device: cuda: no CUDA device is visible to this process "
        f"({prog} --help lists the options)\n")


# -- one-line argparse errors ----------------------------------------------------------------


def _mains():
    from tzrec_acc.cli import main as acc_main
    from tzrec_bench.benchmarks import data as data_bench
    from tzrec_bench.benchmarks import export as export_bench
    from tzrec_bench.benchmarks import load_test, table_memory
    from tzrec_bench.benchmarks import serving as serving_bench

    bench = "tzrec-bench"
    benchmarks = "python -m tzrec_bench.benchmarks"
    return [
        (main, ["train", "--lr", "x"], f"{bench} train", "argument --lr: expected a number"),
        (main, ["evaluate"], f"{bench} evaluate", "the following arguments are required: PATH"),
        (main, ["predict"], f"{bench} predict", "the following arguments are required: "),
        (main, ["ops"], f"{bench} ops", "the following arguments are required: --op"),
        (main, ["run-configs", "--repeats", "x"], f"{bench} run-configs", "argument --repeats"),
        (main, ["plan"], f"{bench} plan", "required: --items"),
        (main, ["nope"], bench, "argument COMMAND: invalid choice: 'nope'"),
        (main, [], bench, "the following arguments are required: COMMAND"),
        (acc_main, ["export", "--model", "m"], "python -m tzrec_acc export", "--output"),
        (acc_main, ["run"], "python -m tzrec_acc run", "required: package"),
        (acc_main, ["predict"], "python -m tzrec_acc predict", "required: model"),
        (acc_main, ["what"], "python -m tzrec_acc", "invalid choice: 'what'"),
        (serving_bench.main, ["--users", "x"], f"{benchmarks}.serving", "--users"),
        (export_bench.main, ["--batch", "x"], f"{benchmarks}.export", "--batch"),
        (load_test.main, ["--rate", "x"], "python -m tzrec_bench.benchmarks.load_test", "--rate"),
        (data_bench.main, ["--nope"], f"{benchmarks}.data", "required: --folder"),
        (table_memory.main, ["--nope"], f"{benchmarks}.table_memory", "required: --items"),
    ]


@pytest.mark.parametrize("index", range(17))
def test_a_bad_option_is_one_line_and_status_2(capsys, index):
    run_main, argv, prog, message = _mains()[index]
    with pytest.raises(SystemExit) as info:
        run_main(argv)
    err = capsys.readouterr().err
    assert info.value.code == 2, err
    assert err.startswith(f"{prog}: error: ") and message in err, err
    assert err.endswith(f" ({prog} --help lists the options)\n") and err.count("\n") == 1, err


def test_an_error_found_after_parsing_is_one_line_too(tmp_path, capsys):
    with pytest.raises(SystemExit) as info:  # the subcommand's parser.error, after parsing
        main(["evaluate", str(tmp_path / "no-run")])
    err = capsys.readouterr().err
    assert info.value.code == 2 and err.count("\n") == 1
    assert err.startswith("tzrec-bench evaluate: error: checkpoint: no checkpoint at ")


def test_help_is_argparses_own(capsys):
    with pytest.raises(SystemExit) as info:
        main(["train", "--help"])
    out = capsys.readouterr().out
    assert info.value.code == 0 and out.startswith("usage: tzrec-bench train")
    assert "--device {auto,cpu,cuda}" in out and "lists the options" not in out
