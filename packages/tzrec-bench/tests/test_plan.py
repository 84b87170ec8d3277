"""``tzrec-bench plan``: torchrec's planner on simulated clusters, through the command's parser
and ``run`` (the report is read back from ``--json`` and from what it prints)."""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

import pytest

pytest.importorskip("torchrec")

from tzrec_bench import plan  # noqa: E402

GIB = 1024**3


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tzrec-bench")
    plan.add_parser(parser.add_subparsers(dest="command"))
    return parser


def _run(argv, tmp_path=None):
    """(exit status, report dict or None) of ``tzrec-bench plan argv``."""
    argv = ["plan", *argv]
    if tmp_path is not None:
        argv += ["--json", str(tmp_path / "plan.json")]
    status = plan.run(_parser().parse_args(argv))
    report = None
    if tmp_path is not None and status == 0:
        report = json.loads((tmp_path / "plan.json").read_text())
    return status, report


def test_row_wise_splits_the_rows_over_every_rank(tmp_path, capsys):
    n = 1_000_003  # not a multiple of 4: the last shard is shorter
    status, report = _run(["--items", str(n), "--embedding-dim", "64", "--world-size", "4",
                           "--device", "cpu", "--sharding-type", "row_wise"], tmp_path)
    assert status == 0
    shards = report["shards"]
    assert report["sharding_type"] == "row_wise"
    assert sorted(s["rank"] for s in shards) == [0, 1, 2, 3]
    assert sum(s["rows"] for s in shards) == n
    assert all(s["columns"] == 64 and s["column_offset"] == 0 for s in shards)
    ends = [s["row_offset"] + s["rows"] for s in shards]
    assert [s["row_offset"] for s in shards] == [0, *ends[:-1]]  # contiguous, in order
    assert [r["rows"] for r in report["ranks"]] == [
        next(s["rows"] for s in shards if s["rank"] == r) for r in range(4)]
    out = capsys.readouterr().out
    assert f"rank {shards[0]['rank']}: rows [0, {shards[0]['rows']:,})" in out
    assert "Memory per device" in out and "Planner's cost estimates" in out


def test_table_wise_puts_the_table_on_one_rank(tmp_path):
    status, report = _run(["--items", "50000", "--embedding-dim", "32", "--world-size", "4",
                           "--device", "cpu", "--sharding-type", "table_wise"], tmp_path)
    assert status == 0
    (shard,) = report["shards"]
    assert (shard["rows"], shard["columns"], shard["row_offset"]) == (50000, 32, 0)
    rows = [r["rows"] for r in report["ranks"]]
    assert sorted(rows) == [0, 0, 0, 50000] and rows[shard["rank"]] == 50000
    # only the owner computes lookups; it sends every rank's rows (4 x the rows it receives)
    owner = report["ranks"][shard["rank"]]
    assert owner["perf_ms"]["fwd_compute"] > 0
    assert owner["sent_bytes"] == 4 * report["derived"]["embedding_bytes_per_rank"]


def test_billion_items_on_64_gpus_fit_under_80_gib(tmp_path, capsys):
    status, report = _run(["--items", "1e9", "--embedding-dim", "256", "--world-size", "64",
                           "--device", "cuda", "--hbm", "80", "--batch-size", "64",
                           "--ids-per-sample", "2048"], tmp_path)
    assert status == 0
    assert report["derived"]["table_bytes"] == 10**9 * 256 * 4
    assert len(report["shards"]) == 64
    assert {s["rows"] for s in report["shards"]} == {15_625_000}
    for rank in report["ranks"]:
        used = rank["hbm_bytes"] + rank["reserved_hbm_bytes"]
        assert rank["table_bytes"] == 15_625_000 * 256 * 4
        assert rank["table_bytes"] < rank["hbm_bytes"] and used < 80 * GIB
        assert rank["hbm_capacity_bytes"] == 80 * GIB
    assert report["planner_step_ms"] > 0
    out = capsys.readouterr().out
    assert "64 shards of 15,625,000 rows x 256 columns on rank(s) 0-63" in out
    assert "953.67 GiB" in out  # the table


def test_optimizer_state_reaches_the_planner(tmp_path):
    """Adam keeps two values per weight, row-wise Adagrad one per row: the planner's memory
    per device differs by about that much."""
    args = ["--items", "400000", "--embedding-dim", "128", "--world-size", "4", "--device",
            "cpu"]
    _, rowwise = _run(args + ["--optimizer", "rowwise-adagrad"], tmp_path)
    _, adam = _run(args + ["--optimizer", "adam"], tmp_path)
    table = 100_000 * 128 * 4  # one rank's rows
    extra = adam["ranks"][0]["ddr_bytes"] - rowwise["ranks"][0]["ddr_bytes"]
    assert extra == pytest.approx(2 * table - 100_000 * 4, rel=0.01)
    assert adam["derived"]["optimizer_bytes"] == 2 * 4 * 400_000 * 128


def test_link_bandwidths_reach_the_planner(tmp_path):
    args = ["--items", "1e6", "--embedding-dim", "64", "--world-size", "16",
            "--devices-per-host", "8", "--intra-host-bw", "400"]
    _, slow = _run(args + ["--inter-host-bw", "25"], tmp_path)
    _, fast = _run(args + ["--inter-host-bw", "50"], tmp_path)
    ratio = slow["ranks"][0]["perf_ms"]["fwd_comms"] / fast["ranks"][0]["perf_ms"]["fwd_comms"]
    assert ratio == pytest.approx(2.0, rel=1e-6)
    assert slow["link_ms"]["forward"] > fast["link_ms"]["forward"]


def test_a_plan_that_cannot_fit_names_the_options(capsys):
    status, _ = _run(["--items", "1e9", "--embedding-dim", "256", "--world-size", "2",
                      "--hbm", "80"])
    assert status == 2
    err = capsys.readouterr().err
    assert err.startswith("tzrec-bench plan: error: no plan fits")
    for option in ("--world-size", "--hbm", "--dtype fp16", "--items or --embedding-dim"):
        assert option in err
    assert "Traceback" not in err


@pytest.mark.parametrize("argv, option", [
    (["--items", "-5", "--embedding-dim", "8", "--world-size", "2"], "--items"),
    (["--items", "1.5", "--embedding-dim", "8", "--world-size", "2"], "--items"),
    (["--items", "10", "--embedding-dim", "8", "--world-size", "2", "--sharding-type",
      "diagonal"], "--sharding-type"),
    (["--items", "10", "--embedding-dim", "8", "--world-size", "0"], "--world-size"),
])
def test_bad_options_exit_2_naming_the_option(argv, option, capsys):
    with pytest.raises(SystemExit) as exc:
        _run(argv)
    assert exc.value.code == 2
    assert f"argument {option}" in capsys.readouterr().err


@pytest.mark.parametrize("argv, option", [
    (["--device", "cpu", "--hbm", "16"], "--hbm"),
    (["--world-size", "4", "--devices-per-host", "8"], "--devices-per-host"),
    (["--inter-host-bw", "900"], "--inter-host-bw"),
    (["--sharding-type", "data_parallel", "--compute-kernel", "fused"], "--compute-kernel"),
])
def test_bad_combinations_exit_2_naming_the_option(argv, option, capsys):
    base = ["--items", "1000", "--embedding-dim", "8", "--world-size", "4"]
    status, _ = _run(base + argv)  # a repeated option: the last one counts
    assert status == 2
    err = capsys.readouterr().err
    assert err.startswith("tzrec-bench plan: error: ") and option in err


@pytest.mark.parametrize("text, value", [("1e9", 10**9), ("2.5e6", 2_500_000),
                                         ("1_000", 1000), ("50000000", 50_000_000)])
def test_item_counts_plain_or_scientific(text, value):
    args = _parser().parse_args(["plan", "--items", text, "--embedding-dim", "8",
                                 "--world-size", "2"])
    assert args.items == value


def test_torchrec_missing_names_the_extra(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "torchrec", None)
    status, _ = _run(["--items", "10", "--embedding-dim", "8", "--world-size", "2"])
    assert status == 2
    err = capsys.readouterr().err
    assert "pip install 'tzrec-bench[torchrec]'" in err
    # the extra takes the CUDA fbgemm-gpu: without CUDA the message gives the README's lines
    readme = (pathlib.Path(__file__).parents[1] / "README.md").read_text()
    for line in plan.CPU_INSTALL:
        assert line in err and line in readme
