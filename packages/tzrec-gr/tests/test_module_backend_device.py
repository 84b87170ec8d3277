"""A module built without a backend runs on the device of its tensors; a named one is kept.

CUDA is simulated: a registered backend ``gpu_only`` of the highest priority implements every
op with the pytorch backend's functions but refuses CPU tensors, as triton does on a GPU
machine. Automatic selection (``resolve_backend(None)``) picks it, so a module that fixed
that choice in its constructor would fail on CPU tensors.
"""

from __future__ import annotations

import pickle

import pytest
import torch

from tzrec_gr import STULayer, STUStack
from tzrec_ops.registry import (
    Backend,
    BackendError,
    get_backend,
    get_registry,
    reset_registry,
    resolve_backend,
)

E, H, V, A = 16, 2, 4, 8
LENGTHS = [3, 5]


def _gpu_only_supports(op, call):
    device = call.get("device")
    if device is not None and torch.device(device).type != "cuda":
        return f"tensors are on {device}, needs CUDA tensors"
    if call.get("attn_func"):
        return "no SLA masks"
    return get_backend("pytorch").supports(op, call)


@pytest.fixture
def gpu_only(monkeypatch):
    monkeypatch.delenv("TZREC_OPS_BACKEND", raising=False)
    reset_registry()
    registry = get_registry()
    registry.backends["gpu_only"] = Backend(
        name="gpu_only",
        priority=10**6,
        ops=dict(registry.backends["pytorch"].ops),
        supports=_gpu_only_supports,
    )
    registry.origins["gpu_only"] = "test"
    assert resolve_backend(None, "hstu_mha").name == "gpu_only"  # what the old code took
    yield
    reset_registry()


def _stack(backend, n_layers=2) -> STUStack:
    torch.manual_seed(0)
    layers = [
        STULayer(E, H, V, A, output_dropout_ratio=0.0, scaling_seqlen=16, backend=backend)
        for _ in range(n_layers)
    ]
    return STUStack(layers).eval()


def _inputs():
    offsets = torch.tensor([0, LENGTHS[0], sum(LENGTHS)])
    return torch.randn(sum(LENGTHS), E), offsets


def test_module_without_backend_runs_on_cpu_like_the_pytorch_backend(gpu_only):
    automatic, pytorch = _stack(None), _stack("pytorch")
    assert automatic.stu_layers[0]._backend.name == "automatic"
    automatic.load_state_dict(pytorch.state_dict())
    x, offsets = _inputs()
    lengths = torch.tensor(LENGTHS)
    rows = torch.tensor([1, 2, 6, 7])
    with torch.inference_mode():
        outs = []
        for stack in (automatic, pytorch):
            out = stack(x, offsets, 8).x
            caches = stack(x, offsets, 8, kv_caching_lengths=lengths - 2).kv_caches
            new, _ = stack.cached_forward(x[rows], caches)
            outs.append((out, new))
    (out, new), (expected_out, expected_new) = outs
    assert torch.equal(out, expected_out)
    assert torch.equal(new, expected_new)
    torch.testing.assert_close(new, out[rows], rtol=1e-5, atol=1e-5)


def test_named_backend_keeps_its_error(gpu_only, monkeypatch):
    x, offsets = _inputs()
    stack = _stack("gpu_only", n_layers=1)
    with pytest.raises(
        BackendError, match=r"backend 'gpu_only' \(requested by backend=\) cannot run .*needs CUDA"
    ):
        stack(x, offsets, 8)
    monkeypatch.setenv("TZREC_OPS_BACKEND", "gpu_only")  # one name: the module's backend
    stack = _stack(None, n_layers=1)
    assert stack.stu_layers[0]._backend.name == "gpu_only"
    with pytest.raises(BackendError, match=r"backend 'gpu_only' .*needs CUDA tensors"):
        stack(x, offsets, 8)


def test_per_op_env_applies_inside_a_module_without_backend(gpu_only, monkeypatch):
    x, offsets = _inputs()
    stack = _stack(None, n_layers=1)
    monkeypatch.setenv("TZREC_OPS_BACKEND", "hstu_compute_output=gpu_only")
    with pytest.raises(
        BackendError,
        match=r"backend 'gpu_only' \(requested by TZREC_OPS_BACKEND\) cannot run "
        r"hstu_compute_output: tensors are on cpu",
    ):
        stack(x, offsets, 8)
    monkeypatch.setenv("TZREC_OPS_BACKEND", "hstu_compute_output=pytorch")
    stack(x, offsets, 8)


def test_module_without_backend_compiles_exports_and_pickles(gpu_only):
    layer = _stack(None, n_layers=1).stu_layers[0]
    x, offsets = _inputs()
    expected = layer(x, offsets, 8).out
    compiled = torch.compile(layer, backend="eager", fullgraph=True)
    torch.testing.assert_close(compiled(x, offsets, 8).out, expected)

    class Wrapped(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x, offsets):
            return self.inner(x, offsets, 8).out

    exported = torch.export.export(Wrapped(layer), (x, offsets), strict=False)
    torch.testing.assert_close(exported.module()(x, offsets), expected)
    restored = pickle.loads(pickle.dumps(layer))
    assert restored._backend.name == "automatic"
    torch.testing.assert_close(restored(x, offsets, 8).out, expected)


def test_sla_layer_without_backend_takes_the_backend_that_runs_sla_masks(gpu_only):
    # gpu_only, the top priority, refuses SLA masks as triton does: a named request fails in
    # the constructor, while without one the calls with a mask go to the pytorch backend
    with pytest.raises(ValueError, match=r"backend 'gpu_only' cannot run them: no SLA masks"):
        STULayer(E, H, V, A, sla_k1=1, sla_k2=2, backend="gpu_only")
    torch.manual_seed(0)
    automatic = STULayer(E, H, V, A, sla_k1=1, sla_k2=2, output_dropout_ratio=0.0).eval()
    pytorch = STULayer(E, H, V, A, sla_k1=1, sla_k2=2, output_dropout_ratio=0.0,
                       backend="pytorch").eval()
    pytorch.load_state_dict(automatic.state_dict())
    x, offsets = _inputs()
    assert torch.equal(automatic(x, offsets, 8).out, pytorch(x, offsets, 8).out)
