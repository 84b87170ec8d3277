"""An exported program holding Triton-backend ops loads in a fresh process after one import.

Runs on the CPU through the Triton interpreter, with HSTU attention (its op has an explicit
fake kernel; the other Triton ops use their bodies as fakes, which the interpreter cannot
trace, so their export is covered by the GPU compile tests). The program is exported and
saved here, then loaded and run in a new Python process: with
``import tzrec_ops.backends.triton.library`` it matches the eager output; without it, loading
fails (the ops are unknown), which shows the import is what registers them.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

import tzrec_ops
from tzrec_ops.testing.generators import make_attention_inputs

pytest.importorskip("triton")

_LOADER = textwrap.dedent(
    """
    import sys
    import torch
    if sys.argv[2] == "import":
        import tzrec_ops.backends.triton.library  # noqa: F401
    folder = sys.argv[1]
    program = torch.export.load(folder + "/model.pt2")
    args = torch.load(folder + "/args.pt")
    torch.testing.assert_close(program.module()(*args), torch.load(folder + "/expected.pt"))
    print("loaded and matched")
    """
)


class _Model(torch.nn.Module):
    def __init__(self, max_seq_len: int) -> None:
        super().__init__()
        self.max_seq_len = max_seq_len

    def forward(self, q, k, v, seq_offsets, num_targets):  # type: ignore[no-untyped-def]
        return tzrec_ops.hstu_mha(
            self.max_seq_len, 0.25, q, k, v, seq_offsets, num_targets=num_targets,
            backend="triton",
        )


def _load(folder: str, mode: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, TRITON_INTERPRET="1")
    return subprocess.run(
        [sys.executable, "-c", _LOADER, folder, mode], capture_output=True, text=True, env=env
    )


@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="CPU interpreter test (conftest sets it)"
)
def test_exported_program_loads_in_a_fresh_process(tmp_path):
    inputs = make_attention_inputs([5, 0, 9], 2, 16, 16, num_targets=[1, 0, 2])
    args = (inputs.q, inputs.k, inputs.v, inputs.seq_offsets, inputs.num_targets)
    model = _Model(inputs.max_seq_len)
    program = torch.export.export(model, args)
    targets = {str(node.target) for node in program.graph.nodes}
    assert "tzrec_ops.hstu_mha_triton.default" in targets
    torch.export.save(program, str(tmp_path / "model.pt2"))
    torch.save(args, tmp_path / "args.pt")
    torch.save(model(*args), tmp_path / "expected.pt")

    loaded = _load(str(tmp_path), "import")
    assert loaded.returncode == 0, loaded.stderr[-3000:]
    assert "loaded and matched" in loaded.stdout

    unregistered = _load(str(tmp_path), "no-import")
    assert unregistered.returncode != 0
    assert "tzrec_ops" in unregistered.stderr
