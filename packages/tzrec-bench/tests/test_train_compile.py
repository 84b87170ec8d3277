"""``tzrec-bench train --compile``: the same run as an eager one, the same checkpoints, resume
and evaluate across the two, dropout, the refusals, and AdamW's state across implementations.

Inductor compiles C++ on the CPU (about a minute per graph on two cores), so the compiled
runs here go through the ``aot_eager`` backend: dynamo captures the step as production does,
AOTAutograd traces its backward, only the generated code differs. With inductor by hand on
this tiny run (torch 2.13, CPU): the same 2 graphs, no graph break, losses within 3e-7
relative of the eager run's.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
import torch
from torch._dynamo.utils import counters

from tzrec_bench.cli import main
from tzrec_bench.train import checkpoint, validation
from tzrec_bench.train.config import ConfigError, TrainConfig
from tzrec_bench.train.loop import evaluate, train
from tzrec_bench.train.strategies import adamw, load_optimizer_state

# test_trainer.py's tiny run: about a second per eager run on two CPU cores
TINY = dict(
    data="synthetic", synthetic_users=48, synthetic_items=120, max_seq_len=16,
    embedding_dim=16, num_layers=1, num_heads=2, num_negatives=16, num_candidates=4,
    batch_size=16, lr=1e-2, eval_batch_size=64, log_every=1, progress=False, plot=False,
    dropout=0.0,  # inductor draws dropout masks its own way; off, the runs compare
    # these tests hold torch.compile and the fused optimizer on their own; the captured step
    # (and compile inside it) is test_graphed_step.py's
    cuda_graphs="off",
)


def _config(out_dir: Path, **overrides) -> TrainConfig:
    return TrainConfig(**{**TINY, "out_dir": str(out_dir), **overrides})


@pytest.fixture
def aot_eager(monkeypatch):
    """``torch.compile`` with the ``aot_eager`` backend; yields the arguments of each call."""
    real = torch.compile
    calls = []

    def compile_with_aot_eager(model, **kwargs):
        calls.append(kwargs)
        return real(model, **{**kwargs, "backend": "aot_eager"})

    torch._dynamo.reset()  # no graph of another test, and fresh counters
    monkeypatch.setattr(torch, "compile", compile_with_aot_eager)
    yield calls
    torch._dynamo.reset()


def _losses(result) -> torch.Tensor:
    return torch.tensor([r["loss"] for r in result.history["train"]])


def test_a_compiled_run_trains_resumes_and_evaluates_like_an_eager_one(tmp_path, aot_eager):
    options = dict(eval_every=2, warmup_steps=2)
    eager = train(_config(tmp_path / "eager", max_steps=4, **options))
    compiled_dir = tmp_path / "compiled"
    compiled = train(_config(compiled_dir, max_steps=4, compile=True, **options))
    assert aot_eager == [{"dynamic": None}]  # the step module, once
    # 4 batches of different token counts: a static graph for the first, then one with
    # the sizes that changed made dynamic (not one per step); the step is one graph
    assert counters["stats"]["unique_graphs"] == 2, dict(counters["stats"])
    assert not counters["graph_break"], dict(counters["graph_break"])
    # fp32, the same operations on the CPU: 1e-5 relative is float rounding
    torch.testing.assert_close(_losses(compiled), _losses(eager), rtol=1e-5, atol=1e-6)
    for name in (checkpoint.CHECKPOINT, checkpoint.BEST):
        saved, reference = (checkpoint.load(d / name) for d in (compiled_dir, tmp_path / "eager"))
        assert list(saved["model"]) == list(reference["model"]), name  # no _orig_mod. prefix
        for key, value in reference["model"].items():
            torch.testing.assert_close(saved["model"][key], value, rtol=1e-4, atol=1e-5)
    assert evaluate(compiled_dir, "test") == pytest.approx(compiled.test)
    assert compiled.test == pytest.approx(eager.test, abs=1e-6)

    # a compiled run's checkpoint at step 2, resumed with --compile and without it (the
    # option may change on --resume); in this process the graphs above are reused
    halves = tmp_path / "halves"
    train(_config(halves, max_steps=2, compile=True, **options))
    shutil.copytree(halves, tmp_path / "eager-half")
    reference = checkpoint.load(tmp_path / "eager" / checkpoint.CHECKPOINT)["model"]
    for out_dir, compile_ in ((halves, True), (tmp_path / "eager-half", False)):
        resumed = train(_config(out_dir, max_steps=4, resume=True, compile=compile_, **options))
        assert resumed.steps == 4
        torch.testing.assert_close(_losses(resumed), _losses(eager), rtol=1e-5, atol=1e-6)
        saved = checkpoint.load(out_dir / checkpoint.CHECKPOINT)["model"]
        assert list(saved) == list(reference)
        for key, value in reference.items():
            torch.testing.assert_close(saved[key], value, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(model="most-popular"), r"--compile: most-popular is fitted from counts and "
                                     r"takes no gradient steps"),
        (dict(model="popularity-ranking"), r"--compile: popularity-ranking is fitted"),
        (dict(sharding="torchrec"), r"--compile: not supported with --sharding torchrec.*"
                                    r"expected --sharding replicate, or no --compile"),
    ],
)
def test_compile_refuses_runs_it_cannot_compile_before_training(tmp_path, overrides, message):
    with pytest.raises(ConfigError, match=message):
        train(_config(tmp_path / "run", max_steps=2, compile=True, **overrides))
    assert not (tmp_path / "run").exists()  # refused before any data, model or file


def test_a_compiled_run_trains_with_dropout(tmp_path, aot_eager, capsys):
    """Dropout on under --compile: accepted on a GPU too (the Triton kernels read their
    dropout seed from a device tensor, so it no longer breaks the graph; the GPU run is
    tzrec-gr's test_models.py), and a compiled CPU step with dropout runs without a graph
    break. One step: each further graph costs seconds here."""
    for model in ("hstu-retrieval", "hstu-ranking"):
        validation.validate(_config(tmp_path, model=model, compile=True, dropout=0.2),
                           torch.device("cuda"))
    compiled = train(_config(tmp_path, max_steps=1, compile=True, dropout=0.2))
    assert compiled.steps == 1 and torch.isfinite(_losses(compiled)).all()
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert re.search(r"first step under torch.compile: \d+\.\d s", capsys.readouterr().out)


def test_the_command_exits_2_naming_compile(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["train", "--model", "item-knn", "--compile", "--no-progress", "--no-plot",
              "--out-dir", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "error: --compile: item-knn is fitted" in err, err
    assert TrainConfig().compile is False


def _stepped(optimizer: torch.optim.Optimizer, params, steps: int = 2) -> None:
    for _ in range(steps):
        for p in params:
            p.grad = torch.ones_like(p)
        optimizer.step()


@pytest.mark.parametrize("saved_fused", [True, False])
def test_optimizer_state_loads_keeping_the_built_implementation(saved_fused):
    """A checkpoint of a CUDA run (fused AdamW) resumed on the CPU, and the reverse: the
    loaded optimizer keeps its own implementation (``load_state_dict`` alone would take
    the saved one's), and the two continue alike within rounding."""
    config = TrainConfig(lr=1e-2)
    built = adamw([torch.zeros(3, requires_grad=True)], config)
    assert built.defaults["fused"] is None  # CPU parameters: torch's default, foreach

    def make(fused):
        params = [torch.linspace(-1, 1, 6, requires_grad=True).reshape(2, 3).detach()
                  .requires_grad_()]
        optimizer = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01,
                                      fused=True if fused else None)
        return params, optimizer

    params, saved = make(saved_fused)
    _stepped(saved, params)
    state = saved.state_dict()
    other_params, loading = make(not saved_fused)
    with torch.no_grad():
        other_params[0].copy_(params[0])
    load_optimizer_state(loading, state)
    group = loading.param_groups[0]
    assert group["fused"] == (None if saved_fused else True)
    step = loading.state[other_params[0]]["step"]
    assert step.item() == 2 and step.dtype == torch.float32
    _stepped(saved, params)
    _stepped(loading, other_params)
    torch.testing.assert_close(other_params[0], params[0], rtol=1e-6, atol=1e-7)


@pytest.mark.gpu
def test_on_cuda_adamw_is_fused_and_resumes_a_cpu_checkpoint(tmp_path):
    """The CPU run's AdamW state (foreach, step counts on the host) continues in a fused
    AdamW on the GPU: ``backend pytorch`` and fp32 on both, so only rounding differs."""
    options = dict(eval_every=2, amp="off", backend="pytorch")
    whole = train(_config(tmp_path / "cpu", max_steps=4, device="cpu", **options))
    half = tmp_path / "half"
    train(_config(half, max_steps=2, device="cpu", **options))
    resumed = train(_config(half, max_steps=4, device="cuda", resume=True, **options))
    state = checkpoint.load(half / checkpoint.CHECKPOINT)["optimizer"]
    assert state["param_groups"][0]["fused"] is True
    torch.testing.assert_close(_losses(resumed), _losses(whole), rtol=1e-4, atol=1e-5)


@pytest.mark.gpu
def test_on_cuda_a_compiled_run_trains_like_an_eager_one(tmp_path):
    """Inductor and the default backend (Triton kernels, bf16 autocast), as users run it.

    Three steps: the first graph (static sizes), then the recompiled one (dynamic) twice.
    Inductor's fused code rounds bf16 differently from eager, and at this tiny run's lr of
    1e-2 the difference compounds: on an H200 (torch 2.11) steps 1-3 agreed within the bf16
    tolerance below and a fourth step was 4.7% apart."""
    torch._dynamo.reset()
    counters.clear()  # reset() keeps the counts of graphs an earlier test of the process made
    eager = train(_config(tmp_path / "eager", max_steps=3, device="cuda"))
    compiled = train(_config(tmp_path / "compiled", max_steps=3, device="cuda", compile=True))
    assert counters["stats"]["unique_graphs"] <= 2, dict(counters["stats"])
    torch.testing.assert_close(_losses(compiled), _losses(eager), rtol=2e-2, atol=1e-3)
    torch._dynamo.reset()


@pytest.mark.gpu
def test_on_cuda_a_compiled_run_with_dropout_trains(tmp_path):
    """Inductor and the Triton kernels with dropout on (their seed drawn on the device in the
    graph): three steps train to finite losses, and dynamo breaks no graph."""
    torch._dynamo.reset()
    counters.clear()
    result = train(_config(tmp_path, max_steps=3, device="cuda", compile=True, dropout=0.2))
    assert result.steps == 3 and torch.isfinite(_losses(result)).all()
    assert not counters["graph_break"], dict(counters["graph_break"])
    torch._dynamo.reset()
