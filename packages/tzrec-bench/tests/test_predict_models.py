"""``tzrec-bench predict`` asks the model registry which models it serves: any registered
model with a server (a plugin's class too, not only tzrec-gr's HSTU classes), and a clear
error for one without (SASRec, served by no server); ``--users`` only where the model's rows
are histories alone.

What is checked against what: a plugin's model (its own class, not an HSTU subclass,
wrapping an HSTURetrieval) predicts the same file as the HSTURetrieval of the same weights.
"""

from __future__ import annotations

import csv
import dataclasses
import json
from pathlib import Path

import pytest
import torch
from torch import nn

from tzrec_bench.cli import main
from tzrec_bench.train.config import TrainConfig
from tzrec_bench.train.factory import build_model, model_config
from tzrec_bench.train.ranking import TASK_BITS
from tzrec_gr.checkpoint import write_payload
from tzrec_gr.models import HSTURetrieval, registry
from tzrec_gr.models.registry import ModelRecord, get_model, register_model
from tzrec_gr.serving import RetrievalServer

TINY = dict(data="synthetic", synthetic_users=48, synthetic_items=120, max_seq_len=16,
            embedding_dim=16, num_layers=1, num_heads=2, num_negatives=16, num_candidates=4)
NUM_ITEMS = 119


def _write_best(path: Path, model_name: str, task_bits=()) -> Path:
    """A best.pt as the trainer writes it, with a fresh model's weights (no vocabulary:
    the ids are the model's rows)."""
    torch.manual_seed(0)
    config = TrainConfig(**{**TINY, "model": model_name})
    model = build_model(config, NUM_ITEMS, task_bits)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_payload(path, {"config": config.to_dict(),
                         "model_config": model_config(config, NUM_ITEMS, task_bits),
                         "step": 0, "metrics": {}, "model": model.state_dict()})
    return path


class PluginRetrieval(nn.Module):
    """A plugin's model: a class of its own (not an HSTURetrieval) that keeps the retrieval
    serving protocol by wrapping one."""

    def __init__(self, **kwargs) -> None:
        super().__init__()
        self.inner = HSTURetrieval(**kwargs)

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == "inner":
                raise
            return getattr(self.inner, name)


class PluginServer(RetrievalServer):
    """Serves a PluginRetrieval as tzrec-gr serves an HSTURetrieval."""

    model_class = PluginRetrieval


@pytest.fixture
def plugin(monkeypatch):
    """The registry with the plugin's record for this test only."""
    state = registry._STATE
    monkeypatch.setattr(registry, "_STATE", dataclasses.replace(
        state, records=dict(state.records), origins=dict(state.origins)))
    hstu = get_model("hstu-retrieval")
    register_model(ModelRecord("plugin-retrieval", PluginRetrieval, "retrieval",
                               trainer_kwargs=hstu.trainer_kwargs, server=PluginServer))


def _users(path: Path) -> Path:
    gen = torch.Generator().manual_seed(0)
    rows = []
    for u in range(5):
        length = int(torch.randint(1, 20, (1,), generator=gen))
        rows.append({"user_id": f"u{u}",
                     "item_ids": torch.randint(0, 100, (length,), generator=gen).tolist(),
                     "timestamps": list(range(length))})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _read(path: Path):
    with open(path, newline="") as f:
        return [{k: json.loads(v) if k != "user_id" else v for k, v in r.items()}
                for r in csv.DictReader(f)]


def test_a_plugin_model_with_a_server_predicts_as_the_model_it_wraps(plugin, tmp_path, capsys):
    hstu = _write_best(tmp_path / "hstu" / "best.pt", "hstu-retrieval")
    payload = torch.load(hstu, weights_only=True)
    payload["model_config"] = {**payload["model_config"], "model": "PluginRetrieval"}
    payload["model"] = {f"inner.{k}": v for k, v in payload["model"].items()}
    payload["config"] = {**payload["config"], "model": "plugin-retrieval"}
    write_payload(tmp_path / "plugin" / "best.pt", payload)
    users = _users(tmp_path / "users.jsonl")
    for run in ("hstu", "plugin"):
        assert main(["predict", str(tmp_path / run), "--input", str(users), "--output",
                     str(tmp_path / f"{run}.csv"), "--k", "5", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert (f"tzrec-bench predict: plugin-retrieval from {tmp_path / 'plugin' / 'best.pt'} "
            f"on cpu: top 5 of {NUM_ITEMS} items; seen items excluded") in out
    plugin_rows, hstu_rows = _read(tmp_path / "plugin.csv"), _read(tmp_path / "hstu.csv")
    assert [r["item_ids"] for r in plugin_rows] == [r["item_ids"] for r in hstu_rows]
    assert len(plugin_rows) == 5 and all(len(r["item_ids"]) == 5 for r in plugin_rows)


def test_a_model_without_a_server_is_refused_naming_the_served_ones(tmp_path, capsys):
    best = _write_best(tmp_path / "sasrec" / "best.pt", "sasrec")
    assert main(["predict", str(best), "--input", str(_users(tmp_path / "u.jsonl")),
                 "--output", str(tmp_path / "o.csv")]) == 2
    err = capsys.readouterr().err
    assert err == (f"tzrec-bench predict: error: {best} holds a sasrec model, which has no "
                   "registered server; predict serves hstu-retrieval, hstu-ranking\n")
    assert not (tmp_path / "o.csv").exists()


def test_users_by_id_need_a_model_whose_rows_are_histories_alone(tmp_path, capsys):
    bits = (int(TASK_BITS["like"]),)
    best = _write_best(tmp_path / "ranking" / "best.pt", "hstu-ranking", bits)
    assert main(["predict", str(best), "--users", "1,2", "--output",
                 str(tmp_path / "o.csv")]) == 2
    assert capsys.readouterr().err == (
        "tzrec-bench predict: error: --users: the model's rows need actions, candidates "
        "besides the histories the run's log holds; give them in --input FILE (columns "
        "user_id, item_ids, timestamps, actions, candidates)\n")
