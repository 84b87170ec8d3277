"""Backend registry: plugin discovery and per-call backend selection.

Selection for one op call, in order:

1. the explicit ``backend=`` argument (a name or a :class:`Backend`);
2. the ``TZREC_OPS_BACKEND`` environment variable, either one name for every op
   (``triton``) or per op (``hstu_mha=triton_tma,layer_norm=triton``);
3. the available backend of highest priority that implements the op and accepts the call.

An explicit request (1 or 2) that cannot run the call raises :class:`BackendError` listing
every candidate and why it was rejected; it never falls back silently. An
:class:`AutomaticBackend` record passed as ``backend=`` is no request: the call chooses as for
``backend=None`` (a module that was given no backend holds one, see tzrec-gr).

Plugins are discovered lazily, once, through the ``tzrec_ops`` entry-point group. A plugin
that fails to import is skipped with a warning naming its distribution and version
(``TZREC_OPS_STRICT_PLUGINS=1`` makes that an error).

A registered backend's implementation of an op is checked against the op's declaration
(:func:`tzrec_ops.contract.check_implementation`, as pluggy checks a hookimpl) when it is
first chosen, since announcing a backend imports none of its code. One that does not match
is skipped with a warning, and the backend then refuses that op with the mismatch as its
reason (``TZREC_OPS_STRICT_PLUGINS=1`` makes it an error).

The ``Backend`` record and the op declarations are :mod:`tzrec_ops.contract`'s (re-exported
here).

Eager calls remember their choice per (op, request, call options, ``TZREC_OPS_BACKEND``
value), so a repeated call costs a dict lookup; :func:`reset_registry` forgets the choices.
A backend's ``supports`` and ``automatic`` checks must therefore depend only on the call and
on process state fixed before the first op call (plus the registry, which a reset rebuilds).
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import os
import sys
import threading
import warnings
from typing import (
    Any,
    Callable,
    Dict,
    Hashable,
    Iterable,
    List,
    Mapping,
    Optional,
    Sequence,
    Tuple,
    Union,
)

import pluggy
import torch

from tzrec_ops import hookspecs
from tzrec_ops.contract import (
    OPS,
    Availability,
    Backend,
    BackendError,
    ContractError,
    Supports,
    check_implementation,
)

__all__ = [
    "BACKEND_ENV",
    "AutomaticBackend",
    "Availability",
    "Backend",
    "BackendError",
    "FailedPlugin",
    "PluginLoadError",
    "Supports",
    "automatic_backend",
    "backends",
    "find_implementation",
    "get_backend",
    "get_registry",
    "reset_registry",
    "resolve_backend",
    "select_backend",
]

BACKEND_ENV = "TZREC_OPS_BACKEND"
STRICT_PLUGINS_ENV = "TZREC_OPS_STRICT_PLUGINS"


class PluginLoadError(RuntimeError):
    """A plugin failed to load or breaks the op contract (raised only in strict mode or on
    a registry conflict)."""


class AutomaticBackend(Backend):
    """A :class:`Backend` record that stands for automatic selection.

    Passed as ``backend=`` to an op, it is treated as ``backend=None``: the call consults
    ``TZREC_OPS_BACKEND`` and then picks, per call, the available backend of highest priority
    that accepts it (its device, dtype and options), eagerly cached and traceable like any
    ``None`` request. Its own fields only describe it (for error messages, reports and
    checks such as ``rejection``); they never pick the implementation. It is never
    registered, so its name does not shadow a backend's.
    """


@dataclasses.dataclass(frozen=True)
class FailedPlugin:
    """A plugin entry point that could not be loaded or whose hook raised."""

    entry_point: str
    target: str
    distribution: str
    version: str
    error: str

    def describe(self) -> str:
        return (
            f"plugin {self.entry_point!r} ({self.target}) from distribution "
            f"{self.distribution} {self.version}: {self.error}"
        )


@dataclasses.dataclass
class Registry:
    """The discovered backends and the plugins that failed to load."""

    backends: Dict[str, Backend]
    failed_plugins: List[FailedPlugin]
    plugin_manager: pluggy.PluginManager
    origins: Dict[str, str]  # backend name -> "distribution version"
    # (backend, op) -> None if its implementation matches the declaration, else the mismatch
    contract_checks: Dict[Tuple[str, str], Optional[str]] = dataclasses.field(default_factory=dict)

    def ordered(self) -> List[Backend]:
        """Backends by descending priority, then name."""
        return sorted(self.backends.values(), key=lambda b: (-b.priority, b.name))


_REGISTRY: Optional[Registry] = None
_LOCK = threading.Lock()


def _strict() -> bool:
    return os.environ.get(STRICT_PLUGINS_ENV, "").lower() in ("1", "true", "yes")


def _entry_points() -> Iterable[importlib.metadata.EntryPoint]:
    return importlib.metadata.entry_points(group=hookspecs.PROJECT_NAME)


def _origin(ep: importlib.metadata.EntryPoint) -> Tuple[str, str]:
    dist = getattr(ep, "dist", None)
    if dist is None:
        return "<unknown distribution>", "<unknown version>"
    return dist.metadata["Name"] or "<unknown distribution>", dist.version


def _record_failure(failed: List[FailedPlugin], failure: FailedPlugin, exc: BaseException) -> None:
    if _strict():
        raise PluginLoadError(
            f"failed to load tzrec_ops {failure.describe()} ({STRICT_PLUGINS_ENV} is set)"
        ) from exc
    warnings.warn(f"skipping tzrec_ops {failure.describe()}", RuntimeWarning, stacklevel=4)
    failed.append(failure)


def build_registry() -> Registry:
    """Discover plugins and collect their backends (does not touch the cached registry)."""
    pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
    pm.add_hookspecs(hookspecs)
    failed: List[FailedPlugin] = []
    plugin_origin: Dict[str, Tuple[str, str]] = {}
    for ep in _entry_points():
        dist, version = _origin(ep)
        if pm.has_plugin(ep.name) or pm.is_blocked(ep.name):
            continue
        try:
            pm.register(ep.load(), name=ep.name)
            plugin_origin[ep.name] = (dist, version)
        except Exception as exc:
            _record_failure(failed, FailedPlugin(ep.name, ep.value, dist, version, repr(exc)), exc)

    backends: Dict[str, Backend] = {}
    origins: Dict[str, str] = {}
    for impl in pm.hook.tzrec_ops_register_backends.get_hookimpls():
        dist, version = plugin_origin.get(impl.plugin_name, ("<unknown distribution>", ""))
        try:
            records = list(impl.function() or [])
            for record in records:
                if not isinstance(record, Backend):
                    raise TypeError(
                        f"tzrec_ops_register_backends must return Backend records, "
                        f"got {type(record).__name__}"
                    )
        except Exception as exc:
            target = getattr(impl.plugin, "__name__", impl.plugin_name)
            _record_failure(
                failed, FailedPlugin(impl.plugin_name, target, dist, version, repr(exc)), exc
            )
            continue
        for record in records:
            origin = f"{dist} {version}".strip()
            if record.name in backends:
                raise PluginLoadError(
                    f"two backends are named {record.name!r}: one from {origins[record.name]}, "
                    f"one from {origin}; backend names must be unique"
                )
            backends[record.name] = record
            origins[record.name] = origin
    return Registry(backends, failed, pm, origins)


def get_registry() -> Registry:
    """The process-wide registry, built on first use."""
    global _REGISTRY
    if _REGISTRY is None:
        with _LOCK:
            if _REGISTRY is None:
                _REGISTRY = build_registry()
    return _REGISTRY


def reset_registry() -> None:
    """Forget the discovered plugins and the cached choices; the next lookup discovers them
    again."""
    global _REGISTRY
    with _LOCK:
        _REGISTRY = None
        _EAGER_CHOICES.clear()
        for key in [k for k in vars(_Chosen) if ":" in k]:
            delattr(_Chosen, key)


def backends() -> List[Backend]:
    """All registered backends, highest priority first."""
    return get_registry().ordered()


def get_backend(name: str) -> Backend:
    """The backend registered under ``name`` (it may be unavailable on this machine)."""
    registry = get_registry()
    if name not in registry.backends:
        known = ", ".join(sorted(registry.backends)) or "none"
        failed = "".join(f"\n  failed {f.describe()}" for f in registry.failed_plugins)
        raise BackendError(f"unknown backend {name!r}; registered backends: {known}{failed}")
    return registry.backends[name]


def _env_request(op: str) -> Optional[str]:
    value = os.environ.get(BACKEND_ENV, "").strip()
    if not value:
        return None
    if "=" not in value:
        return value
    request = None
    for item in value.split(","):
        key, sep, name = (part.strip() for part in item.partition("="))
        if not (sep and key and name):
            raise BackendError(
                f"{BACKEND_ENV}={value!r}: item {item.strip()!r} is malformed, expected "
                f"'op=backend' items separated by commas, or one backend name"
            )
        if key == op:
            request = name
    return request


def _describe_call(call: Mapping[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in call.items())


def select_backend(
    op: str, backend: Union[str, Backend, None] = None, **call: Any
) -> Callable[..., Any]:
    """Choose the backend for one call of ``op`` and return its implementation.

    Args:
        op: the public op name, e.g. ``"hstu_mha"``.
        backend: an explicit request (name or record); ``None`` (or an
            :class:`AutomaticBackend` record) consults ``TZREC_OPS_BACKEND`` and then
            priorities.
        **call: what the backends' ``supports`` checks see: ``device``, ``dtype`` and the
            op's options (plain Python values).

    Under ``torch.compile``/``torch.export`` the choice is made once, while tracing, and is
    baked into the graph: changing ``TZREC_OPS_BACKEND`` later needs a recompile.

    Raises:
        BackendError: the requested backend is unknown or rejects the call, or no backend
            can run it. The message lists every candidate with its reason.
    """
    if isinstance(backend, AutomaticBackend):
        backend = None
    if torch.compiler.is_compiling():
        key = _selection_key(op, _request_name(backend), tuple(call.items()), False)
        return getattr(_Chosen, key)
    return _eager_choice(op, backend, call, False)


def find_implementation(
    op: str, backend: Union[str, Backend, None] = None, **call: Any
) -> Optional[Callable[..., Any]]:
    """Like :func:`select_backend`, but ``None`` where it would raise :class:`BackendError`.

    For optional fast paths (e.g. a fused op) whose absence leads to a general path.
    """
    if isinstance(backend, AutomaticBackend):
        backend = None
    if torch.compiler.is_compiling():
        key = _selection_key(op, _request_name(backend), tuple(call.items()), True)
        return getattr(_Chosen, key) if key else None
    return _eager_choice(op, backend, call, True)


def _request_name(backend: Union[str, Backend, None]) -> Optional[str]:
    # a traced graph refers to the registered backend of that name (the record is not a
    # constant dynamo can key a guard on)
    return backend.name if isinstance(backend, Backend) else backend


# Eager choices: key -> (the request, its implementation or None). The request is kept so
# that the id() of a Backend record in the key cannot be reused by another record.
_EAGER_CHOICES: Dict[Hashable, Tuple[Union[str, Backend, None], Optional[Callable[..., Any]]]] = {}
_MAX_EAGER_CHOICES = 4096  # a bound for callers that build a new Backend record per call


def _eager_choice(
    op: str, backend: Union[str, Backend, None], call: Mapping[str, Any], optional: bool
) -> Optional[Callable[..., Any]]:
    """The implementation for an eager call, chosen once per distinct call (cached).

    A failed choice is not cached: the error path re-runs and reports the current state.
    The ``TZREC_OPS_BACKEND`` value is part of the key, so changing it is seen at once.
    """
    request = ("record", backend.name, id(backend)) if isinstance(backend, Backend) else backend
    key: Optional[Hashable] = (
        op,
        request,
        optional,
        tuple(call.items()),
        os.environ.get(BACKEND_ENV),
    )
    try:
        return _EAGER_CHOICES[key][1]
    except KeyError:
        pass
    except TypeError:  # an unhashable option value: choose without caching
        key = None
    try:
        impl: Optional[Callable[..., Any]] = _choose(op, backend, call).implementation(op)
    except BackendError:
        if not optional:
            raise
        impl = None  # cached: a missing fast path must not cost a full search per call
    if key is not None:
        if len(_EAGER_CHOICES) >= _MAX_EAGER_CHOICES:
            _EAGER_CHOICES.clear()
        _EAGER_CHOICES[key] = (backend, impl)
    return impl


class _Chosen:
    """Implementations chosen while tracing, as attributes named "backend:op".

    Tracing sees only an attribute lookup here: the choice itself runs eagerly
    (assume_constant_result), so plugin discovery and imports never happen inside a traced
    graph. Attributes rather than a dict, because dynamo snapshots a dict the first time a
    frame reads it and would miss implementations chosen later in the same frame.
    """


def assume_constant_result(fn: Callable[..., Any]) -> Callable[..., Any]:
    """:func:`torch.compiler.assume_constant_result`, without importing ``torch._dynamo``.

    The public decorator imports dynamo (about 3 s) only to set a marker attribute, which
    dynamo reads when it meets the function; that import is deferred here until torch.compile
    or torch.export loads dynamo anyway. ``test_registry`` checks that the marker is still the
    one the public decorator sets.
    """
    if "torch._dynamo" in sys.modules:
        return torch.compiler.assume_constant_result(fn)
    fn._dynamo_marked_constant = True  # type: ignore[attr-defined]
    return fn


@assume_constant_result
def _selection_key(
    op: str, backend: Optional[str], call_items: Tuple[Tuple[str, Any], ...], optional: bool
) -> str:
    """Choose eagerly; return the key of the chosen implementation ("" if optional and none)."""
    try:
        record = _choose(op, backend, dict(call_items))
    except BackendError:
        if optional:
            return ""
        raise
    key = f"{record.name}:{op}"
    setattr(_Chosen, key, record.implementation(op))
    return key


def _choose(op: str, backend: Union[str, Backend, None], call: Mapping[str, Any]) -> Backend:
    source = "backend="
    if backend is None:
        backend = _env_request(op)
        source = BACKEND_ENV
    if backend is not None:
        record = backend if isinstance(backend, Backend) else get_backend(backend)
        reason = record.rejection(op, call)
        if reason is None:
            reason = _contract_rejection(record, op)
        if reason is None:
            return record
        raise BackendError(
            f"backend {record.name!r} (requested by {source}) cannot run {op}: {reason}\n"
            f"call: {_describe_call(call)}\n"
            f"candidates:{_candidate_report(op, call)}"
        )
    record = _automatic_choice(op, call)
    if record is not None:
        return record
    raise BackendError(
        f"no backend can run {op}\ncall: {_describe_call(call)}\n"
        f"candidates:{_candidate_report(op, call)}"
    )


def _automatic_choice(op: str, call: Mapping[str, Any]) -> Optional[Backend]:
    """The backend of highest priority that automatic selection may pick for this call."""
    for record in backends():
        if (
            record.rejection(op, call) is None
            and record.automatic() is None
            and _contract_rejection(record, op) is None
        ):
            return record
    return None


def _automatic_rejection(op: str, call: Mapping[str, Any]) -> Optional[str]:
    """An :class:`AutomaticBackend`'s ``supports``: ``None`` if automatic selection can run
    the call, else every candidate's reason (module level, so the record pickles)."""
    if _automatic_choice(op, call) is not None:
        return None
    return f"no backend that is picked automatically accepts it:{_candidate_report(op, call)}"


def automatic_backend(ops: Sequence[str]) -> AutomaticBackend:
    """The record of automatic selection for a caller of ``ops`` (e.g. a module that was
    given no backend): passed as ``backend=``, each call chooses as for ``backend=None``.

    Its ``ops`` are those the automatically picked backends implement, and its
    ``rejection`` says whether automatic selection can run a call.

    Raises:
        BackendError: no available backend that may be picked automatically (never the
            Triton CPU interpreter) implements all of ``ops``.
    """
    candidates = [
        record
        for record in backends()
        if record.unavailable_reason() is None and record.automatic() is None
    ]
    if not any(all(op in record.ops for op in ops) for record in candidates):
        raise BackendError(f"no available backend implements all of {', '.join(ops)}")
    implemented: Dict[str, str] = {}
    for record in reversed(candidates):  # the highest priority's entry last, so it stays
        implemented.update(record.ops)
    return AutomaticBackend(
        name="automatic",
        priority=0,
        ops=implemented,
        supports=_automatic_rejection,
        description="per call, the available backend of highest priority that accepts it",
    )


def _contract_rejection(record: Backend, op: str) -> Optional[str]:
    """Why a registered backend's implementation of a declared ``op`` cannot be called as
    declared, or ``None``; checked once per registry (importing the implementation).

    A mismatch is a broken plugin: a warning, or :class:`PluginLoadError` under
    ``TZREC_OPS_STRICT_PLUGINS``. Records that are not registered (passed as ``backend=``)
    and undeclared ops are not checked.
    """
    registry = get_registry()
    if op not in OPS or registry.backends.get(record.name) is not record:
        return None
    key = (record.name, op)
    if key not in registry.contract_checks:
        try:
            check_implementation(OPS[op], record.implementation(op), backend=record.name)
            reason = None
        except ContractError as exc:
            origin = registry.origins.get(record.name, "")
            if _strict():
                raise PluginLoadError(
                    f"tzrec_ops backend {record.name!r} from {origin} breaks the op contract: "
                    f"{exc} ({STRICT_PLUGINS_ENV} is set)"
                ) from exc
            warnings.warn(
                f"skipping {op} of tzrec_ops backend {record.name!r} from {origin}: {exc}",
                RuntimeWarning,
                stacklevel=2,
            )
            reason = f"its implementation does not match the contract: {exc}"
        registry.contract_checks[key] = reason
    return registry.contract_checks[key]


def _candidate_report(op: str, call: Mapping[str, Any]) -> str:
    lines = []
    checked = get_registry().contract_checks
    for record in backends():
        # a mismatch found earlier; the report imports no implementation to look for one
        reason = checked.get((record.name, op))
        if reason is None:
            reason = record.rejection(op, call)
        if reason is None and record.automatic() is not None:
            reason = f"accepts this call when requested explicitly ({record.automatic()})"
        lines.append(f"\n  {record.name}: {'accepts this call' if reason is None else reason}")
    for failure in get_registry().failed_plugins:
        lines.append(f"\n  (not loaded) {failure.describe()}")
    return "".join(lines) or "\n  (no backends registered)"


def resolve_backend(backend: Union[str, Backend, None] = None, op: Optional[str] = None) -> Backend:
    """Resolve a backend once, e.g. in a module constructor.

    ``None`` gives the ``TZREC_OPS_BACKEND`` choice, else the highest-priority available
    backend (implementing ``op`` when given). The returned record can be passed as
    ``backend=`` to every op call, which then does no environment or plugin lookup.
    """
    if isinstance(backend, Backend):
        return backend
    name = backend if backend is not None else _env_request(op or "")
    if name is not None:
        record = get_backend(name)
        reason = record.unavailable_reason()
        if reason is not None:
            raise BackendError(f"backend {name!r} is unavailable: {reason}")
        return record
    for record in backends():
        usable = record.unavailable_reason() is None and record.automatic() is None
        if usable and (op is None or op in record.ops):
            return record
    raise BackendError(f"no available backend{'' if op is None else ' implements ' + op}")


def autotune_configs(kernel: str, device: torch.device) -> List[Any]:
    """Every plugin's extra autotune configs for ``kernel`` on ``device``."""
    configs: List[Any] = []
    for answer in get_registry().plugin_manager.hook.tzrec_ops_autotune_configs(
        kernel=kernel, device=device
    ):
        if answer:
            configs.extend(answer)
    return configs
