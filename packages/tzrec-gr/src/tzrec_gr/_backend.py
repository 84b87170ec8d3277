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
from typing import Sequence, Union

from tzrec_ops.registry import BACKEND_ENV, Backend, automatic_backend, resolve_backend

BackendArg = Union[str, Backend, None]


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
        return automatic_backend(ops)
    record = resolve_backend(backend)
    missing = [op for op in ops if op not in record.ops]
    if missing:
        raise ValueError(
            f"backend {record.name!r} does not implement {', '.join(missing)}, "
            "which this module needs; choose another backend or backend=None"
        )
    return record
