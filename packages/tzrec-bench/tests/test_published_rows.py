"""The Amazon Beauty and Sports configs, and the published rows that ``run-configs`` shows
beside their runs (stand-in trainers: no training here)."""

from __future__ import annotations

import json
import pathlib
import re

import pytest

from tzrec_bench.cli import build_parser
from tzrec_bench.regression.command import run
from tzrec_bench.regression.configs import (
    RunConfigError,
    data_dir,
    load_config,
    missing_data,
    shipped_configs,
)
from tzrec_bench.regression.harness import floor_models
from tzrec_bench.regression.published import (
    load_published,
    protocol_gap,
    published_dir,
    published_for,
    published_lines,
)

REPO = pathlib.Path(__file__).resolve().parents[3]
SOURCE_MD = REPO.parent / "shared" / "data" / "amazon-s3" / "SOURCE.md"
RETRIEVAL_FLOORS = floor_models("retrieval")
SETS = {"amazon-beauty": ("Beauty.txt", "Beauty"), "amazon-sports": ("Sports_and_Outdoors.txt",
                                                                     "Sports")}
# the published rows: (name, kind) in the order of SOURCE.md's columns
ROWS = [("SASRec", "reported"), ("HSTU", "reported"), ("DuoRec", "reported"),
        ("ActionPiece", "reported"), ("TIGER", "reported"), ("SASRec+SS", "calculated"),
        ("eSASRec", "calculated"), ("HSTU", "calculated"), ("FuXi-α", "calculated")]


def _run(argv, trainer):
    parser, subparsers = build_parser()
    args = parser.parse_args(["run-configs", *argv])
    return run(args, subparsers["run-configs"], trainer)


def stand_in(hr, ndcg):
    """Every run reports ``hr`` and ``ndcg``; the floors report half of them."""
    def trainer(config):
        scale = 0.5 if config.model in RETRIEVAL_FLOORS else 1.0
        return {"hr@10": hr * scale, "ndcg@10": ndcg * scale}

    return trainer


@pytest.fixture
def data_root(tmp_path):
    """A data root holding tiny stand-ins of S3-Rec's two files."""
    for file, _ in SETS.values():
        (tmp_path / "data" / "amazon-s3").mkdir(parents=True, exist_ok=True)
        (tmp_path / "data" / "amazon-s3" / file).write_text("1 1 2 3\n2 2 3 1\n")
    return tmp_path / "data"


# -- the configs -------------------------------------------------------------------------------


#: what each config changes from its Amazon Games config (besides the data and the protocol):
#: SASRec takes HSTU's width, heads and temperature
CHANGED = {"hstu-retrieval": {},
           "sasrec": {"embedding_dim": 128, "num_heads": 2, "temperature": 0.1}}
#: what each set changes for both models: Beauty trains with less dropout (both models gained)
CHANGED_ON = {"amazon-beauty": {"dropout": 0.4}, "amazon-sports": {}}


@pytest.mark.parametrize("model, games", [("hstu-retrieval", "hstu-retrieval-amazon-games"),
                                          ("sasrec", "sasrec-amazon-games")])
@pytest.mark.parametrize("data", list(SETS))
def test_the_configs_take_the_games_settings_under_the_published_protocol(model, games, data):
    config, reference = load_config(f"{model}-{data}"), load_config(games)
    assert {**config.settings, "data": "amazon-games", "exclude_seen": False} == {
        **reference.settings, **CHANGED[model], **CHANGED_ON[data], "exclude_seen": False}
    assert config.settings["data"] == data and config.settings["exclude_seen"] is True
    assert protocol_gap(config.settings) is None
    # every item is a negative (the full softmax), as in the Games configs
    assert config.train_config().num_negatives >= {"amazon-beauty": 12101,
                                                    "amazon-sports": 18357}[data]
    # a config states where its figures came from
    text = config.description
    assert "3 seeds" in text and "H200" in text and "default backend (triton" in text
    assert "HR@10 0.0" in text and "NDCG@10 0.0" in text
    assert "early stopping" in text and "exclude" in text


def test_the_configs_are_shipped():
    assert {f"{m}-{d}" for m in ("hstu-retrieval", "sasrec") for d in SETS} <= set(
        shipped_configs())


@pytest.mark.parametrize("data", list(SETS))
def test_the_configs_read_the_shared_amazon_s3_folder(tmp_path, data):
    config = load_config(f"sasrec-{data}")
    assert data_dir(config, str(tmp_path)) == tmp_path / "amazon-s3"
    assert re.search(rf"^{data}: .*amazon-s3/{SETS[data][0]} not found",
                     missing_data(config, str(tmp_path)))


@pytest.mark.parametrize("model", ["hstu-retrieval", "sasrec"])
@pytest.mark.parametrize("data", list(SETS))
def test_the_attribute_configs_add_only_the_sets_attribute_file(tmp_path, model, data):
    config, plain = load_config(f"{model}-{data}-attributes"), load_config(f"{model}-{data}")
    file = f"{SETS[data][0][:-len('.txt')]}_item2attributes.json"
    assert dict(config.settings) == {**plain.settings, "item_attributes": file}
    assert "item attributes" in config.description
    # found in the set's folder (gzip too); a folder without it skips the run, naming it
    folder = tmp_path / "amazon-s3"
    folder.mkdir()
    (folder / SETS[data][0]).write_text("1 1 2 3\n")
    assert missing_data(config, str(tmp_path)) == (
        f"{data}: {folder / file} not found (nor {file}.gz): expected item attributes (a JSON "
        "object: item id -> list of attributes)")
    (folder / f"{file}.gz").write_bytes(b"")
    assert missing_data(config, str(tmp_path)) is None
    assert config.train_config(data_dir=str(folder)).item_attributes == str(folder / file)


# -- the published rows ------------------------------------------------------------------------


@pytest.mark.parametrize("data", list(SETS))
def test_the_shipped_rows_are_every_published_row(data):
    published = load_published(published_dir() / f"{data}.toml")
    assert [(row.name, row.kind) for row in published.rows] == ROWS
    assert all(set(row.metrics) == {"hr@10", "ndcg@10"} for row in published.rows)
    assert "2508.06450" in published.source and "earlier items excluded" in published.protocol
    assert set(published.kinds) == {"reported", "calculated"}


@pytest.mark.skipif(not SOURCE_MD.is_file(), reason=f"no {SOURCE_MD} (never committed)")
@pytest.mark.parametrize("data", list(SETS))
def test_the_shipped_rows_match_source_md(data):
    table = {}
    for line in SOURCE_MD.read_text().splitlines():
        cells = [cell.strip().strip("*") for cell in line.strip("|").split("|")]
        if cells[0] == SETS[data][1] and cells[1] in ("R@10", "N@10"):
            table["hr@10" if cells[1] == "R@10" else "ndcg@10"] = [float(c) for c in cells[2:]]
    rows = load_published(published_dir() / f"{data}.toml").rows
    for metric, values in table.items():
        assert [row.metrics[metric] for row in rows] == values


def test_a_published_run_shows_the_rows_beside_it_never_judged(data_root, tmp_path, capsys):
    out = tmp_path / "summary.json"
    code = _run(["sasrec-amazon-beauty", "--repeats", "2", "--data-root", str(data_root),
                 "--work-dir", str(tmp_path / "runs"), "--no-baseline", "--out", str(out)],
                stand_in(0.0700, 0.0600))
    # below most published rows on HR@10: no verdict, status 0
    assert code == 0
    table = capsys.readouterr().out
    lines = [line.split() for line in table.splitlines()]
    assert ["published:", "eSASRec", "hr@10", "0.0928", "(calculated)"] in lines
    assert ["published:", "FuXi-α", "ndcg@10", "0.0451", "(calculated)"] in lines
    assert ["published:", "TIGER", "hr@10", "0.0648", "(reported)"] in lines
    assert sum(line[:1] == ["published:"] for line in lines) == 2 * len(ROWS)
    assert ("  published rows, under the same protocol: leave-one-out, full ranking over the "
            "whole catalogue, the user's earlier items excluded;") in table
    assert "  published source: eSASRec:" in table and "2508.06450" in table
    gains = [line for line in table.splitlines() if "gain over best published" in line]
    assert [g.split()[4:] for g in gains] == [
        ["hr@10", "-24.6%", "(eSASRec", "(calculated),", "0.0928)"],
        ["ndcg@10", "+13.0%", "(SASRec+SS", "(calculated),", "0.0531)"]]
    assert table.splitlines()[-2] == ("0 improved, 0 unchanged, 0 regressed, 0 failed, "
                                      "0 skipped configs, 0 failed runs")
    config = json.loads(out.read_text())["configs"][0]
    published = config["published"]
    assert published["shown"] is True and published["data"] == "amazon-beauty"
    assert published["rows"][6] == {"name": "eSASRec", "kind": "calculated",
                                    "metrics": {"hr@10": 0.0928, "ndcg@10": 0.0523}}
    assert config["published_gains"]["ndcg@10"] == {
        "row": "SASRec+SS (calculated)", "value": 0.0531,
        "relative_gain": pytest.approx(0.06 / 0.0531 - 1)}
    assert all(m["status"] is None for m in config["metrics"].values())


def test_a_verdict_comes_from_the_baseline_alone(data_root, tmp_path, capsys):
    (tmp_path / "baseline.toml").write_text(
        '[sasrec-amazon-sports."hr@10"]\nvalue = 0.03\ntolerance = 0.001\n')
    code = _run(["sasrec-amazon-sports", "--repeats", "1", "--data-root", str(data_root),
                 "--work-dir", str(tmp_path / "runs"), "--baseline",
                 str(tmp_path / "baseline.toml")], stand_in(0.0400, 0.0200))
    table = capsys.readouterr().out
    assert code == 0  # improved on its baseline, though below every published SASRec+SS row
    assert "1 improved, 0 unchanged, 0 regressed, 0 failed" in table
    assert "  published: SASRec+SS       hr@10                      0.0569  (calculated)" in table


@pytest.mark.parametrize("settings, reason", [
    ("", "exclude_seen is false (the published rows exclude the user's earlier items"),
    ("exclude_seen = true\nmin_events = 5", "min_events = 5 filters the data"),
    ("exclude_seen = true\ntest_users = 100", "test_users = 100 evaluates a sample"),
])
def test_runs_off_the_protocol_show_no_rows_and_say_why(data_root, tmp_path, capsys,
                                                        settings, reason):
    (tmp_path / "mine.toml").write_text(
        f'[train]\nmodel = "sasrec"\ndata = "amazon-beauty"\n{settings}\n')
    out = tmp_path / "summary.json"
    assert _run([str(tmp_path / "mine.toml"), "--repeats", "1", "--data-root", str(data_root),
                 "--work-dir", str(tmp_path / "runs"), "--no-baseline", "--out", str(out)],
                stand_in(0.09, 0.05)) == 0
    table = capsys.readouterr().out
    assert f"  published rows of amazon-beauty not shown: {reason}" in table
    assert "published:" not in table and "gain over best published" not in table
    config = json.loads(out.read_text())["configs"][0]
    assert config["published"]["shown"] is False and config["published"]["rows"] == []
    assert reason in config["published"]["reason"] and config["published_gains"] == {}


def test_a_config_with_item_attributes_shows_the_rows_with_a_caveat():
    settings = {"data": "amazon-beauty", "exclude_seen": True,
                "item_attributes": "Beauty_item2attributes.json"}
    published = published_for(settings)
    assert published.shown and published.rows
    caveat = ("this config reads item attributes (Beauty_item2attributes.json), which none "
              "of the published rows uses")
    assert published.caveat == caveat
    assert f"  published rows, caveat: {caveat}" in published_lines(published, {})
    plain = published_for({"data": "amazon-beauty", "exclude_seen": True})
    assert plain.caveat is None
    assert not any("caveat" in line for line in published_lines(plain, {}))


def test_other_data_sets_have_no_published_rows(tmp_path, capsys):
    out = tmp_path / "summary.json"
    _run(["sasrec-synthetic", "--repeats", "1", "--work-dir", str(tmp_path / "runs"),
          "--no-baseline", "--out", str(out)], stand_in(0.5, 0.4))
    assert "published" not in capsys.readouterr().out.replace("summary", "")
    assert json.loads(out.read_text())["configs"][0]["published"] is None
    assert published_for({"data": "ml-100k", "exclude_seen": True}) is None


@pytest.mark.parametrize("text, message", [
    ('source = "s"\nprotocol = "p"\n[kinds]\nreported = "r"\n[[rows]]\nname = "A"\n'
     'kind = "other"\n"hr@10" = 0.1\n', "row 1: kind 'other' is not one of [kinds] (reported)"),
    ('source = "s"\nprotocol = "p"\n[kinds]\nreported = "r"\n[[rows]]\nname = "A"\n'
     'kind = "reported"\n', "row 1: no metrics"),
    ('source = "s"\nprotocol = "p"\n[kinds]\nreported = "r"\n[[rows]]\nname = "A"\n'
     'kind = "reported"\n"hr@10" = "high"\n', "row 1: hr@10 must be a finite number"),
    ('protocol = "p"\n[kinds]\nreported = "r"\n[[rows]]\nname = "A"\nkind = "reported"\n'
     '"hr@10" = 0.1\n', "source must be a non-empty string"),
    ('source = "s"\nprotocol = "p"\n[kinds]\nreported = "r"\n', "expected [[rows]] tables"),
    ('source = "s"\nprotocol = "p"\nfigures = 1\n', "unknown keys figures"),
])
def test_a_bad_published_file_is_refused_naming_the_entry(tmp_path, text, message):
    path = tmp_path / "amazon-beauty.toml"
    path.write_text(text)
    with pytest.raises(RunConfigError, match=re.escape(f"{path}: {message}")):
        load_published(path)
