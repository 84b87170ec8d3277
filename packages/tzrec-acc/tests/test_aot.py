"""Export with dynamic dims (full and cached serving forms), fresh-process loading, parity.

Saved programs are loaded by a fresh process in test_cli.py and test_readme.py; the
AOTInductor package is compiled in test_cli.py (and two in test_bench.py). float32
tolerances are torch.testing's defaults (an exported graph may order float sums differently
from eager).
"""

from __future__ import annotations

import pytest
import torch
from _models import ranking, retrieval

from tzrec_acc import aot, gr
from tzrec_gr.serving import RankingServer, RetrievalServer


@pytest.mark.parametrize("build", [ranking, retrieval], ids=["ranking", "retrieval"])
def test_export_is_dynamic_in_users_and_tokens(build):
    model = build()
    example = gr.sample_inputs(model, batch=3, seed=0)
    program = aot.export(model, example, gr.dynamic_shapes(model, example, max_batch=16))
    for batch, history, seed in [(1, 2, 1), (16, None, 3)]:
        args = gr.sample_inputs(model, batch, history, seed=seed)
        torch.testing.assert_close(program.module()(*args), model(*args))


def test_ranking_serving_step_equals_score_and_exports():
    model = ranking()
    step, args, shapes = gr.serving_step(model, history=8, new=4, batch=3)
    ks, vs, offsets, lengths, query_time, contextual, candidates = args
    # the step is the server's own score() against the same cache
    (features,) = gr.sample_inputs(model, 3, 8, 4, seed=0)
    history = {k: v for k, v in features.items() if not k.startswith("candidate")}
    server = RankingServer(model)
    cache = server.prefill(history, query_time)
    with torch.no_grad():
        torch.testing.assert_close(step(*args), server.score(cache, candidates))
        # and forward() of history + candidates, with the same query time
        full = model({**features, **candidates, "query_time": query_time})
        torch.testing.assert_close(step(*args), full)
    program = aot.export(step, args, shapes)
    _, other, _ = gr.serving_step(model, history=6, new=4, batch=5, seed=1)
    with torch.no_grad():
        torch.testing.assert_close(program.module()(*other), step(*other))


def test_retrieval_serving_step_equals_extend_and_exports():
    model = retrieval()
    step, args, shapes = gr.serving_step(model, history=6, new=3, batch=3)
    ks, vs, offsets, lengths, ids, new_lengths, timestamps = args
    cache_args = gr.sample_inputs(model, 3, 6, seed=0)
    server = RetrievalServer(model)
    cache = server.prefill(*cache_args)
    want, _ = server.extend(cache, ids, new_lengths, timestamps, update_cache=False)
    with torch.no_grad():
        torch.testing.assert_close(step(*args), want)
    program = aot.export(step, args, shapes)
    for batch, seed in [(5, 1), (1, 2)]:
        _, other, _ = gr.serving_step(model, history=6, new=3, batch=batch, seed=seed)
        with torch.no_grad():
            torch.testing.assert_close(program.module()(*other), step(*other))


def test_parity_reports_each_output():
    want = [torch.ones(3), torch.zeros(2, dtype=torch.bfloat16), torch.arange(4)]
    got = [torch.ones(3) + 1e-3, torch.full((2,), 1e-6, dtype=torch.bfloat16), torch.arange(4)]
    report = aot.parity(want, got)
    assert [o.ok for o in report.outputs] == [False, True, True]
    assert not report.ok
    assert report.outputs[0].max_abs == pytest.approx(1e-3, rel=1e-3)
    assert (report.outputs[1].rtol, report.outputs[1].atol) == aot.TOLERANCES[torch.bfloat16]
    assert "output 0: shape [3] float32" in str(report) and "MISMATCH" in str(report)


@pytest.mark.parametrize(
    "want, got, message",
    [
        ([torch.ones(2)], [], "expected 1 outputs, got 0"),
        ([torch.ones(2)], [torch.ones(3)], r"output 0: expected \(2,\) torch.float32, got \(3,\)"),
        ([torch.ones(2)], [torch.ones(2).double()], "got .* torch.float64"),
    ],
)
def test_parity_rejects_mismatched_outputs(want, got, message):
    with pytest.raises(ValueError, match=message):
        aot.parity(want, got)


def test_fresh_process_errors(tmp_path):
    with pytest.raises(ValueError, match="kind must be one of aoti, program, got 'onnx'"):
        aot.run_in_fresh_process("x.pt2", [], kind="onnx")
    with pytest.raises(RuntimeError, match="failed with exit code"):
        aot.run_in_fresh_process(str(tmp_path / "missing.pt2"), [(torch.ones(1),)], "program")


def test_export_and_package_argument_errors():
    model = ranking().train()
    with pytest.raises(ValueError, match="eval mode"):
        aot.export(model, gr.sample_inputs(model))
    with pytest.raises(ValueError, match=r"path must end with .pt2 .*, got 'model.so'"):
        aot.compile_package(None, "model.so")


def test_unsupported_model_and_bad_sizes():
    with pytest.raises(
        TypeError,
        match=r"model must be one of tzrec_gr.models.HSTURanking, "
        r"HSTURetrieval, got torch.nn.modules.linear.Linear",
    ):
        gr.model_kind(torch.nn.Linear(2, 2))
    model = ranking()
    with pytest.raises(ValueError, match=r"history \(11\) must be <= the model's bound \(10\)"):
        gr.sample_inputs(model, history=11)
    with pytest.raises(ValueError, match=r"candidates \(5\) must be <= .* max_targets \(4\)"):
        gr.sample_inputs(model, candidates=5)
    with pytest.raises(ValueError, match="batch must be an int >= 1, got 0"):
        gr.sample_inputs(model, batch=0)
    with pytest.raises(ValueError, match=r"history \+ new \(10 \+ 3\) must be <= .*\(12\)"):
        gr.serving_step(retrieval(), history=10, new=3)
    with pytest.raises(ValueError, match="eval mode"):
        gr.RankingServingStep(ranking().train())


def test_package_compile_tunes_on_the_example_inputs_without_grad(monkeypatch, tmp_path):
    """AOTInductor's compile-time tuning on stand-in buffers (zeros for integer tensors)
    sent jagged gathers out of bounds on the GPU; compile_package asks for the two-pass
    compile that runs the graph on the program's example inputs, with grad off (out=
    kernels on trainable parameters refuse grad mode). A caller's setting still wins."""
    seen = []

    def fake_compile(program, package_path, inductor_configs):
        seen.append((dict(inductor_configs), torch.is_grad_enabled()))
        return package_path

    monkeypatch.setattr(torch._inductor, "aoti_compile_and_package", fake_compile)
    model = ranking()
    program = aot.export(model, gr.sample_inputs(model, batch=2, seed=0))
    assert aot.compile_package(program, str(tmp_path / "a.pt2")) == str(tmp_path / "a.pt2")
    aot.compile_package(
        program, str(tmp_path / "b.pt2"), {"triton.autotune_at_compile_time": True, "x": 1}
    )
    assert seen == [
        ({"triton.autotune_at_compile_time": False}, False),
        ({"triton.autotune_at_compile_time": True, "x": 1}, False),
    ]
