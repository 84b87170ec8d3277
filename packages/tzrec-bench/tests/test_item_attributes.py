"""``--item-attributes``: the JSON file read in a data set's item ids (its edge cases and
errors), and the runs that use it: train, evaluate, predict and export by raw ids."""

from __future__ import annotations

import gzip
import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tzrec_bench.cli import main
from tzrec_bench.data.item_attributes import load_item_attributes
from tzrec_bench.regression.configs import RunConfig
from tzrec_gr.checkpoint import read_payload

RAW = np.array(["sku-1", "sku-2", "sku-3", "sku-4"], dtype=object)


def _json(path, table, gz=False):
    text = json.dumps(table)
    if gz:
        path.write_bytes(gzip.compress(text.encode()))
    else:
        path.write_text(text)
    return path


def _lists(attributes):
    o, ids = attributes.offsets, attributes.attribute_ids
    return [ids[o[i]:o[i + 1]].tolist() for i in range(len(o) - 1)]


def test_attributes_are_renumbered_and_laid_out_per_item(tmp_path):
    path = _json(tmp_path / "a.json", {"sku-3": [20, 7, 7], "sku-1": ["brand:x", 7],
                                       "sku-9": [1], "sku-4": []})
    got = load_item_attributes(path, RAW)
    # integers first by value (7, 20), then strings; a repeat counts once
    assert _lists(got) == [[0, 2], [], [0, 1], []]
    assert got.num_attributes == 3 and got.num_links == 4 and got.unknown_keys == 1
    assert "3 attributes, 4 links, 2 of 4 items with at least one; 1 keys" in got.describe()


def test_integer_item_ids_match_the_files_keys_and_a_gz_is_found(tmp_path):
    _json(tmp_path / "a.json.gz", {"4": [1, 2], "83": [2]}, gz=True)
    got = load_item_attributes(tmp_path / "a.json", np.array([4, 83, 165]))
    assert _lists(got) == [[0, 1], [1], []]


@pytest.mark.parametrize("content, message", [
    ("[1, 2]", "must hold one JSON object"),
    ('{"sku-1": 3}', "item 'sku-1': expected a list of integers or strings, got 3"),
    ('{"sku-1": [true]}', "item 'sku-1': expected a list of integers or strings"),
    ('{"sku-1": [1.5]}', "item 'sku-1': expected a list of integers or strings"),
    ('{"a": [1], "b": [2]}', "no key of .* names an item of the data .*'sku-1'"),
    ('{"sku-1": [1', "is not readable JSON"),
])
def test_bad_files_are_refused_naming_the_file_and_the_item(tmp_path, content, message):
    (tmp_path / "a.json").write_text(content)
    with pytest.raises(ValueError, match=message) as exc:
        load_item_attributes(tmp_path / "a.json", RAW)
    assert str(tmp_path / "a.json") in str(exc.value)


def test_a_missing_file_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match=f"{tmp_path / 'no.json'} not found "
                       r"\(nor no.json.gz\): expected item attributes"):
        load_item_attributes(tmp_path / "no.json", RAW)


def test_a_config_names_its_attribute_file_in_the_data_folder(tmp_path):
    config = RunConfig("c", tmp_path / "c.toml", "", {"model": "sasrec",
                                                 "item_attributes": "items.json"})
    got = config.train_config(data_dir=str(tmp_path / "data"))
    assert got.item_attributes == str(tmp_path / "data" / "items.json")
    absolute = RunConfig("c", tmp_path / "c.toml", "", {"model": "sasrec",
                                                   "item_attributes": "/x/items.json"})
    assert absolute.train_config(data_dir="d").item_attributes == "/x/items.json"


def test_a_model_without_an_attribute_table_is_refused(tmp_path, capsys):
    path = _json(tmp_path / "a.json", {"1": [1]})
    with pytest.raises(SystemExit) as exc:
        main(["train", "--model", "hstu-ranking", "--item-attributes", str(path),
              "--out-dir", str(tmp_path / "run")])
    assert exc.value.code == 2
    assert "--item-attributes: hstu-ranking takes no item attributes" in capsys.readouterr().err


def _log(tmp_path):
    lines = [f"user-{u} " + " ".join(f"sku-{(u * 3 + k) % 20}" for k in range(6))
             for u in range(30)]
    log = tmp_path / "log.seq"
    log.write_text("\n".join(lines) + "\n")
    # every other item has a category, items 0-4 a brand too
    table = {f"sku-{i}": [f"cat-{i % 3}"] + ([f"brand-{i}"] if i < 5 else [])
             for i in range(0, 20, 2)}
    return log, _json(tmp_path / "items.json", table)


@pytest.mark.parametrize("model", ["hstu-retrieval", "sasrec"])
def test_a_run_with_attributes_trains_evaluates_and_serves(tmp_path, capsys, model):
    from tzrec_acc.cli import main as acc_main

    log, items = _log(tmp_path)
    run, cache = tmp_path / "run", tmp_path / "cache"
    assert main(["train", "--model", model, "--data", str(log), "--item-attributes",
                 str(items), "--max-steps", "3", "--embedding-dim", "16", "--max-seq-len",
                 "8", "--batch-size", "8", "--cache-dir", str(cache), "--out-dir", str(run),
                 "--no-progress", "--no-plot", "--backend", "pytorch"]) == 0
    assert "item attributes: 6 attributes, 13 links, 10 of 20 items" in capsys.readouterr().out
    kwargs = read_payload(run / "best.pt")["model_config"]["kwargs"]
    assert (kwargs["num_attributes"], kwargs["num_attribute_links"]) == (6, 13)
    # evaluate takes the links from the checkpoint, not from the file
    items.rename(tmp_path / "moved.json")
    assert main(["evaluate", str(run), "--cache-dir", str(cache)]) == 0
    if model == "sasrec":
        return  # a baseline: predict and tzrec-acc serve tzrec-gr's models
    users = tmp_path / "users.parquet"
    pq.write_table(pa.Table.from_pylist([{"user_id": "u", "item_ids": ["sku-2", "sku-5"],
                                          "timestamps": [1, 2]}]), users)
    top = tmp_path / "top.parquet"
    assert main(["predict", str(run), "--input", str(users), "--output", str(top), "--k", "5",
                 "--no-progress"]) == 0
    from_run = pq.read_table(top).to_pylist()[0]["item_ids"]
    assert len(from_run) == 5
    package = tmp_path / "model.pt2"
    assert acc_main(["export", "--model", str(run), "--format", "fx", "--backend", "pytorch",
                     "--output", str(package)]) == 0
    top2 = tmp_path / "top2.parquet"
    assert acc_main(["predict", str(package), "--input", str(users), "--output", str(top2),
                     "--k", "5", "--no-progress"]) == 0
    assert pq.read_table(top2).to_pylist()[0]["item_ids"] == from_run
