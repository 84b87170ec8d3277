"""Backend registry: discovery through entry points, broken plugins, selection rules."""

from __future__ import annotations

import pickle
import warnings

import pytest
import torch
from _fake_plugins import FakePlugins, toy_backends

from tzrec_ops.contract import ContractError
from tzrec_ops.registry import (
    AutomaticBackend,
    Backend,
    BackendError,
    PluginLoadError,
    automatic_backend,
    autotune_configs,
    backends,
    find_implementation,
    get_backend,
    get_registry,
    reset_registry,
    resolve_backend,
    select_backend,
)

CPU = torch.device("cpu")


@pytest.fixture
def plugins(monkeypatch, tmp_path):
    for var in ("TZREC_OPS_BACKEND", "TZREC_OPS_STRICT_PLUGINS", "TRITON_INTERPRET"):
        monkeypatch.delenv(var, raising=False)
    reset_registry()
    fake = FakePlugins(monkeypatch, tmp_path)
    yield fake
    reset_registry()
    fake.cleanup()


@pytest.fixture
def toy(plugins):
    """Three toy backends for ``toy_op``: fast (unavailable), mid (no float64), slow."""
    plugins.add(
        "toy-backends",
        "1.2.0",
        {
            "toy": toy_backends(
                {"name": "fast", "priority": 100, "unavailable": "no gizmo on this machine"},
                {"name": "mid", "priority": 50, "reject_dtype": "float64"},
                {"name": "slow", "priority": 1, "ops": ["toy_op", "other_op"]},
            )
        },
    )
    return plugins


def _run(op="toy_op", backend=None, dtype=torch.float32, **options):
    return select_backend(op, backend, device=CPU, dtype=dtype, **options)()


# -- discovery ----------------------------------------------------------------------------


def test_builtin_backends_register_through_tzrec_ops_entry_points(plugins):
    registry = get_registry()
    assert {"pytorch", "triton", "triton_tma"} <= set(registry.backends)
    assert registry.origins["pytorch"] == "tzrec-ops 0.1.0"
    assert registry.failed_plugins == []


def test_third_party_backend_is_discovered_through_its_entry_point(plugins):
    (module,) = plugins.add(
        "acme-tzrec", "2.3.0", {"acme": toy_backends({"name": "acme", "priority": 50})}
    )
    registry = get_registry()
    assert registry.origins["acme"] == "acme-tzrec 2.3.0"
    assert registry.backends["acme"].ops == {"toy_op": f"{module}:run_acme"}
    assert registry.plugin_manager.has_plugin("acme")
    assert _run() == "acme"


def test_registry_is_cached_until_reset(plugins):
    get_registry()
    plugins.add("late-dist", "1.0", {"late": toy_backends({"name": "late", "priority": 5})})
    assert "late" not in get_registry().backends
    reset_registry()
    assert "late" in get_registry().backends


# -- broken plugins -----------------------------------------------------------------------

BROKEN_IMPORT = "raise ImportError('No module named acme_native')\n"


def test_plugin_that_fails_to_import_is_skipped_with_a_warning(plugins):
    plugins.add("broken-dist", "0.9.1", {"broken": BROKEN_IMPORT})
    with pytest.warns(RuntimeWarning, match=r"'broken'.*broken-dist 0\.9\.1.*acme_native"):
        registry = get_registry()
    (failure,) = registry.failed_plugins
    assert (failure.entry_point, failure.distribution, failure.version) == (
        "broken",
        "broken-dist",
        "0.9.1",
    )
    assert "pytorch" in registry.backends  # the others still load


def test_strict_mode_turns_an_import_failure_into_an_error(plugins, monkeypatch):
    plugins.add("broken-dist", "0.9.1", {"broken": BROKEN_IMPORT})
    monkeypatch.setenv("TZREC_OPS_STRICT_PLUGINS", "1")
    with pytest.raises(
        PluginLoadError, match=r"broken-dist 0\.9\.1.*acme_native.*TZREC_OPS_STRICT_PLUGINS"
    ) as info:
        get_registry()
    assert isinstance(info.value.__cause__, ImportError)


def test_failed_plugin_is_listed_when_an_explicit_request_fails(plugins):
    plugins.add("broken-dist", "0.9.1", {"broken": BROKEN_IMPORT})
    with pytest.warns(RuntimeWarning):
        get_registry()
    with pytest.raises(BackendError, match=r"(?s)unknown backend 'broken'.*failed plugin 'broken'"):
        _run(backend="broken")


HOOK_RAISES = """
import tzrec_ops

@tzrec_ops.hookimpl
def tzrec_ops_register_backends():
    raise RuntimeError("driver 550 is too old")
"""

HOOK_RETURNS_JUNK = """
import tzrec_ops

@tzrec_ops.hookimpl
def tzrec_ops_register_backends():
    return ["not a Backend"]
"""


@pytest.mark.parametrize(
    "source, error",
    [(HOOK_RAISES, "driver 550 is too old"), (HOOK_RETURNS_JUNK, "must return Backend records")],
)
def test_plugin_whose_hook_fails_is_skipped_with_a_warning(plugins, source, error):
    plugins.add("hooky", "3.0", {"hooky": source})
    with pytest.warns(RuntimeWarning, match=rf"'hooky'.*hooky 3\.0.*{error}"):
        registry = get_registry()
    assert [f.entry_point for f in registry.failed_plugins] == ["hooky"]
    assert "pytorch" in registry.backends


def test_strict_mode_turns_a_failing_hook_into_an_error(plugins, monkeypatch):
    plugins.add("hooky", "3.0", {"hooky": HOOK_RAISES})
    monkeypatch.setenv("TZREC_OPS_STRICT_PLUGINS", "true")
    with pytest.raises(PluginLoadError, match=r"hooky 3\.0.*driver 550 is too old"):
        get_registry()


def test_two_backends_with_one_name_is_an_error(plugins):
    plugins.add("dist-a", "1.0", {"a": toy_backends({"name": "dup", "priority": 1})})
    plugins.add("dist-b", "2.0", {"b": toy_backends({"name": "dup", "priority": 2})})
    with pytest.raises(
        PluginLoadError,
        match=r"two backends are named 'dup': one from dist-a 1\.0, one from dist-b 2\.0",
    ):
        get_registry()


def test_a_plugin_cannot_take_a_builtin_name(plugins):
    plugins.add("impostor", "1.0", {"impostor": toy_backends({"name": "pytorch", "priority": 99})})
    with pytest.raises(PluginLoadError, match=r"'pytorch'.*tzrec-ops 0\.1\.0.*impostor 1\.0"):
        get_registry()


def test_duplicate_name_is_an_error_even_without_strict_mode(plugins, monkeypatch):
    monkeypatch.setenv("TZREC_OPS_STRICT_PLUGINS", "0")
    plugins.add("dist-a", "1.0", {"a": toy_backends({"name": "dup", "priority": 1})})
    plugins.add("dist-b", "2.0", {"b": toy_backends({"name": "dup", "priority": 2})})
    with pytest.raises(PluginLoadError, match="backend names must be unique"):
        get_registry()


# -- implementations held to the op contract -------------------------------------------------

NORM_PLUGIN = """
import torch
import tzrec_ops
from tzrec_ops.contract import Backend

def layer_norm({params}):
    return "skewed"

@tzrec_ops.hookimpl
def tzrec_ops_register_backends():
    return [Backend(name="skewed", priority=100, ops={{"layer_norm": __name__ + ":layer_norm"}})]
"""


def _layer_norm(backend=None):
    x = torch.randn(3, 4)
    return select_backend("layer_norm", backend, device=CPU, dtype=x.dtype)


@pytest.mark.parametrize(
    "params, parameter",
    [
        ("x, weight, bias, epsilon", "'epsilon'"),  # wrong name
        ("x, weight, bias", "'eps'"),  # missing
        ("x, weight, bias, eps, scale=1.0", "'scale'"),  # extra
    ],
)
def test_implementation_that_breaks_the_contract_is_skipped_with_a_warning(
    plugins, params, parameter
):
    plugins.add("skewed-dist", "0.3", {"skewed": NORM_PLUGIN.format(params=params)})
    with pytest.warns(
        RuntimeWarning,
        match=rf"skipping layer_norm of tzrec_ops backend 'skewed' from skewed-dist 0\.3: "
        rf".*layer_norm implementation .*parameter {parameter}",
    ):
        impl = _layer_norm()
    assert impl.__module__ == "tzrec_ops.backends.pytorch.layer_norm"  # the next backend
    with pytest.raises(
        BackendError,
        match=rf"'skewed' .*cannot run layer_norm: its implementation does not match the "
        rf"contract: .*{parameter}",
    ):
        _layer_norm("skewed")


def test_strict_mode_turns_a_contract_mismatch_into_an_error(plugins, monkeypatch):
    plugins.add("skewed-dist", "0.3", {"skewed": NORM_PLUGIN.format(params="x, weight, bias")})
    monkeypatch.setenv("TZREC_OPS_STRICT_PLUGINS", "1")
    with pytest.raises(
        PluginLoadError,
        match=r"'skewed' from skewed-dist 0\.3 breaks the op contract: .*lacks parameter 'eps'"
        r".*TZREC_OPS_STRICT_PLUGINS",
    ) as info:
        _layer_norm()
    assert isinstance(info.value.__cause__, ContractError)


def test_implementation_that_matches_the_contract_runs(plugins):
    plugins.add("skewed-dist", "0.3", {"skewed": NORM_PLUGIN.format(params="x, weight, bias, eps")})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _layer_norm()(x=None, weight=None, bias=None, eps=None) == "skewed"


# -- automatic selection --------------------------------------------------------------------


def test_priority_skips_unavailable_and_unsupported_backends(toy):
    assert _run(dtype=torch.float32) == "mid"  # fast is unavailable
    assert _run(dtype=torch.float64) == "slow"  # mid refuses float64
    assert _run("other_op") == "slow"  # only slow implements it


def test_no_backend_for_an_op_lists_every_candidate(toy):
    with pytest.raises(BackendError, match="no backend can run missing_op") as info:
        _run("missing_op")
    for name in [b.name for b in backends()]:
        assert f"\n  {name}: does not implement missing_op" in str(info.value)


def test_backends_are_ordered_by_priority_then_name(toy):
    ordered = [(b.priority, b.name) for b in backends()]
    assert ordered == sorted(ordered, key=lambda pn: (-pn[0], pn[1]))
    assert [b.name for b in backends()][:2] == ["fast", "mid"]


# -- explicit requests ------------------------------------------------------------------------


def test_explicit_backend_wins_over_priority(toy):
    assert _run(backend="slow") == "slow"


def test_explicit_request_for_unavailable_backend_lists_every_candidate(toy):
    with pytest.raises(BackendError) as info:
        _run(backend="fast")
    message = str(info.value)
    assert message.startswith(
        "backend 'fast' (requested by backend=) cannot run toy_op: "
        "unavailable: no gizmo on this machine"
    )
    assert "call: device=cpu, dtype=torch.float32" in message
    assert "\n  fast: unavailable: no gizmo on this machine" in message
    assert "\n  mid: accepts this call" in message
    assert "\n  slow: accepts this call" in message
    assert "\n  pytorch: does not implement toy_op" in message
    listed = {line.split(":")[0].strip() for line in message.split("candidates:")[1].splitlines()}
    assert {b.name for b in backends()} <= listed


def test_explicit_request_that_rejects_the_call_never_falls_back(toy):
    with pytest.raises(
        BackendError,
        match=r"backend 'mid' \(requested by backend=\) cannot run toy_op: "
        r"dtype torch\.float64 is not supported",
    ):
        _run(backend="mid", dtype=torch.float64)


def test_unknown_backend_names_the_registered_ones(toy):
    with pytest.raises(BackendError, match=r"unknown backend 'nope'; registered backends: .*mid"):
        _run(backend="nope")


def test_backend_record_can_be_passed_directly(plugins):
    record = Backend(name="adhoc", priority=0, ops={"toy_op": "builtins:len"})
    assert select_backend("toy_op", record, device=CPU, dtype=torch.float32) is len


# -- TZREC_OPS_BACKEND ------------------------------------------------------------------------


def test_env_names_one_backend_for_every_op(toy, monkeypatch):
    monkeypatch.setenv("TZREC_OPS_BACKEND", "slow")
    assert _run() == "slow"
    assert _run("other_op") == "slow"


def test_env_per_op_override(toy, monkeypatch):
    monkeypatch.setenv("TZREC_OPS_BACKEND", "other_op=slow, toy_op = slow")
    assert _run() == "slow"
    monkeypatch.setenv("TZREC_OPS_BACKEND", "other_op=slow")
    assert _run() == "mid"  # toy_op is not named: priorities decide


def test_explicit_argument_beats_env(toy, monkeypatch):
    monkeypatch.setenv("TZREC_OPS_BACKEND", "slow")
    assert _run(backend="mid") == "mid"


def test_env_request_for_unavailable_backend_is_an_error(toy, monkeypatch):
    monkeypatch.setenv("TZREC_OPS_BACKEND", "toy_op=fast")
    with pytest.raises(
        BackendError,
        match=r"backend 'fast' \(requested by TZREC_OPS_BACKEND\) cannot run toy_op: "
        r"unavailable: no gizmo",
    ):
        _run()


@pytest.mark.parametrize("value", ["toy_op=slow,mid", "toy_op="])
def test_malformed_env_value_is_an_error(toy, monkeypatch, value):
    monkeypatch.setenv("TZREC_OPS_BACKEND", value)
    with pytest.raises(BackendError, match=r"TZREC_OPS_BACKEND=.*expected 'op=backend'"):
        _run()


# -- checks that misbehave ---------------------------------------------------------------------


def test_raising_checks_become_reasons(plugins):
    def broken_availability():
        raise OSError("cannot read /dev/gizmo")

    def broken_supports(op, call):
        raise KeyError("dtype")

    record = Backend("odd", 0, {"toy_op": "builtins:len"}, availability=broken_availability)
    assert record.unavailable_reason() == (
        "availability check raised OSError('cannot read /dev/gizmo')"
    )
    record = Backend("odd", 0, {"toy_op": "builtins:len"}, supports=broken_supports)
    assert record.rejection("toy_op", {}) == "supports check raised KeyError('dtype')"


def test_availability_is_checked_once(plugins):
    calls = []
    record = Backend("once", 0, {}, availability=lambda: calls.append(1) or "nope")
    assert record.unavailable_reason() == record.unavailable_reason() == "nope"
    assert calls == [1]


# -- resolve_backend ------------------------------------------------------------------------------


def test_resolve_backend_picks_highest_available(toy):
    assert resolve_backend().name == "mid"
    assert resolve_backend(op="other_op").name == "slow"
    record = get_backend("slow")
    assert resolve_backend(record) is record


def test_resolve_backend_follows_env(toy, monkeypatch):
    monkeypatch.setenv("TZREC_OPS_BACKEND", "toy_op=slow")
    assert resolve_backend(op="toy_op").name == "slow"


def test_resolve_unavailable_backend_is_an_error(toy):
    with pytest.raises(BackendError, match="backend 'fast' is unavailable: no gizmo on this"):
        resolve_backend("fast")


def test_resolve_with_no_implementation_is_an_error(toy):
    with pytest.raises(BackendError, match="no available backend implements missing_op"):
        resolve_backend(op="missing_op")


# -- autotune configs ------------------------------------------------------------------------------

TUNER = """
import tzrec_ops

@tzrec_ops.hookimpl
def tzrec_ops_autotune_configs(kernel, device):
    if kernel != "toy_kernel":
        return None
    return [{tag!r} + "-" + device.type]
"""


def test_autotune_configs_are_collected_from_every_plugin(plugins):
    plugins.add("tuner-a", "1.0", {"tuner_a": TUNER.format(tag="a")})
    plugins.add("tuner-b", "1.0", {"tuner_b": TUNER.format(tag="b")})
    assert sorted(autotune_configs("toy_kernel", CPU)) == ["a-cpu", "b-cpu"]
    assert autotune_configs("other_kernel", CPU) == []  # the ROCm plugin adds nothing on CPU


def test_no_warning_when_every_plugin_loads(plugins):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        get_registry()


# -- eager choice cache --------------------------------------------------------------------------


@pytest.fixture
def rejections(monkeypatch):
    """Every (backend, op) whose rejection checks ran, in order."""
    seen = []
    real = Backend.rejection

    def spy(self, op, call):
        seen.append((self.name, op))
        return real(self, op, call)

    monkeypatch.setattr(Backend, "rejection", spy)
    return seen


def test_repeated_eager_call_reuses_the_choice(toy, rejections):
    assert _run() == "mid"
    checked = list(rejections)
    assert checked  # the first call ran the checks
    assert _run() == "mid"
    assert rejections == checked  # the second did not


def test_distinct_calls_are_chosen_separately(toy):
    assert _run(dtype=torch.float32) == "mid"
    assert _run(dtype=torch.float64) == "slow"
    assert _run(dtype=torch.float32) == "mid"


def test_env_change_is_seen_by_the_next_call(toy, monkeypatch):
    assert _run() == "mid"
    monkeypatch.setenv("TZREC_OPS_BACKEND", "slow")
    assert _run() == "slow"
    monkeypatch.setenv("TZREC_OPS_BACKEND", "toy_op=fast")
    with pytest.raises(BackendError, match="unavailable: no gizmo"):
        _run()
    monkeypatch.setenv("TZREC_OPS_BACKEND", "toy_op=slow")  # the error was not remembered
    assert _run() == "slow"
    monkeypatch.delenv("TZREC_OPS_BACKEND")
    assert _run() == "mid"


def test_reset_registry_forgets_the_choices(toy, rejections):
    _run()
    reset_registry()
    del rejections[:]
    assert _run() == "mid"
    assert rejections  # chosen again, against the rebuilt registry


def test_each_backend_record_passed_is_honoured(plugins):
    first = Backend(name="adhoc", priority=0, ops={"toy_op": "builtins:len"})
    second = Backend(name="adhoc", priority=0, ops={"toy_op": "builtins:abs"})
    for _ in range(2):
        assert select_backend("toy_op", first, device=CPU, dtype=torch.float32) is len
        assert select_backend("toy_op", second, device=CPU, dtype=torch.float32) is abs


def test_missing_fast_path_is_remembered(toy, rejections):
    assert find_implementation("missing_op", device=CPU, dtype=torch.float32) is None
    checked = list(rejections)
    assert find_implementation("missing_op", device=CPU, dtype=torch.float32) is None
    assert rejections == checked
    with pytest.raises(BackendError, match="no backend can run missing_op"):
        _run("missing_op")  # select_backend still raises


def test_unhashable_option_is_chosen_without_caching(toy, rejections):
    assert _run(tiles=[64, 32]) == "mid"
    checked = list(rejections)
    assert _run(tiles=[64, 32]) == "mid"
    assert rejections == checked * 2  # chosen again: a list cannot be a cache key


# -- AutomaticBackend records -----------------------------------------------------------------


def test_automatic_backend_answers_as_automatic_selection_would(plugins):
    plugins.add("toy-backends", "1.2.0", {"toy": toy_backends(
        {"name": "fast", "priority": 100, "unavailable": "no gizmo on this machine"},
        {"name": "mid", "priority": 50, "reject_dtype": "float64"},
        {"name": "slow", "priority": 1, "ops": ["toy_op", "other_op"],
         "reject_dtype": "float64"},
    )})
    auto = automatic_backend(["toy_op", "other_op"])
    assert isinstance(auto, AutomaticBackend) and auto.name == "automatic"
    assert {"toy_op", "other_op"} <= set(auto.ops)  # fast is unavailable: not counted
    assert auto.rejection("toy_op", {"device": CPU, "dtype": torch.float32}) is None
    reason = auto.rejection("toy_op", {"device": CPU, "dtype": torch.float64})
    assert reason.startswith("no backend that is picked automatically accepts it:"), reason
    assert "mid:" in reason and "slow:" in reason and "fast: unavailable" in reason, reason
    assert _run(backend=auto) == "mid"
    restored = pickle.loads(pickle.dumps(auto))  # modules holding it pickle
    assert restored.rejection("toy_op", {"device": CPU, "dtype": torch.float32}) is None
    with pytest.raises(BackendError, match="no available backend implements all of toy_op, "
                                           "missing_op"):
        automatic_backend(["toy_op", "missing_op"])


def test_automatic_backend_record_chooses_per_call_as_none_does(toy, monkeypatch):
    # its own op table and checks are never used to choose: a module holds it when it was
    # given no backend, and each call picks for its own device, dtype and options
    auto = AutomaticBackend(
        name="automatic", priority=10**6, ops={"toy_op": "builtins:len"},
        supports=lambda op, call: "never asked",
    )
    assert _run(backend=auto) == "mid"
    assert _run(backend=auto, dtype=torch.float64) == "slow"  # mid refuses float64
    assert find_implementation("toy_op", auto, device=CPU, dtype=torch.float64)() == "slow"
    assert find_implementation("missing_op", auto, device=CPU, dtype=torch.float32) is None
    with pytest.raises(BackendError, match="no backend can run missing_op"):
        _run("missing_op", backend=auto)
    monkeypatch.setenv("TZREC_OPS_BACKEND", "toy_op=slow")  # per op: honoured, explicitly
    assert _run(backend=auto) == "slow"
    monkeypatch.setenv("TZREC_OPS_BACKEND", "toy_op=fast")
    with pytest.raises(BackendError, match=r"'fast' \(requested by TZREC_OPS_BACKEND\)"):
        _run(backend=auto)
    assert resolve_backend(auto) is auto
