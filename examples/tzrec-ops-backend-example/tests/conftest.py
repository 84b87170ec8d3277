# `pytest --tzrec-backend compiled` adds tzrec-ops' conformance suite for this backend
pytest_plugins = ["tzrec_ops.testing.conformance"]
