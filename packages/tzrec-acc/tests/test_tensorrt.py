"""tzrec_acc.tensorrt: the missing-extra error, and its arguments reaching torch-tensorrt
(a stand-in module records them: TensorRT cannot be installed on these machines)."""

from __future__ import annotations

import sys
import types

import pytest
import torch
from _models import ranking

from tzrec_acc import aot, gr, tensorrt


class _Input:
    def __init__(self, **kwargs):
        self.kwargs = kwargs


@pytest.fixture
def fake_trt(monkeypatch):
    """A ``torch_tensorrt`` with ``Input``, ``dynamo.compile`` and ``save`` that record calls."""
    calls = {}
    module = types.ModuleType("torch_tensorrt")
    module.Input = _Input

    def compile(program, **kwargs):
        calls["compile"] = (program, kwargs)
        return program.module()

    def save(gm, path, **kwargs):
        calls["save"] = (gm, path, kwargs)

    module.dynamo = types.SimpleNamespace(compile=compile)
    module.save = save
    monkeypatch.setitem(sys.modules, "torch_tensorrt", module)
    return calls


def test_missing_torch_tensorrt_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch_tensorrt", None)
    with pytest.raises(
        ImportError,
        match=r"^TensorRT compilation needs the optional dependency "
        r"torch_tensorrt, .* pip install 'tzrec-acc\[tensorrt\]'$",
    ):
        tensorrt.compile(None, (), (), ())


def test_compile_passes_dynamic_inputs_workspace_and_block_size(fake_trt, tmp_path):
    model = ranking()
    small, large = gr.sample_inputs(model, 2), gr.sample_inputs(model, 6, seed=1)
    program = aot.export(model, small, gr.dynamic_shapes(model, small))
    compiled = tensorrt.compile(
        program,
        small,
        small,
        large,
        workspace_size=1 << 20,
        min_block_size=3,
        enabled_precisions={torch.float16},
        debug=True,
    )
    got_program, kwargs = fake_trt["compile"]
    assert got_program is program
    assert kwargs["workspace_size"] == 1 << 20 and kwargs["min_block_size"] == 3
    assert kwargs["enabled_precisions"] == {torch.float16} and kwargs["debug"] is True
    (specs,) = kwargs["arg_inputs"]
    ids = specs["uih.item_id"].kwargs
    assert ids["min_shape"] == tuple(small[0]["uih.item_id"].shape)
    assert ids["opt_shape"] == ids["min_shape"]
    assert ids["max_shape"] == tuple(large[0]["uih.item_id"].shape)
    assert ids["dtype"] == torch.int64
    assert specs["contextual"].kwargs["max_shape"] == (6, 6)
    with torch.no_grad():
        torch.testing.assert_close(compiled(*large), model(*large))
    tensorrt.save(compiled, str(tmp_path / "m.pt2"), small)
    gm, path, save_kwargs = fake_trt["save"]
    assert gm is compiled and path.endswith("m.pt2")
    assert save_kwargs == {"output_format": "exported_program", "arg_inputs": list(small)}


def test_argument_errors(fake_trt):
    with pytest.raises(ValueError, match="workspace_size must be > 0 bytes, got 0"):
        tensorrt.compile(None, (), (), (), workspace_size=0)
    with pytest.raises(ValueError, match="min_block_size must be >= 1, got 0"):
        tensorrt.compile(None, (), (), (), min_block_size=0)
    with pytest.raises(ValueError, match="must have the same structure"):
        tensorrt.input_specs((torch.ones(1),), (torch.ones(1), torch.ones(1)), (torch.ones(1),))
    with pytest.raises(ValueError, match=r"input leaf 0: min/opt/max must share rank and dtype"):
        tensorrt.input_specs((torch.ones(1),), (torch.ones(1, 2),), (torch.ones(1, 2),))


def test_profile_returns_the_profiler_table():
    table = tensorrt.profile(torch.nn.Linear(4, 4), (torch.randn(2, 4),), steps=2)
    assert "aten::" in table and "Self CPU" in table
    with pytest.raises(ValueError, match="steps must be >= 1, got 0"):
        tensorrt.profile(torch.nn.Linear(4, 4), (torch.randn(2, 4),), steps=0)
