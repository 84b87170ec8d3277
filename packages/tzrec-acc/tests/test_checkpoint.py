"""Rebuilding models from tzrec-bench checkpoints and from state dict + config files."""

from __future__ import annotations

import json

import pytest
import torch
from _models import RANKING, RETRIEVAL, ranking, retrieval

from tzrec_acc import gr
from tzrec_acc.checkpoint import load_model
from tzrec_gr.models import HSTURanking, HSTURetrieval

RANKING_KWARGS = dict(
    num_items=30, item_embedding_dim=16, embedding_dim=16, task_bitmasks=[1, 64],
    action_weights=[1, 2, 4, 8, 16, 32, 64, 128], max_uih_len=10, max_targets=4, num_heads=2,
    num_layers=2, dropout_ratio=0.0, backend="pytorch",
)
RETRIEVAL_KWARGS = dict(
    num_items=30, embedding_dim=16, max_seq_len=10, num_heads=2, num_layers=2,
    num_negatives=8, temperature=0.05, dropout_ratio=0.0, backend="pytorch",
)


def bench_checkpoint(path, name: str = "hstu-ranking"):
    """A file as tzrec-bench's trainer writes it (its real writer is tested in tzrec-bench)."""
    torch.manual_seed(3)
    if name == "hstu-ranking":
        cls, kwargs = HSTURanking, RANKING_KWARGS
    else:
        cls, kwargs = HSTURetrieval, RETRIEVAL_KWARGS
    model = cls(**kwargs)
    payload = {
        "format": 1,
        "config": {"model": name, "lr": 1e-3},  # the run's settings; the rebuild ignores them
        "model_config": {"model": cls.__name__, "kwargs": kwargs},
        "step": 7,
        "model": model.state_dict(),
    }
    torch.save(payload, path)
    return model.eval()


@pytest.mark.parametrize("name", ["hstu-ranking", "hstu-retrieval"])
def test_bench_checkpoint_rebuilds_the_trained_model(tmp_path, name):
    trained = bench_checkpoint(tmp_path / "best.pt", name)
    loaded = load_model(tmp_path / "best.pt")
    assert type(loaded) is type(trained) and not loaded.training
    args = gr.sample_inputs(loaded, batch=3, seed=1)
    with torch.no_grad():
        torch.testing.assert_close(loaded(*args), trained(*args), rtol=0, atol=0)


@pytest.mark.parametrize("suffix", [".json", ".toml"])
def test_state_dict_with_config(tmp_path, suffix):
    model = ranking()
    torch.save(model.state_dict(), tmp_path / "weights.pt")
    config = tmp_path / f"model{suffix}"
    if suffix == ".json":
        config.write_text(json.dumps({"model": "HSTURanking", "kwargs": RANKING}))
    else:
        rows = "\n".join(f"{k} = {json.dumps(v)}" for k, v in RANKING.items())
        config.write_text(f'model = "HSTURanking"\n[kwargs]\n{rows}\n')
    loaded = load_model(tmp_path / "weights.pt", config)
    args = gr.sample_inputs(model, batch=2)
    with torch.no_grad():
        torch.testing.assert_close(loaded(*args), model(*args), rtol=0, atol=0)


def test_errors_name_the_problem(tmp_path):
    with pytest.raises(FileNotFoundError, match="no checkpoint at"):
        load_model(tmp_path / "nothing.pt")
    torch.save(retrieval().state_dict(), tmp_path / "weights.pt")
    with pytest.raises(ValueError, match=r"weights.pt: no format, model_config, model .*--config"):
        load_model(tmp_path / "weights.pt")
    with pytest.raises(FileNotFoundError, match="no model config at"):
        load_model(tmp_path / "weights.pt", tmp_path / "missing.json")
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: x")
    with pytest.raises(ValueError, match="must be a .json or .toml file"):
        load_model(tmp_path / "weights.pt", bad)
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"kwargs": {}}))
    with pytest.raises(ValueError, match=r"must hold 'model' .* got keys \['kwargs'\]"):
        load_model(tmp_path / "weights.pt", keys)
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"model": "SASRec", "kwargs": {}}))
    with pytest.raises(
        ValueError, match="model must be one of HSTURanking, HSTURetrieval, got 'SASRec'"
    ):
        load_model(tmp_path / "weights.pt", other)
    wrong = tmp_path / "wrong.json"
    wrong.write_text(json.dumps({"model": "HSTURetrieval", "kwargs": {**RETRIEVAL, "size": 1}}))
    with pytest.raises(ValueError, match="the config's kwargs do not fit HSTURetrieval"):
        load_model(tmp_path / "weights.pt", wrong)
    small = tmp_path / "small.json"
    small.write_text(
        json.dumps({"model": "HSTURetrieval", "kwargs": {**RETRIEVAL, "num_items": 9}})
    )
    with pytest.raises(ValueError, match="does not fit the model"):
        load_model(tmp_path / "weights.pt", small)


def test_unsupported_and_old_checkpoints(tmp_path):
    bench_checkpoint(tmp_path / "ok.pt")
    payload = torch.load(tmp_path / "ok.pt", weights_only=True)
    sasrec = {"model": "SASRec", "kwargs": {}}
    torch.save({**payload, "model_config": sasrec}, tmp_path / "s.pt")
    with pytest.raises(
        ValueError, match="model must be one of HSTURanking, HSTURetrieval, got 'SASRec'"
    ):
        load_model(tmp_path / "s.pt")
    torch.save({**payload, "format": 0}, tmp_path / "old.pt")
    with pytest.raises(ValueError, match="checkpoint format 0, expected 1"):
        load_model(tmp_path / "old.pt")
    older = {k: v for k, v in payload.items() if k != "model_config"}
    torch.save(older, tmp_path / "older.pt")
    with pytest.raises(ValueError, match=r"no model_config in the file; .*--config\)"):
        load_model(tmp_path / "older.pt")
    state = {k: v for k, v in payload["model"].items() if k != "_task_bits"}
    torch.save({**payload, "model": state}, tmp_path / "cut.pt")
    with pytest.raises(ValueError, match="(?s)does not fit the model.*_task_bits"):
        load_model(tmp_path / "cut.pt")


def test_backend_override(tmp_path):
    bench_checkpoint(tmp_path / "best.pt")
    with pytest.raises(
        ValueError, match="cannot build HSTURanking: unknown backend .no_such_backend."
    ):
        load_model(tmp_path / "best.pt", backend="no_such_backend")


def test_a_run_folder_and_its_vocabularies(tmp_path, capsys):
    """A tzrec-bench run's folder reads its best.pt, else its checkpoint.pt (tzrec-gr's
    rule); the vocabularies come with the model, None for an older file."""
    from tzrec_acc.checkpoint import load_checkpoint
    from tzrec_acc.cli import main
    from tzrec_gr.vocabulary import VOCABULARY_KEY, IdVocabularies, Vocabulary

    run = tmp_path / "run"
    run.mkdir()
    bench_checkpoint(run / "checkpoint.pt")
    assert load_checkpoint(run)[1] is None
    payload = torch.load(run / "checkpoint.pt", weights_only=True)
    vocab = IdVocabularies(Vocabulary(["u"]), Vocabulary([f"i{n}" for n in range(30)]))
    torch.save({**payload, VOCABULARY_KEY: vocab.state()}, run / "best.pt")
    model, loaded = load_checkpoint(run)  # best.pt first
    assert isinstance(model, HSTURanking) and loaded.items == vocab.items
    short = IdVocabularies(Vocabulary(["u"]), Vocabulary(["a", "b"]))
    torch.save({**payload, VOCABULARY_KEY: short.state()}, run / "best.pt")
    with pytest.raises(ValueError, match="item vocabulary has 2 ids but the model 30 items"):
        load_model(run)
    with pytest.raises(FileNotFoundError, match="no checkpoint at"):
        load_model(tmp_path / "empty")
    assert main(["run", str(run)]) == 2
    assert "is a folder: run without --input replays" in capsys.readouterr().err


class TunedRetrieval(HSTURetrieval):
    """A plugin's model: a class of its own name (checkpoints name a model by its class)."""


@pytest.fixture
def plugin_record(monkeypatch):
    """The model registry with a plugin's record for this test only."""
    import dataclasses

    from tzrec_gr.models import registry
    from tzrec_gr.serving import RetrievalServer

    state = registry._STATE
    monkeypatch.setattr(registry, "_STATE", dataclasses.replace(
        state, records=dict(state.records), origins=dict(state.origins)))
    registry.register_model(registry.ModelRecord("tuned-retrieval", TunedRetrieval, "retrieval",
                                                  server=RetrievalServer))


def test_a_registered_plugin_models_config_and_checkpoint_load(tmp_path, plugin_record):
    torch.manual_seed(0)
    model = TunedRetrieval(**RETRIEVAL_KWARGS).eval()
    torch.save(model.state_dict(), tmp_path / "weights.pt")
    config = tmp_path / "model.json"
    config.write_text(json.dumps({"model": "TunedRetrieval", "kwargs": RETRIEVAL_KWARGS}))
    loaded = load_model(tmp_path / "weights.pt", config)
    assert type(loaded) is TunedRetrieval
    torch.save({"format": 1, "model_config": {"model": "TunedRetrieval",
                                              "kwargs": RETRIEVAL_KWARGS},
                "model": model.state_dict()}, tmp_path / "best.pt")
    assert type(load_model(tmp_path / "best.pt")) is TunedRetrieval
    args = gr.sample_inputs(loaded, batch=2, seed=1)
    with torch.no_grad():
        torch.testing.assert_close(loaded(*args), model(*args), rtol=0, atol=0)
    # a class the registry does not hold is refused naming those it does
    config.write_text(json.dumps({"model": "Other", "kwargs": {}}))
    with pytest.raises(ValueError, match="model must be one of HSTURanking, HSTURetrieval, "
                                         "TunedRetrieval, got 'Other'"):
        load_model(tmp_path / "weights.pt", config)
