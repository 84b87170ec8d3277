"""FX tracing of tzrec-gr's models and the graph passes on their graphs, numerics unchanged.

Traced graphs run the same modules and ops as eager, so outputs are compared exactly
(rtol = atol = 0) unless a pass swaps an operator.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from _models import ranking, retrieval

from tzrec_acc import aot, fx, gr, passes


def _exact(a, b):
    torch.testing.assert_close(a, b, rtol=0, atol=0)


def _traced_ranking():
    model = ranking()
    gm = fx.symbolic_trace(fx.traceable(model))
    (batch,) = gr.sample_inputs(model, batch=3)
    return model, gm, batch, fx.TraceableRanking.inputs(batch)


def test_ranking_traces_with_leaf_modules_and_marks():
    model, gm, batch, args = _traced_ranking()
    with torch.no_grad():
        _exact(gm(*args), model(batch))
    targets = [n.target for n in gm.graph.nodes]
    assert targets.count(fx.mark_sparse) == 2 and fx.mark_dense in targets
    modules = {n.target for n in gm.graph.nodes if n.op == "call_module"}
    assert "model.transducer" in modules  # a leaf: tzrec-gr checks inputs with Python
    assert not any(m.startswith("model.transducer.") for m in modules)


def test_retrieval_traces():
    model = retrieval()
    gm = fx.symbolic_trace(fx.traceable(model))
    args = gr.sample_inputs(model, batch=4)
    with torch.no_grad():
        _exact(gm(*args), model(*args))


def test_extra_leaf_modules_and_bad_ones():
    model, _, _, args = _traced_ranking()
    gm = fx.symbolic_trace(fx.traceable(model), leaf_modules=[torch.nn.Sequential])
    modules = {n.target for n in gm.graph.nodes if n.op == "call_module"}
    assert {"model.item_tower", "model.task_head"} <= modules
    with pytest.raises(TypeError, match="leaf_modules must be nn.Module subclasses, got"):
        fx.symbolic_trace(fx.traceable(model), leaf_modules=[int])


class _Wrapped(torch.nn.Module):
    """Uses each size wrapper on traced values."""

    def forward(self, x: torch.Tensor, bias: torch.Tensor):
        n = fx.fx_numel(x)
        steps = fx.fx_arange(n)
        first = fx.fx_int(x[0])
        return fx.fx_unwrap_optional_tensor(bias) + steps * first


def test_wrappers_stay_calls_in_the_graph_and_run_eagerly():
    gm = fx.symbolic_trace(_Wrapped())
    targets = {n.target for n in gm.graph.nodes if n.op == "call_function"}
    assert {fx.fx_numel, fx.fx_arange, fx.fx_int, fx.fx_unwrap_optional_tensor} <= targets
    x, bias = torch.tensor([3, 1, 2]), torch.ones(3, dtype=torch.int64)
    _exact(gm(x, bias), torch.tensor([1, 4, 7]))
    with pytest.raises(ValueError, match="expected a tensor, got None"):
        fx.fx_unwrap_optional_tensor(None)
    kt = {"a": torch.ones(1)}
    assert fx.mark_keyed_tensor("k", kt) is kt and fx.mark_dense("d", x) is x


def test_tracer_is_torchrec_s_when_installed():
    base, is_torchrec = fx._base_tracer()
    assert is_torchrec == (importlib.util.find_spec("torchrec") is not None)
    assert issubclass(base, torch.fx.Tracer)


# ------------------------------------------------------------------------------ passes


def test_split_then_dce_then_prune_keeps_numerics():
    model, gm, batch, args = _traced_ranking()
    with torch.no_grad():
        want = model(batch)
        split = passes.split_sparse_dense(gm)
        assert split.names == ("candidate.sequence", "uih.sequence")
        marked = split.sparse(*args)
        _exact(marked[0], model.item_embeddings(batch["candidate.item_id"]))
        _exact(split.dense(*args, *marked), want)
        # the dense part still looks the embeddings up (dead code) and holds the table
        assert "model.item_embeddings.weight" in split.dense.state_dict()
        assert passes.eliminate_dead_code(split.dense) == 2  # the two lookups
        assert "model.item_embeddings.weight" in split.dense.state_dict()
        removed = passes.prune_unused_attributes(split.dense)
        assert removed == ["model.item_embeddings"]
        assert not any(k.startswith("model.item_embeddings") for k in split.dense.state_dict())
        _exact(split.dense(*args, *marked), want)
        # the sparse part holds the table only
        assert passes.prune_unused_attributes(split.sparse) == []
        assert set(split.sparse.state_dict()) == {"model.item_embeddings.weight"}


def test_prune_removes_unused_buffers_and_parameters():
    model, gm, batch, args = _traced_ranking()
    gm.register_buffer("unused_buffer", torch.ones(3))
    gm.register_parameter("unused_weight", torch.nn.Parameter(torch.ones(2)))
    gm.add_submodule("unused_layer", torch.nn.Linear(2, 2))
    removed = passes.prune_unused_attributes(gm)
    assert sorted(removed) == ["unused_buffer", "unused_layer", "unused_weight"]
    with torch.no_grad():
        _exact(gm(*args), model(batch))


def test_split_needs_distinct_sparse_marks():
    model = retrieval()
    gm = fx.symbolic_trace(model.transducer.output_postprocessor)
    with pytest.raises(ValueError, match="the graph has no sparse mark; mark the embedding"):
        passes.split_sparse_dense(gm)

    class Twice(torch.nn.Module):
        def forward(self, x):
            return fx.mark_sparse("a", x) + fx.mark_sparse("a", x * 2)

    with pytest.raises(ValueError, match=r"distinct names, got \['a', 'a'\]"):
        passes.split_sparse_dense(fx.symbolic_trace(Twice()))


def _silu(x: torch.Tensor) -> torch.Tensor:
    """SiLU written out, float64 inside: the reference the swapped graph runs."""
    return (x.double() * torch.sigmoid(x.double())).to(x.dtype)


def test_operator_map_swaps_ops_of_an_exported_model():
    model = ranking()
    args = gr.sample_inputs(model, batch=3)
    program = aot.export(model, args, gr.dynamic_shapes(model, args))
    gm = program.module()
    table = passes.OperatorMap().register(torch.ops.aten.silu, _silu)
    counts = passes.map_operators(gm, table)
    assert counts == {"aten.silu.default": counts.get("aten.silu.default", 0)}
    assert counts["aten.silu.default"] >= 1
    assert not any(n.target is torch.ops.aten.silu.default for n in gm.graph.nodes)
    other = gr.sample_inputs(model, batch=5, seed=3)
    with torch.no_grad():
        torch.testing.assert_close(gm(*other), model(*other))


def test_operator_map_on_a_traced_graph_and_its_errors():
    model, gm, batch, args = _traced_ranking()
    calls = []

    def lookup_mark(name, value):
        calls.append(name)
        return value

    counts = passes.map_operators(gm, passes.OperatorMap({fx.mark_sparse: lookup_mark}))
    assert counts == {str(fx.mark_sparse): 2}
    with torch.no_grad():
        _exact(gm(*args), model(batch))
    assert sorted(calls) == ["candidate.sequence", "uih.sequence"]
    with pytest.raises(TypeError, match="must be callables or torch ops, got str and function"):
        passes.OperatorMap().register("aten::silu", _silu)
    assert len(passes.OperatorMap({torch.relu: _silu})) == 1


def test_traceable_follows_the_models_record():
    from _models import RETRIEVAL

    from tzrec_gr.models import HSTURetrieval

    class Tuned(HSTURetrieval):  # a subclass is traced as its registered base
        pass

    assert type(fx.traceable(Tuned(**RETRIEVAL))) is fx.TraceableRetrieval
    assert type(fx.traceable(ranking())) is fx.TraceableRanking
    with pytest.raises(TypeError, match=r"model must be one of tzrec_gr.models.HSTURanking, "
                                        r"HSTURetrieval, got torch.nn.modules.linear.Linear"):
        fx.traceable(torch.nn.Linear(2, 2))


def test_traceable_is_the_form_the_models_server_names(monkeypatch):
    from _models import RETRIEVAL

    from tzrec_gr.models import HSTURetrieval
    from tzrec_gr.serving import RetrievalServer
    from tzrec_gr.serving.server import server_for

    assert server_for(ranking()).trace_forward == fx.TraceableRanking.FORWARD
    assert server_for(HSTURetrieval(**RETRIEVAL)).trace_forward == fx.TraceableRetrieval.FORWARD
    monkeypatch.setattr(RetrievalServer, "trace_forward", "")  # a server naming no form
    with pytest.raises(TypeError, match=r"model must be one of tzrec_gr.models.HSTURanking, "
                                        r"got tzrec_gr.models.retrieval.HSTURetrieval$"):
        fx.traceable(HSTURetrieval(**RETRIEVAL))
