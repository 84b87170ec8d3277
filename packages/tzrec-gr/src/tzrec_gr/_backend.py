"""Resolve the ops backend once per module, in its constructor.

Modules call :func:`resolve_module_backend` in ``__init__`` and pass the returned record as
``backend=`` to every op call, so ``forward`` does no environment or plugin lookup of its
own and stays traceable.

- A named backend (the ``backend`` argument, or ``TZREC_OPS_BACKEND`` set to one name when
  the module is built) is the registered record: every op call runs on it, and a call it
  cannot run (e.g. CPU tensors on ``triton``) raises the registry's error listing the
  candidates. It never falls back.
- Otherwise the module holds an :class:`~tzrec_ops.registry.AutomaticBackend` named
  ``"automatic"``: each op call chooses as an op called with ``backend=None`` does, from the
  call itself (device, dtype, options), so a module built without a backend runs wherever
  its tensors are (the pytorch backend on the CPU, triton after ``model.cuda()``). The
  registry caches that choice per call signature and makes it once while tracing, so
  ``forward`` stays traceable and a repeated eager call costs a dict lookup. Such calls read
  ``TZREC_OPS_BACKEND`` as op calls do: a per-op value (``hstu_mha=triton,...``) applies to
  the ops it names (an explicit request, with its error when it cannot run the call), and
  a value set after the module was built applies from then on.
"""

from __future__ import annotations

import os
from typing import Any, Dict, Mapping, Optional, Sequence, Union

from tzrec_ops.registry import (
    BACKEND_ENV,
    AutomaticBackend,
    Backend,
    BackendError,
    backends,
    resolve_backend,
)

BackendArg = Union[str, Backend, None]

AUTOMATIC = "automatic"


def resolve_module_backend(backend: BackendArg, ops: Sequence[str]) -> Backend:
    """The backend record a module passes to every op it calls.

    Args:
        backend (str | Backend | None): an explicit backend, or ``None``: the
            ``TZREC_OPS_BACKEND`` choice if it is a single name, else automatic selection
            per op call (see the module docstring).
        ops (Sequence[str]): the op names the module calls.

    Returns:
        Backend: the named backend's record, or an
        :class:`~tzrec_ops.registry.AutomaticBackend` named ``"automatic"`` that op calls
        treat as ``backend=None``.

    Raises:
        ValueError: the requested backend does not implement one of ``ops``.
        tzrec_ops.registry.BackendError: the backend is unknown or unavailable, or (for
            ``None``) no available backend that may be picked automatically (never the
            Triton CPU interpreter) implements all of ``ops``.
    """
    env = os.environ.get(BACKEND_ENV, "").strip()
    if backend is None and (not env or "=" in env):
        return _automatic_backend(ops)
    record = resolve_backend(backend)
    missing = [op for op in ops if op not in record.ops]
    if missing:
        raise ValueError(
            f"backend {record.name!r} does not implement {', '.join(missing)}, "
            "which this module needs; choose another backend or backend=None"
        )
    return record


def _automatic_backend(ops: Sequence[str]) -> AutomaticBackend:
    """The record of automatic selection, for a module that calls ``ops``."""
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
        name=AUTOMATIC,
        priority=0,
        ops=implemented,
        supports=_automatic_rejection,
        description="per call, the available backend of highest priority that accepts it",
    )


def _automatic_rejection(op: str, call: Mapping[str, Any]) -> Optional[str]:
    """``None`` if some backend that automatic selection may pick accepts ``call``, else why
    not (module level, so that a module holding the record pickles)."""
    reasons = []
    for record in backends():
        reason = record.rejection(op, call)
        if reason is None:
            reason = record.automatic()
            if reason is None:
                return None
            reason = f"not picked automatically: {reason}"
        reasons.append(f"{record.name}: {reason}")
    return f"no backend that is picked automatically accepts it ({'; '.join(reasons)})"
