"""``tzrec-bench run-configs``: planted improvements, regressions and failures sorted right
by a stand-in trainer, exit codes, baseline and config errors, skipped MovieLens configs, and
one real run of a shipped synthetic config against its shipped baseline."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tzrec_bench.cli import build_parser, main
from tzrec_bench.regression.baseline import Threshold, load_baseline
from tzrec_bench.regression.command import run
from tzrec_bench.regression.configs import (
    SHIPPED_BASELINES,
    load_config,
    shipped_configs,
    shipped_dir,
)

CONFIG = """description = "{name}: a stand-in"
[train]
model = "hstu-retrieval"
data = "synthetic"
seed = 10
"""

# config name -> ndcg@10 by seed (seeds 10, 11, 12); baseline ndcg@10 = 0.40 +- 0.02 (higher)
PLANTED = {
    "better": lambda seed: 0.50 + 0.01 * (seed - 10),  # mean 0.51: improved
    "same": lambda seed: 0.41,  # within the tolerance: unchanged
    "worse": lambda seed: 0.30,  # regressed
    "broken": lambda seed: 1 / 0 if seed == 11 else 0.40,  # one run raises: failed
    "nan": lambda seed: math.nan,  # failed
}
BASELINE = """
[better."ndcg@10"]
value = 0.40
tolerance = 0.02
[same."ndcg@10"]
value = 0.40
tolerance = 0.02
[worse."ndcg@10"]
value = 0.40
tolerance = 0.02
[broken."ndcg@10"]
value = 0.40
tolerance = 0.02
[nan."ndcg@10"]
value = 0.40
tolerance = 0.02
[same.loss]
value = 1.0
tolerance = 0.1
direction = "lower"
[same.missing]
value = 1.0
"""


@pytest.fixture
def planted(tmp_path):
    for name in PLANTED:
        (tmp_path / f"{name}.toml").write_text(CONFIG.format(name=name))
    (tmp_path / "baseline.toml").write_text(BASELINE)
    return tmp_path


def stand_in(calls):
    def trainer(config):
        name = Path(config.out_dir).parent.name
        calls.append((name, config.seed))
        return {"ndcg@10": PLANTED[name](config.seed), "loss": 0.7}

    return trainer


def _run(argv, trainer):
    parser, subparsers = build_parser()
    args = parser.parse_args(["run-configs", *argv])
    return run(args, subparsers["run-configs"], trainer)


def _argv(folder, names, *extra):
    return [*(str(folder / f"{n}.toml") for n in names), "--baseline",
            str(folder / "baseline.toml"), "--work-dir", str(folder / "runs"), *extra]


def test_planted_verdicts_and_exit_codes(planted, capsys):
    calls = []
    out = planted / "summary.json"
    code = _run(_argv(planted, PLANTED, "--out", str(out)), stand_in(calls))
    assert code == 1
    assert sorted(calls) == sorted((n, s) for n in PLANTED for s in (10, 11, 12))
    summary = json.loads(out.read_text())
    verdicts = {(c["name"], m): r["status"] for c in summary["configs"]
                for m, r in c["metrics"].items()}
    assert verdicts == {
        ("better", "ndcg@10"): "improved", ("better", "loss"): None,
        ("same", "ndcg@10"): "unchanged",
        ("same", "loss"): "improved",  # 0.7 against 1.0 +- 0.1, lower is better
        ("same", "missing"): "failed",  # in the baseline, never reported
        ("worse", "ndcg@10"): "regressed", ("worse", "loss"): None,
        ("broken", "ndcg@10"): "failed", ("broken", "loss"): "failed",
        ("nan", "ndcg@10"): "failed", ("nan", "loss"): None,
    }
    better = next(c for c in summary["configs"] if c["name"] == "better")
    assert better["seeds"] == [10, 11, 12]
    assert better["metrics"]["ndcg@10"]["mean"] == pytest.approx(0.51)
    assert better["metrics"]["ndcg@10"]["std"] == pytest.approx(0.01)
    broken = next(c for c in summary["configs"] if c["name"] == "broken")
    assert broken["errors"] == ["seed 11: ZeroDivisionError: division by zero"]
    assert summary["counts"] == {"improved": 2, "unchanged": 1, "regressed": 1, "failed": 4,
                                 "skipped configs": 0}
    table = capsys.readouterr().out
    assert "run failed: seed 11: ZeroDivisionError" in table
    assert "2 improved, 1 unchanged, 1 regressed, 4 failed, 0 skipped configs" in table


@pytest.mark.parametrize("names, code", [
    (["better"], 0), (["same", "better"], 1),  # same.missing fails
    (["worse"], 1), (["broken"], 1), (["nan"], 1),
])
def test_exit_status_is_1_on_a_regression_or_failure(planted, names, code):
    assert _run(_argv(planted, names, "--repeats", "2"), stand_in([])) == code


def test_no_baseline_reports_means_only(planted, capsys):
    assert _run([str(planted / "worse.toml"), "--no-baseline", "--repeats", "1",
                 "--work-dir", str(planted / "runs")], stand_in([])) == 0
    assert "0.3000 ± 0.0000" in capsys.readouterr().out


@pytest.mark.parametrize("baseline, message", [
    ('[a."ndcg@10"]\ntolerance = 0.1\n', "a.ndcg@10: value must be a finite number, got None"),
    ('[a."ndcg@10"]\nvalue = 1\ntolerance = -1\n', "a.ndcg@10: tolerance must be >= 0"),
    ('[a."ndcg@10"]\nvalue = 1\ndirection = "up"\n', "direction must be higher or lower"),
    ('[a."ndcg@10"]\nvalue = 1\ntol = 1\n', "a.ndcg@10: unknown keys tol"),
    ('a = 1\n', "a: expected a table of metrics"),
    ('[a\n', "not valid TOML"),
])
def test_bad_baseline_exits_2_naming_the_entry(planted, baseline, message, capsys):
    (planted / "baseline.toml").write_text(baseline)
    calls = []
    assert _run(_argv(planted, ["same"]), stand_in(calls)) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and not calls


def test_json_baseline(planted):
    (planted / "b.json").write_text(json.dumps(
        {"same": {"ndcg@10": {"value": 0.5, "tolerance": 0.01}}}))
    assert load_baseline(planted / "b.json") == {"same": {"ndcg@10": Threshold(0.5, 0.01)}}
    assert _run([str(planted / "same.toml"), "--baseline", str(planted / "b.json"),
                 "--work-dir", str(planted / "runs")], stand_in([])) == 1  # 0.41 < 0.49


@pytest.mark.parametrize("argv, message", [
    (["no-such-config"], "config 'no-such-config': no such file, and not a shipped config"),
    ([], "CONFIG: name at least one config"),
    (["hstu-retrieval-synthetic", "--repeats", "0"], "--repeats: must be >= 1, got 0"),
])
def test_bad_arguments_exit_2(argv, message, capsys):
    assert main(["run-configs", *argv]) == 2
    assert message in capsys.readouterr().err


def test_bad_train_setting_names_the_file_and_option(tmp_path, capsys):
    (tmp_path / "c.toml").write_text('[train]\nbatch_size = 0\n')
    assert main(["run-configs", str(tmp_path / "c.toml")]) == 2
    assert f"{tmp_path / 'c.toml'}: [train] --batch-size: must be at least 1" in (
        capsys.readouterr().err)


def test_shipped_configs_load_and_have_baselines():
    shipped = shipped_configs()
    models = {"hstu-retrieval", "hstu-ranking", "sasrec"}
    assert set(shipped) == {f"{m}-{d}" for m in models for d in ("synthetic", "ml-100k")}
    for name, path in shipped.items():
        config = load_config(name)
        assert config.path == path and config.description
        assert config.train_config().model in models
    baseline = load_baseline(shipped_dir() / SHIPPED_BASELINES)
    assert set(baseline) == {f"{m}-synthetic" for m in models}


def test_movielens_config_skips_when_its_data_is_absent(tmp_path, capsys):
    calls = []
    code = _run(["hstu-retrieval-ml-100k", "--data-root", str(tmp_path), "--work-dir",
                 str(tmp_path / "runs")], stand_in(calls))
    assert code == 0 and not calls
    out = capsys.readouterr().out
    assert "hstu-retrieval-ml-100k" in out and "skipped: ml-100k:" in out
    assert "u.data" in out and "1 skipped configs" in out


def test_list_names_the_shipped_configs(capsys):
    assert main(["run-configs", "--list"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in shipped_configs())


def test_a_shipped_synthetic_config_runs_for_real_within_its_baseline(tmp_path, capsys):
    out = tmp_path / "summary.json"
    code = main(["run-configs", "sasrec-synthetic", "--repeats", "1", "--work-dir",
                 str(tmp_path / "runs"), "--out", str(out)])
    assert code == 0, capsys.readouterr().out
    metrics = json.loads(out.read_text())["configs"][0]["metrics"]
    assert {m: metrics[m]["status"] for m in ("ndcg@10", "hr@10", "mrr")} == {
        "ndcg@10": "unchanged", "hr@10": "unchanged", "mrr": "unchanged"}
    assert 0 < metrics["ndcg@10"]["mean"] <= metrics["hr@10"]["mean"] <= 1
