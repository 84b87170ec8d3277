"""tzrec-ops: HSTU generative-recommender kernels with pluggable backends.

Every public op takes ``backend=`` (a name or a :class:`~tzrec_ops.registry.Backend`);
see :mod:`tzrec_ops.registry` for how a backend is chosen when it is omitted.
"""

from tzrec_ops.hookspecs import hookimpl
from tzrec_ops.registry import Backend, BackendError, backends, get_backend, resolve_backend

__version__ = "0.1.0"

__all__ = [
    "Backend",
    "BackendError",
    "backends",
    "get_backend",
    "hookimpl",
    "resolve_backend",
]
