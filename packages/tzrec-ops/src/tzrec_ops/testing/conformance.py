"""pytest plugin: the tzrec-ops conformance suite for a backend, with one line of configuration.

In the backend package's top-level ``conftest.py``::

    pytest_plugins = ["tzrec_ops.testing.conformance"]

then ``pytest --tzrec-backend NAME`` (repeatable) adds :mod:`.conformance_suite` to the run for
backend NAME; ``--tzrec-device cuda`` picks the device (default: CUDA when available, else the
CPU). Without ``--tzrec-backend`` nothing is added. Importing this module imports only pytest's
hooks, no torch.
"""

from __future__ import annotations

import pathlib
from typing import Any

SUITE = pathlib.Path(__file__).with_name("conformance_suite.py")


def pytest_addoption(parser: Any) -> None:
    group = parser.getgroup("tzrec-ops", "tzrec-ops backend conformance")
    group.addoption(
        "--tzrec-backend",
        action="append",
        default=[],
        metavar="NAME",
        help="run the tzrec-ops conformance suite against backend NAME (repeatable)",
    )
    group.addoption(
        "--tzrec-device",
        default=None,
        metavar="DEVICE",
        help="device of the conformance suite's tensors (default: cuda if available, else cpu)",
    )


def pytest_configure(config: Any) -> None:
    if config.getoption("tzrec_backend") and str(SUITE) not in config.args:
        config.args.append(str(SUITE))
