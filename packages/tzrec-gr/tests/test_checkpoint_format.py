"""tzrec_gr.checkpoint: the one checkpoint format, written and read back."""

from __future__ import annotations

import pytest
import torch

from tzrec_gr.checkpoint import (
    BEST,
    CHECKPOINT,
    FORMAT,
    CheckpointError,
    load_model,
    read_payload,
    resolve_checkpoint,
    write_payload,
)
from tzrec_gr.vocabulary import VOCABULARY_KEY, IdVocabularies, Vocabulary

NUM_ITEMS = 12
SPEC = {"model": "HSTURetrieval",
        "kwargs": {"num_items": NUM_ITEMS, "embedding_dim": 8, "num_layers": 1,
                   "max_seq_len": 6, "dropout_ratio": 0.0, "backend": "pytorch"}}


def _payload(items: int = NUM_ITEMS, **extra):
    from tzrec_gr.models import build_from_config

    torch.manual_seed(0)
    model = build_from_config(SPEC)
    vocab = IdVocabularies(Vocabulary(["a", "b"]), Vocabulary(list(range(100, 100 + items))),
                           "f00d", "a test log")
    return model, {"model_config": SPEC, "model": model.state_dict(),
                   VOCABULARY_KEY: vocab.state(), **extra}


def test_a_written_checkpoint_loads_the_same_model_and_ids(tmp_path):
    model, payload = _payload(step=7)
    write_payload(tmp_path / BEST, payload)
    assert not list(tmp_path.glob("*.partial"))  # written whole, then renamed
    assert read_payload(tmp_path / BEST)["format"] == FORMAT
    loaded, vocab = load_model(tmp_path)  # the run's folder: its best.pt
    assert not loaded.training
    for name, value in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], value), name
    assert list(vocab.items.raw(torch.tensor([0, 11]))) == [100, 111]
    assert vocab.source == "a test log"


def test_a_folder_resolves_to_best_then_checkpoint(tmp_path):
    assert resolve_checkpoint(tmp_path) == tmp_path / CHECKPOINT
    (tmp_path / BEST).touch()
    assert resolve_checkpoint(tmp_path) == tmp_path / BEST
    assert resolve_checkpoint(tmp_path / "x.pt") == tmp_path / "x.pt"


def test_files_that_are_no_checkpoint_are_refused_naming_the_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="no checkpoint at"):
        load_model(tmp_path / "missing.pt")
    _, payload = _payload()
    write_payload(tmp_path / "good.pt", payload)
    damaged = tmp_path / "damaged.pt"
    damaged.write_bytes((tmp_path / "good.pt").read_bytes()[:300])
    with pytest.raises(CheckpointError, match="damaged.pt: cannot be loaded"):
        load_model(damaged)
    torch.save([1, 2], tmp_path / "list.pt")
    with pytest.raises(CheckpointError, match="list.pt: holds a list"):
        load_model(tmp_path / "list.pt")
    torch.save({**payload, "format": FORMAT + 1}, tmp_path / "future.pt")
    with pytest.raises(CheckpointError, match=f"format {FORMAT + 1}, expected {FORMAT}"):
        load_model(tmp_path / "future.pt")
    write_payload(tmp_path / "nomodel.pt", {"model_config": SPEC})
    with pytest.raises(CheckpointError, match="nomodel.pt: no model in the file"):
        load_model(tmp_path / "nomodel.pt")


def test_an_inconsistent_checkpoint_is_refused(tmp_path):
    _, payload = _payload()
    state = dict(payload["model"])
    state.pop(next(iter(state)))
    write_payload(tmp_path / "short.pt", {**payload, "model": state})
    with pytest.raises(CheckpointError, match="does not fit the model"):
        load_model(tmp_path / "short.pt")
    _, payload = _payload(items=NUM_ITEMS - 1)
    write_payload(tmp_path / "vocab.pt", payload)
    with pytest.raises(CheckpointError, match="11 ids but the model 12 items"):
        load_model(tmp_path / "vocab.pt")
