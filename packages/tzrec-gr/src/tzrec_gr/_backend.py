"""Resolve the ops backend once per module, in its constructor.

Modules call :func:`resolve_module_backend` in ``__init__`` and pass the returned record as
``backend=`` to every op call, so ``forward`` does no environment or plugin lookup and stays
traceable. Because the record is passed explicitly, a per-op ``TZREC_OPS_BACKEND`` setting
(``hstu_mha=triton,...``) does not apply inside modules; a single name does.
"""

from __future__ import annotations

import os
from typing import Sequence, Union

from tzrec_ops.registry import BACKEND_ENV, Backend, BackendError, backends, resolve_backend

BackendArg = Union[str, Backend, None]


def resolve_module_backend(backend: BackendArg, ops: Sequence[str]) -> Backend:
    """The one backend a module uses for every op it calls.

    Args:
        backend (str | Backend | None): an explicit backend, or ``None`` for the
            ``TZREC_OPS_BACKEND`` choice (a single name), else the available backend of
            highest priority that implements every op in ``ops`` and may be picked
            automatically (never the Triton CPU interpreter).
        ops (Sequence[str]): the op names the module calls.

    Returns:
        Backend: the resolved record.

    Raises:
        ValueError: the requested backend does not implement one of ``ops``.
        tzrec_ops.registry.BackendError: the backend is unknown or unavailable, or no
            available backend implements all of ``ops``.
    """
    env = os.environ.get(BACKEND_ENV, "").strip()
    if backend is None and (not env or "=" in env):
        for record in backends():
            usable = record.unavailable_reason() is None and record.automatic() is None
            if usable and all(op in record.ops for op in ops):
                return record
        raise BackendError(f"no available backend implements all of {', '.join(ops)}")
    record = resolve_backend(backend)
    missing = [op for op in ops if op not in record.ops]
    if missing:
        raise ValueError(
            f"backend {record.name!r} does not implement {', '.join(missing)}, "
            "which this module needs; choose another backend or backend=None"
        )
    return record
