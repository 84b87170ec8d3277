"""The conformance suite (:mod:`tzrec_ops.testing.conformance_suite`) on the built-in
``pytorch`` backend, on the CPU. The Triton backends run it on a GPU:
``pytest packages/tzrec-ops/tests --tzrec-backend triton --tzrec-backend triton_tma``.
"""

from tzrec_ops.testing.conformance_suite import *  # noqa: F401,F403

CONFORMANCE_BACKENDS = ("pytorch",)
