"""tzrec_bench.train.checkpoint.load: files that are not a complete checkpoint of the trainer."""

from __future__ import annotations

import re

import pytest
import torch

from tzrec_bench.train import checkpoint
from tzrec_bench.train.checkpoint import CheckpointError
from tzrec_gr.checkpoint import write_payload

EXPECTED = "expected a checkpoint.pt or best.pt written by `tzrec-bench train`"


def _payload(resume: bool = True) -> dict:
    payload = {"config": {"model": "sasrec"}, "step": 3, "model": {"w": torch.ones(64, 64)}}
    if resume:
        payload.update(optimizer={}, scheduler={}, early_stopping={}, history={}, rng=[])
    return payload


def test_a_complete_checkpoint_loads(tmp_path):
    write_payload(tmp_path / checkpoint.CHECKPOINT, _payload())
    state = checkpoint.load(tmp_path / checkpoint.CHECKPOINT)
    assert state["step"] == 3 and torch.equal(state["model"]["w"], torch.ones(64, 64))


@pytest.mark.parametrize("keep", [0, 1, 100, 0.5, -1])  # bytes or a fraction of the file kept
def test_truncated_file_names_the_path(tmp_path, keep):
    path = tmp_path / checkpoint.BEST
    write_payload(path, _payload(resume=False))
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep) if isinstance(keep, float) else keep % len(data)])
    with pytest.raises(CheckpointError) as info:
        checkpoint.load(path)
    message = str(info.value)
    assert re.fullmatch(rf"{re.escape(str(path))}: cannot be loaded \(\w+(: [^\n]*)?\): "
                        rf"truncated, damaged or of another kind; {re.escape(EXPECTED)}", message)
    assert isinstance(info.value, ValueError)


def test_other_files_name_what_is_missing(tmp_path):
    best = tmp_path / checkpoint.BEST
    write_payload(best, _payload(resume=False))
    assert checkpoint.load(best)["step"] == 3  # best.pt holds no optimizer
    # the same content named checkpoint.pt cannot be resumed from
    resume = tmp_path / checkpoint.CHECKPOINT
    resume.write_bytes(best.read_bytes())
    with pytest.raises(CheckpointError, match=re.escape(
        f"{resume}: no optimizer, scheduler, early_stopping, history, rng in the file; {EXPECTED}"
    )):
        checkpoint.load(resume)
    # a plain state dict, a list, another format, a config that is not a table
    torch.save({"w": torch.ones(2)}, tmp_path / "state.pt")
    with pytest.raises(CheckpointError, match=re.escape(
        f"{tmp_path / 'state.pt'}: no format in the file; {EXPECTED}"
    )):
        checkpoint.load(tmp_path / "state.pt")
    torch.save([1, 2], tmp_path / "list.pt")
    with pytest.raises(CheckpointError, match=re.escape(
        f"{tmp_path / 'list.pt'}: holds a list, not a checkpoint; {EXPECTED}"
    )):
        checkpoint.load(tmp_path / "list.pt")
    torch.save({**_payload(resume=False), "format": 9}, tmp_path / "new.pt")
    with pytest.raises(CheckpointError, match=re.escape(
        f"{tmp_path / 'new.pt'}: checkpoint format 9, expected 1"
    )):
        checkpoint.load(tmp_path / "new.pt")
    torch.save({**_payload(resume=False), "format": 1, "config": [1]}, tmp_path / "cfg.pt")
    with pytest.raises(CheckpointError, match=re.escape(
        f"{tmp_path / 'cfg.pt'}: its config is a list, not a dict"
    )):
        checkpoint.load(tmp_path / "cfg.pt")
    with pytest.raises(FileNotFoundError, match=re.escape(f"no checkpoint at {tmp_path / 'x.pt'}")):
        checkpoint.load(tmp_path / "x.pt")
