"""``python -m tzrec_acc``'s edges: ``--device auto`` exports (the device is resolved once, as
the command line is read), and a bad option is one line on stderr with exit status 2."""

from __future__ import annotations

import pytest
import torch
from test_checkpoint import bench_checkpoint

from tzrec_acc.cli import main


def test_export_with_device_auto_runs_on_this_machine(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # auto: the CPU
    bench_checkpoint(tmp_path / "best.pt")
    package = str(tmp_path / "ranking.pt2")
    code = main(["export", "--model", str(tmp_path), "--format", "fx", "--output", package,
                 "--device", "auto", "--batch", "2", "--max-batch", "4"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "MISMATCH" not in out
    sample = torch.load(package + ".sample.pt", weights_only=False)
    tensors = [t for t in torch.utils._pytree.tree_leaves(sample["batches"])
               if isinstance(t, torch.Tensor)]
    assert tensors and all(t.device == torch.device("cpu") for t in tensors)


@pytest.mark.parametrize("device, message", [
    ("gpu", "argument --device: 'gpu' is not a device"),
    ("cuda", "argument --device: cuda: no CUDA device is visible to this process"),
])
def test_a_bad_device_is_one_line_naming_the_option(capsys, monkeypatch, device, message):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as info:
        main(["export", "--model", "m.pt", "--output", "m.pt2", "--device", device])
    err = capsys.readouterr().err
    prog = "python -m tzrec_acc export"
    assert info.value.code == 2 and err.count("\n") == 1
    assert err.startswith(f"{prog}: error: {message}")
    assert err.endswith(f"({prog} --help lists the options)\n")
