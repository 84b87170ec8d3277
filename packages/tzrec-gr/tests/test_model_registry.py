"""The model registry: built-in records, validation, duplicates, and entry-point plugins."""

from __future__ import annotations

import itertools
import sys
import textwrap
import types

import pytest
from torch import nn

from tzrec_gr.models import HSTURanking, HSTURetrieval, registry
from tzrec_gr.models.registry import (
    ModelRecord,
    ModelRegistryError,
    failed_model_plugins,
    get_model,
    model_names,
    record_for_class,
    register_model,
)

SETTINGS = types.SimpleNamespace(
    embedding_dim=16, max_seq_len=12, num_heads=2, num_layers=1, dropout=0.0,
    num_negatives=4, temperature=0.05, num_candidates=3, backend=None,
)
_MODULE_IDS = itertools.count()


class Toy(nn.Module):
    def __init__(self, num_items: int) -> None:
        super().__init__()
        self.num_items = num_items


class FakeEntryPoint:
    """An entry point of the ``tzrec_gr.models`` group naming ``value``, from ``dist``."""

    def __init__(self, name: str, value: str, dist: str, version: str) -> None:
        self.name, self.value, self.group = name, value, registry.ENTRY_POINT_GROUP
        self.dist = types.SimpleNamespace(metadata={"Name": dist}, version=version)

    def load(self):
        __import__(self.value)
        return sys.modules[self.value]


@pytest.fixture
def plugins(monkeypatch, tmp_path):
    """A registry holding the records registered so far and no discovered plugin; ``add``
    writes a plugin module and announces it as an entry point."""
    monkeypatch.delenv(registry.STRICT_PLUGINS_ENV, raising=False)
    state = registry._STATE
    monkeypatch.setattr(
        registry, "_STATE", registry._State(dict(state.records), dict(state.origins))
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    entry_points = []
    monkeypatch.setattr(registry, "_entry_points", lambda: list(entry_points))
    modules = []

    def add(name: str, source: str, dist: str = "toy-models", version: str = "0.1") -> str:
        module = f"toy_model_plugin_{next(_MODULE_IDS)}"
        (tmp_path / f"{module}.py").write_text(textwrap.dedent(source))
        entry_points.append(FakeEntryPoint(name, module, dist, version))
        modules.append(module)
        return module

    yield types.SimpleNamespace(add=add, entry_points=entry_points)
    for module in modules:
        sys.modules.pop(module, None)


TOY_PLUGIN = """
from torch import nn
from tzrec_gr.models.registry import ModelRecord, register_model

class ToyPluginModel(nn.Module):
    def __init__(self, num_items):
        super().__init__()

register_model(ModelRecord(
    "toy-plugin", ToyPluginModel, "ranking",
    trainer_kwargs=lambda settings, num_items, task_bits: dict(num_items=num_items),
    description="a plugin's model"))
"""


# -- built-in records -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, cls, task", [("hstu-retrieval", HSTURetrieval, "retrieval"),
                        ("hstu-ranking", HSTURanking, "ranking")],
)
def test_builtin_models_are_registered_by_their_modules(name, cls, task):
    record = get_model(name)
    assert (record.model_class, record.task, record.fitted) == (cls, task, False)
    assert record.shardable  # torchrec may shard its item table (its embedding_tables)
    assert record.description
    assert record_for_class(cls.__name__) is record and record_for_class(cls) is record
    assert name in model_names() and name in model_names(task)
    assert registry._STATE.origins[name] == cls.__module__


def test_builtin_trainer_kwargs_build_the_model():
    retrieval = get_model("hstu-retrieval").trainer_kwargs(SETTINGS, 50, ())
    assert retrieval["max_seq_len"] == 12 and retrieval["num_negatives"] == 4
    assert isinstance(HSTURetrieval(**retrieval), HSTURetrieval)
    ranking = get_model("hstu-ranking").trainer_kwargs(SETTINGS, 50, (1, 2))
    assert ranking["task_bitmasks"] == [1, 2] and ranking["max_targets"] == 3
    assert ranking["action_weights"] == [1, 2, 4, 8, 16, 32, 64, 128]
    assert isinstance(HSTURanking(**ranking), HSTURanking)


def test_names_list_trained_before_fitted_and_retrieval_before_ranking(plugins):
    register_model(ModelRecord("toy-fitted", Toy, "retrieval", fitted=True))
    names = model_names()
    assert names.index("hstu-retrieval") < names.index("hstu-ranking") < names.index(
        "toy-fitted")
    assert "toy-fitted" not in model_names("ranking")
    with pytest.raises(ModelRegistryError, match=r"task must be one of retrieval, ranking"):
        model_names("classification")


# -- records ----------------------------------------------------------------------------------


def test_task_is_validated():
    with pytest.raises(ModelRegistryError, match=r"^model 'toy': task must be one of "
                       r"retrieval, ranking, got 'classification'$"):
        ModelRecord("toy", Toy, "classification")


def test_model_class_and_builder_are_validated():
    with pytest.raises(ModelRegistryError, match=r"model_class must be an nn.Module class"):
        ModelRecord("toy", dict, "retrieval")
    with pytest.raises(ModelRegistryError, match=r"trainer_kwargs must be callable or None"):
        ModelRecord("toy", Toy, "retrieval", trainer_kwargs={"num_items": 3})
    with pytest.raises(ModelRegistryError, match=r"name must be a non-empty string"):
        ModelRecord("", Toy, "retrieval")
    with pytest.raises(ModelRegistryError, match=r"^model 'toy': shardable must be True or "
                       r"False, got 'yes'$"):
        ModelRecord("toy", Toy, "retrieval", shardable="yes")


def test_takes_names_the_constructors_named_parameters_only():
    class Open(nn.Module):
        def __init__(self, num_items: int, *args, backend: str = "auto", **kwargs) -> None:
            super().__init__()

    record = ModelRecord("open", Open, "retrieval")
    assert record.takes("num_items") and record.takes("backend")
    assert not record.takes("kwargs") and not record.takes("args")
    assert not record.takes("self") and not record.takes("input_projection")
    # the built-in models: what train's checks and the load test ask
    assert get_model("hstu-retrieval").takes("input_projection")
    assert not get_model("hstu-ranking").takes("input_projection")
    assert get_model("hstu-ranking").takes("use_time_encoding")


def test_a_record_is_not_shardable_unless_it_says_so():
    assert not ModelRecord("toy", Toy, "retrieval").shardable
    assert ModelRecord("toy", Toy, "retrieval", shardable=True).shardable


def test_a_registered_record_is_found_and_registering_it_again_does_nothing(plugins):
    record = ModelRecord("toy", Toy, "retrieval", description="a toy")
    assert register_model(record) is record
    register_model(ModelRecord("toy", Toy, "retrieval", description="a toy"))
    assert get_model("toy") is record and record_for_class("Toy") is record
    assert registry._STATE.origins["toy"] == __name__


def test_a_second_record_of_one_name_is_refused_naming_both_origins(plugins):
    with pytest.raises(ModelRegistryError) as exc:
        register_model(ModelRecord("hstu-retrieval", Toy, "retrieval"))
    assert str(exc.value) == (
        f"two models are named 'hstu-retrieval': one registered by tzrec_gr.models.retrieval, "
        f"one by {__name__}; model names must be unique"
    )
    assert get_model("hstu-retrieval").model_class is HSTURetrieval


def test_a_second_record_of_one_class_is_refused_naming_both_origins(plugins):
    with pytest.raises(ModelRegistryError) as exc:
        register_model(ModelRecord("hstu-retrieval-2", HSTURetrieval, "retrieval"))
    message = str(exc.value)
    assert message.startswith(
        f"models 'hstu-retrieval' (registered by tzrec_gr.models.retrieval) and "
        f"'hstu-retrieval-2' (registered by {__name__}) both have the class 'HSTURetrieval'"
    ), message
    assert "hstu-retrieval-2" not in model_names()


def test_an_unknown_name_lists_the_known_ones(plugins):
    with pytest.raises(ModelRegistryError) as exc:
        get_model("hstu")
    assert str(exc.value) == f"unknown model 'hstu'; registered: {', '.join(model_names())}"
    assert {"hstu-retrieval", "hstu-ranking"} <= set(model_names())  # other packages may add
    with pytest.raises(ModelRegistryError, match=r"^unknown model class 'DLRM'; registered: .*"
                       r"HSTURetrieval"):
        record_for_class("DLRM")
    with pytest.raises(ModelRegistryError, match=r"unknown model class 'Toy'"):
        record_for_class(Toy)


# -- plugins ----------------------------------------------------------------------------------


def test_a_plugin_registers_its_model_through_the_entry_point_group(plugins):
    module = plugins.add("toy", TOY_PLUGIN)
    record = get_model("toy-plugin")
    assert record.model_class.__module__ == module and record.task == "ranking"
    assert record_for_class("ToyPluginModel") is record
    assert registry._STATE.origins["toy-plugin"] == (
        "model plugin 'toy' from distribution toy-models 0.1")
    assert failed_model_plugins() == []


def test_plugins_are_discovered_once_on_the_first_lookup(plugins, monkeypatch):
    plugins.add("toy", TOY_PLUGIN)
    calls = []
    announced = registry._entry_points
    monkeypatch.setattr(registry, "_entry_points", lambda: calls.append(1) or announced())
    assert "toy-plugin" in model_names()
    get_model("toy-plugin"), failed_model_plugins()
    assert calls == [1]


def test_a_plugin_that_fails_to_import_is_skipped_with_a_warning(plugins):
    plugins.add("broken", "raise ImportError('needs gizmo')", dist="broken-models",
                version="0.3")
    plugins.add("toy", TOY_PLUGIN)
    with pytest.warns(RuntimeWarning, match=r"skipping tzrec_gr model plugin 'broken' "
                      r"\(toy_model_plugin_\d+\) from distribution broken-models 0\.3: "
                      r"ImportError\('needs gizmo'\)"):
        assert get_model("hstu-ranking").model_class is HSTURanking
    assert get_model("toy-plugin").task == "ranking"  # the other plugin still loads
    (failed,) = failed_model_plugins()
    assert (failed.entry_point, failed.distribution, failed.version) == (
        "broken", "broken-models", "0.3")
    with pytest.raises(ModelRegistryError, match=r"(?s)unknown model 'gizmo'.*\n  failed "
                       r"model plugin 'broken'"):
        get_model("gizmo")


def test_a_plugin_that_fails_halfway_registers_nothing(plugins):
    plugins.add("half", TOY_PLUGIN + "\nraise RuntimeError('late')\n")
    with pytest.warns(RuntimeWarning, match=r"plugin 'half'.*RuntimeError\('late'\)"):
        assert "toy-plugin" not in model_names()
    assert [f.entry_point for f in failed_model_plugins()] == ["half"]


def test_strict_mode_makes_a_failed_plugin_an_error(plugins, monkeypatch):
    monkeypatch.setenv(registry.STRICT_PLUGINS_ENV, "1")
    plugins.add("broken", "raise ImportError('needs gizmo')", dist="broken-models")
    with pytest.raises(ModelRegistryError, match=r"^failed to load tzrec_gr model plugin "
                       r"'broken' .* from distribution broken-models 0\.1: ImportError"
                       r"\('needs gizmo'\) \(TZREC_GR_STRICT_PLUGINS is set\)$"):
        get_model("hstu-retrieval")


def test_a_plugin_reusing_a_name_is_an_error_naming_both_origins(plugins):
    plugins.add("clash", """
        from torch import nn
        from tzrec_gr.models.registry import ModelRecord, register_model

        class Clash(nn.Module):
            pass

        register_model(ModelRecord("hstu-ranking", Clash, "ranking"))
    """, dist="clash-models", version="1.0")
    with pytest.raises(ModelRegistryError, match=r"two models are named 'hstu-ranking': one "
                       r"registered by tzrec_gr.models.ranking, one by model plugin 'clash' "
                       r"from distribution clash-models 1.0"):
        model_names()


# -- serving asks the registry ---------------------------------------------------------------


def _retrieval_model(cls=HSTURetrieval):
    return cls(**get_model("hstu-retrieval").trainer_kwargs(SETTINGS, 50, ())).eval()


def test_the_builtin_servers_are_registered_for_their_records():
    from tzrec_gr.serving import RankingServer, RetrievalServer, server_for

    assert type(server_for(_retrieval_model())) is RetrievalServer
    ranking = HSTURanking(**get_model("hstu-ranking").trainer_kwargs(SETTINGS, 50, (1, 2)))
    assert type(server_for(ranking)) is RankingServer
    with pytest.raises(TypeError, match="model must be an HSTURetrieval or an HSTURanking, "
                                        "got Toy"):
        server_for(Toy(3))


def test_a_subclass_of_a_registered_model_is_served_as_its_base():
    from tzrec_gr.serving import RetrievalServer, server_for

    class Tuned(HSTURetrieval):
        pass

    assert type(server_for(_retrieval_model(Tuned))) is RetrievalServer


def test_a_record_server_must_be_callable():
    with pytest.raises(ModelRegistryError, match="server must be callable"):
        ModelRecord("toy", Toy, "retrieval", server="not callable")


def test_register_server_refuses_a_second_factory(monkeypatch):
    from tzrec_gr.serving import RetrievalServer, server

    monkeypatch.setattr(server, "_SERVERS", dict(server._SERVERS))
    server.register_server("toy", RetrievalServer)
    server.register_server("toy", RetrievalServer)  # the same again: nothing
    with pytest.raises(ValueError, match="model 'toy' is served by"):
        server.register_server("toy", lambda model: RetrievalServer(model))


class ToyRetrieval(HSTURetrieval):
    """A model of its own record (its own class name), served by its record's server."""


def test_a_registered_model_is_served_by_its_records_server_without_a_session_change(
    plugins, tmp_path
):
    from tzrec_gr.models import MODEL_CLASSES, build_from_config
    from tzrec_gr.serving import Histories, RetrievalServer, ServingSession
    from tzrec_gr.serving.files import predict_file, session_limits

    class ToyServer(RetrievalServer):
        pass

    built = []

    def serve(model):
        built.append(model)
        return ToyServer(model)

    register_model(ModelRecord("toy-retrieval", ToyRetrieval, "retrieval", server=serve))
    model = _retrieval_model(ToyRetrieval)
    session = ServingSession(model)
    assert type(session.server) is ToyServer and built == [model]
    top = session.recommend(Histories.from_lists([[3, 5, 8], [1]]), k=4)
    assert top.ids.shape == (2, 4)
    # predictions from files take the server's limits
    limits = session_limits(session)
    assert (limits.kind, limits.num_items) == ("retrieval", 50)
    source = tmp_path / "users.jsonl"
    source.write_text('{"user_id": 1, "item_ids": [3, 5], "timestamps": [1, 2]}\n')
    summary = predict_file(session, limits, source, tmp_path / "top.csv", k=3, progress=False)
    assert summary.written == 1
    # a config naming its class rebuilds it (checkpoints store the class name)
    assert MODEL_CLASSES["ToyRetrieval"] is ToyRetrieval and "ToyRetrieval" in list(MODEL_CLASSES)
    spec = {"model": "ToyRetrieval",
            "kwargs": get_model("hstu-retrieval").trainer_kwargs(SETTINGS, 50, ())}
    assert type(build_from_config(spec)) is ToyRetrieval


def test_configs_name_trained_models_only(plugins):
    from tzrec_gr.models import MODEL_CLASSES, build_from_config

    register_model(ModelRecord("toy-fitted", Toy, "retrieval", fitted=True))
    assert "Toy" not in MODEL_CLASSES and "HSTURanking" in MODEL_CLASSES
    with pytest.raises(KeyError):
        MODEL_CLASSES["Toy"]
    with pytest.raises(ValueError, match="model must be one of HSTURanking, HSTURetrieval, got "
                                         "'Toy'"):
        build_from_config({"model": "Toy", "kwargs": {"num_items": 3}})


def test_predictions_from_files_take_their_kind_from_the_servers():
    from tzrec_gr.serving._predict import SCORES, TOP_K
    from tzrec_gr.serving.files import Limits

    assert Limits("retrieval", 10, 5).predicts is TOP_K
    assert Limits("ranking", 10, 5, 3, 0, ("click",)).predicts is SCORES
    with pytest.raises(ValueError, match="kind must be 'retrieval' or 'ranking', got 'x'"):
        Limits("x", 10, 5)


def test_the_servers_say_what_export_needs_per_model():
    import torch

    from tzrec_gr.serving import server_for
    from tzrec_gr.serving.server import servable_models

    retrieval = server_for(_retrieval_model())
    ranking = server_for(
        HSTURanking(**get_model("hstu-ranking").trainer_kwargs(SETTINGS, 50, (1, 2))).eval())
    assert servable_models() == ["HSTURetrieval", "HSTURanking"]
    assert (retrieval.export_step, ranking.export_step) == (
        "event_embeddings_step", "score_step")
    assert retrieval.max_candidates == 0 and ranking.max_candidates >= 1
    table = retrieval.item_table(chunk_size=7)  # chunked, the same rows as one chunk
    assert table.shape[0] == 50 and not table.requires_grad
    assert torch.equal(table, retrieval.item_table())
    assert ranking.item_table() is None  # it scores candidates, it ranks no catalogue
    assert set(retrieval.package_fields()) <= set(ranking.package_fields())
    with pytest.raises(ValueError, match="chunk_size must be an int >= 1"):
        retrieval.item_table(chunk_size=0)
    for server in (retrieval, ranking):  # a seed gives one batch
        first, again = server.example_inputs(seed=3), server.example_inputs(seed=3)
        flat = [torch.as_tensor(t) for t in torch.utils._pytree.tree_leaves(first)
                if isinstance(t, torch.Tensor)]
        flat_again = [t for t in torch.utils._pytree.tree_leaves(again)
                      if isinstance(t, torch.Tensor)]
        assert flat and all(torch.equal(a, b) for a, b in zip(flat, flat_again))
        with pytest.raises(ValueError):
            server.example_inputs(batch=0)


def test_a_server_accepts_its_model_class_and_subclasses_and_names_it_in_refusals():
    from tzrec_gr.serving import RankingServer, RetrievalServer

    class MyRetrieval(HSTURetrieval):
        pass

    class MyServer(RetrievalServer):
        model_class = MyRetrieval

    assert (RetrievalServer.model_name, RankingServer.model_name) == (
        "HSTURetrieval", "HSTURanking")
    assert MyServer.model_name == "MyRetrieval"
    mine = MyRetrieval(num_items=10, embedding_dim=8, num_layers=1, max_seq_len=4)
    assert MyServer(mine).model is mine and RetrievalServer(mine).model is mine
    plain = HSTURetrieval(num_items=10, embedding_dim=8, num_layers=1, max_seq_len=4)
    with pytest.raises(TypeError, match=r"^MyServer serves MyRetrieval models, got "
                                        r"HSTURetrieval$"):
        MyServer(plain)
    with pytest.raises(TypeError, match=r"^RankingServer serves HSTURanking models, got "
                                        r"HSTURetrieval$"):
        RankingServer(plain)
