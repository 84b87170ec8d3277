"""On a GPU with the triton backends (``pytest -m gpu``): packages load in a fresh process
with nothing but torch (AOTInductor) or ``import tzrec_ops.backends.triton.library`` (a
saved program), outputs match eager; the operator map swaps triton ops for triton_tma ones.

float32 with TF32 off, so torch.testing's float32 tolerances apply.
"""

from __future__ import annotations

import pytest
import torch

from tzrec_acc import aot, gr, passes

pytestmark = pytest.mark.gpu

LIBRARY = "tzrec_ops.backends.triton.library"


def _model(backend: str = "triton"):
    from tzrec_gr.models import HSTURanking

    torch.manual_seed(0)
    return HSTURanking(
        1000,
        64,
        128,
        [1, 2],
        [1, 2, 4],
        num_heads=2,
        num_layers=2,
        dropout_ratio=0.0,
        contextual_feature_dim=4,
        max_contextual_seq_len=2,
        max_uih_len=256,
        max_targets=8,
        backend=backend,
        device="cuda",
    ).eval()


@pytest.fixture(autouse=True)
def _cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = previous


def _ops(program) -> set:
    return {str(n.target) for n in program.graph.nodes if "tzrec_ops" in str(n.target)}


def test_triton_packages_load_in_a_fresh_process(tmp_path):
    model = _model()
    device = torch.device("cuda")
    example = gr.sample_inputs(model, batch=8, device=device)
    program = aot.export(model, example, gr.dynamic_shapes(model, example, max_batch=64))
    assert _ops(program), "the triton backend's ops should be in the graph"
    batches = [gr.sample_inputs(model, b, seed=b, device=device) for b in (5, 32)]
    with torch.no_grad():
        want = [[model(*args).cpu()] for args in batches]
    saved = aot.save_program(program, str(tmp_path / "program.pt2"))
    for got, expected in zip(aot.run_in_fresh_process(saved, batches, "program", [LIBRARY]), want):
        assert aot.parity(expected, got).ok, str(aot.parity(expected, got))
    package = aot.compile_package(program, str(tmp_path / "ranking.pt2"))
    for got, expected in zip(aot.run_in_fresh_process(package, batches, "aoti"), want):
        assert aot.parity(expected, got).ok, str(aot.parity(expected, got))


def test_serving_step_package_matches_score(tmp_path):
    model = _model()
    step, args, shapes = gr.serving_step(model, history=200, new=8, batch=8)
    program = aot.export(step, args, shapes)
    package = aot.compile_package(program, str(tmp_path / "step.pt2"))
    (got,) = aot.run_in_fresh_process(package, [args], "aoti")
    with torch.no_grad():
        report = aot.parity([step(*args).cpu()], got)
    assert report.ok, str(report)


def test_operator_map_swaps_triton_for_triton_tma():
    """On a bf16 serving step's exported graph, every ``*_triton`` op with a ``*_triton_tma``
    twin (the cached attention) is swapped for it, and the scores stay within bf16 spacing.

    (The full forward's graph has none: its fused preprocess-and-attention op has no TMA
    variant.)"""
    from tzrec_acc.precision import HalfPrecision
    from tzrec_ops import resolve_backend

    try:
        resolve_backend("triton_tma")
    except Exception as exc:  # e.g. compute capability < 9.0
        pytest.skip(f"triton_tma unavailable: {exc}")
    step, args, _ = gr.serving_step(_model(), history=200, new=8, batch=8)
    step = HalfPrecision(step, "bf16").eval()
    args = step.cast(args)
    gm = aot.export(step, args).module()
    table = passes.OperatorMap()
    for name in _ops(gm):
        op = name.split(".")[1]  # tzrec_ops.<op>.<overload>
        tma = getattr(torch.ops.tzrec_ops, op.replace("_triton", "_triton_tma"), None)
        if op.endswith("_triton") and tma is not None:
            table.register(getattr(torch.ops.tzrec_ops, op), tma)
    assert len(table) >= 1, f"no op of {sorted(_ops(gm))} has a triton_tma twin"
    with torch.no_grad():
        want = gm(*args)
    counts = passes.map_operators(gm, table)
    assert counts.get("tzrec_ops.delta_hstu_mha_triton.default", 0) >= 1, counts
    assert not any(table.lookup(n.target) for n in gm.graph.nodes if n.op == "call_function")
    with torch.no_grad():
        got = gm(*args)
    # torch.testing's bfloat16 tolerances (the outputs are cast back to float32)
    torch.testing.assert_close(got, want, rtol=1.6e-2, atol=1e-5)
