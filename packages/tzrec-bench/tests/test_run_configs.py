"""``tzrec-bench run-configs``: planted improvements, regressions and failures sorted right
by a stand-in trainer, the floors (simple baselines) beside each config and the gain over the
best of them, exit codes, baseline and config errors, skipped MovieLens configs, and one real
run of a shipped synthetic config (and its floors) against its shipped baseline."""

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
    RunConfig,
    load_config,
    shipped_configs,
    shipped_dir,
)
from tzrec_bench.regression.harness import floor_configs, floor_models

#: the simple baselines run beside a retrieval config (the fitted retrieval models)
RETRIEVAL_FLOORS = floor_models("retrieval")

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
# floor model -> its ndcg@10 and hr@10 in every run: item-knn, 0.25, is the best floor
PLANTED_FLOORS = {"most-popular": 0.10, "item-transitions": 0.20, "item-knn": 0.25}
# the gain over the best floor's ndcg@10 (0.25) of each config's mean ndcg@10
PLANTED_GAINS = {"better": "+104.0%", "same": "+64.0%", "worse": "+20.0%",
                 "broken": "+60.0%", "nan": "n/a"}
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
    """Records (run folder, seed): a config's folder is its name, a floor's floor:<model>."""
    def trainer(config):
        name = Path(config.out_dir).parent.name
        calls.append((name, config.seed))
        if config.model in RETRIEVAL_FLOORS:
            value = PLANTED_FLOORS[config.model]
            return {"ndcg@10": value, "hr@10": value}
        return {"ndcg@10": PLANTED[name](config.seed), "loss": 0.7}

    return trainer


def _floor_calls(calls):
    return sorted(c for c in calls if c[0].startswith("floor:"))


def _gain_lines(table):
    """{config: its "gain over best floor" line's cells after the label}."""
    gains, config = {}, None
    for line in table.splitlines():
        if line and not line.startswith(" "):
            config = line.split()[0]
        elif line.startswith("  gain over best floor"):
            gains[config] = line.split()[4:]
    return gains


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
    configs = [c for c in calls if not c[0].startswith("floor:")]
    assert sorted(configs) == sorted((n, s) for n in PLANTED for s in (10, 11, 12))
    # the five configs share their data settings: the floors ran once, on the same seeds
    assert _floor_calls(calls) == sorted(
        (f"floor:{m}", s) for m in RETRIEVAL_FLOORS for s in (10, 11, 12))
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
                                 "skipped configs": 0, "failed runs": 1}
    table = capsys.readouterr().out
    assert "run failed: seed 11: ZeroDivisionError" in table
    # the floors are reported, not judged: the verdicts are the configs' alone
    assert "2 improved, 1 unchanged, 1 regressed, 4 failed, 0 skipped configs, 1 failed runs" in (
        table)
    assert {name: cells[1] for name, cells in _gain_lines(table).items()} == PLANTED_GAINS
    assert _gain_lines(table)["better"] == ["ndcg@10", "+104.0%", "(floor:item-knn,", "0.2500)"]
    floor_lines = [line.split() for line in table.splitlines() if line.startswith("  floor:")]
    for model, value in PLANTED_FLOORS.items():  # ndcg@10 only: the configs report no hr@10
        assert floor_lines.count([f"floor:{model}", "ndcg@10", f"{value:.4f}", "±",
                                  "0.0000"]) == len(PLANTED)
    assert not any("hr@10" in cells for cells in floor_lines)
    assert better["floor_gains"] == {"ndcg@10": {
        "floor": "floor:item-knn", "floor_mean": 0.25, "relative_gain": pytest.approx(1.04)}}
    assert [f["name"] for f in better["floors"]] == [f"floor:{m}" for m in RETRIEVAL_FLOORS]
    assert better["floors"][2]["metrics"]["hr@10"]["mean"] == 0.25
    assert better["floors"][2]["seeds"] == [10, 11, 12]
    nan = next(c for c in summary["configs"] if c["name"] == "nan")
    assert nan["floor_gains"]["ndcg@10"]["relative_gain"] is None


@pytest.mark.parametrize("names, code", [
    (["better"], 0), (["same", "better"], 1),  # same.missing fails
    (["worse"], 1), (["broken"], 1), (["nan"], 1),
])
def test_exit_status_is_1_on_a_regression_or_failure(planted, names, code):
    assert _run(_argv(planted, names, "--repeats", "2"), stand_in([])) == code


def test_floor_runs_are_shared_by_the_configs_on_the_same_data(planted):
    """better and worse have the same data settings (their model settings may differ) and
    share one set of floor runs; same, on another synthetic data set, gets its own."""
    (planted / "worse.toml").write_text(CONFIG.format(name="worse") + "lr = 0.01\n")
    (planted / "same.toml").write_text(CONFIG.format(name="same") + "synthetic_users = 500\n")
    calls, folders, out = [], set(), planted / "summary.json"
    trainer = stand_in(calls)

    def recording(config):
        folders.add(Path(config.out_dir).parents[1])
        return trainer(config)

    _run(_argv(planted, ["better", "worse", "same"], "--repeats", "2", "--out", str(out)),
         recording)
    assert len(calls) == 3 * 2 + 2 * 3 * 2  # the configs' runs, then 2 sets of floor runs
    assert _floor_calls(calls) == sorted(
        (f"floor:{m}", s) for m in RETRIEVAL_FLOORS for s in (10, 11) for _ in range(2))
    floors = {c["name"]: c["floors"] for c in json.loads(out.read_text())["configs"]}
    assert floors["better"] == floors["worse"] and len(floors["better"]) == 3
    assert [f["name"] for f in floors["same"]] == [f["name"] for f in floors["better"]]
    floor_folders = sorted(p for p in folders if p.parent == planted / "runs" / "floors")
    assert [p.name for p in floor_folders] == sorted(
        f"{i}-{m}" for i, m in enumerate(RETRIEVAL_FLOORS * 2))


def test_no_floors_runs_none(planted, capsys):
    calls, out = [], planted / "summary.json"
    assert _run(_argv(planted, ["better"], "--no-floors", "--out", str(out)),
                stand_in(calls)) == 0
    assert sorted(calls) == [("better", s) for s in (10, 11, 12)]
    table = capsys.readouterr().out
    assert "floor:" not in table and "gain over best floor" not in table
    (config,) = json.loads(out.read_text())["configs"]
    assert config["floors"] == [] and config["floor_gains"] == {}


def test_a_config_of_a_simple_baseline_runs_no_floors(planted, capsys):
    (planted / "knn.toml").write_text(
        CONFIG.format(name="knn").replace('"hstu-retrieval"', '"item-knn"'))
    calls, out = [], planted / "summary.json"
    assert _run([str(planted / "knn.toml"), "--no-baseline", "--work-dir",
                 str(planted / "runs"), "--out", str(out)], stand_in(calls)) == 0
    assert sorted(calls) == [("knn", s) for s in (10, 11, 12)]
    assert "gain over best floor" not in capsys.readouterr().out
    (config,) = json.loads(out.read_text())["configs"]
    assert config["floors"] == [] and config["floor_gains"] == {}


def test_the_floors_are_the_fitted_models_of_each_task_in_the_registry():
    assert RETRIEVAL_FLOORS == ["most-popular", "item-transitions", "item-knn"]
    assert floor_models("ranking") == ["popularity-ranking"]


def test_floors_share_the_data_split_and_seed_not_the_model_settings():
    settings = {"model": "hstu-ranking", "data": "synthetic", "synthetic_users": 300,
                "max_seq_len": 24, "num_candidates": 8, "seed": 3, "device": "cpu",
                "embedding_dim": 32, "lr": 3e-3, "max_steps": 60, "dropout": 0.0}
    (floor,) = floor_configs(RunConfig("rank", Path("rank.toml"), "d", settings))
    assert floor.name == "floor:popularity-ranking" and floor.path == Path("rank.toml")
    kept = {k: v for k, v in settings.items()
            if k not in ("model", "embedding_dim", "lr", "max_steps", "dropout")}
    assert {k: floor.settings[k] for k in kept} == kept
    assert floor.settings["model"] == "popularity-ranking"
    assert not {"embedding_dim", "lr", "max_steps", "dropout"} & set(floor.settings)
    retrieval = floor_configs(RunConfig("r", Path("r.toml"), "d", {"model": "sasrec"}))
    assert [f.settings["model"] for f in retrieval] == list(RETRIEVAL_FLOORS)
    assert floor_configs(RunConfig("p", Path("p.toml"), "d",
                                   {"model": "popularity-ranking"})) == []


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
    assert set(shipped) == {f"{m}-{d}" for m in models for d in ("synthetic", "ml-100k")} | {
        f"{m}-amazon-{d}" for m in ("hstu-retrieval", "sasrec") for d in ("games", "beauty",
                                                                           "sports")} | {
        f"{m}-amazon-{d}-attributes" for m in ("hstu-retrieval", "sasrec")
        for d in ("beauty", "sports")}
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
    table = capsys.readouterr().out
    assert code == 0, table
    (config,) = json.loads(out.read_text())["configs"]
    metrics = config["metrics"]
    assert {m: metrics[m]["status"] for m in ("ndcg@10", "hr@10", "mrr")} == {
        "ndcg@10": "unchanged", "hr@10": "unchanged", "mrr": "unchanged"}
    assert 0 < metrics["ndcg@10"]["mean"] <= metrics["hr@10"]["mean"] <= 1
    # its floors ran for real, fitted from counts on the same data, split and seed
    floors = {f["name"]: f for f in config["floors"]}
    assert list(floors) == [f"floor:{m}" for m in RETRIEVAL_FLOORS]
    for name, floor in floors.items():
        assert not floor["errors"] and floor["seeds"] == config["seeds"], name
        ndcg = floor["metrics"]["ndcg@10"]["mean"]
        assert math.isfinite(ndcg) and 0 < ndcg <= floor["metrics"]["hr@10"]["mean"] <= 1, name
    assert set(config["floor_gains"]) == {"hr@10", "ndcg@10"}
    best = max(floors, key=lambda name: floors[name]["metrics"]["ndcg@10"]["mean"])
    gain = config["floor_gains"]["ndcg@10"]
    assert gain["floor"] == best
    assert gain["relative_gain"] == pytest.approx(
        metrics["ndcg@10"]["mean"] / floors[best]["metrics"]["ndcg@10"]["mean"] - 1)
    assert table.count("  gain over best floor") == 2


def test_eval_negatives_reaches_every_retrieval_run_and_its_floors(planted):
    seen = []

    def trainer(config):
        seen.append((Path(config.out_dir).parent.name, config.eval_negatives))
        return stand_in([])(config)

    _run(_argv(planted, ["better"], "--repeats", "1", "--eval-negatives", "100"), trainer)
    assert seen and all(negatives == 100 for _, negatives in seen)
    assert {name for name, _ in seen} >= {"better", *(f"floor:{m}" for m in RETRIEVAL_FLOORS)}
