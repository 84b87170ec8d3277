"""Optional dependencies: imported only by the feature that needs them.

Every tzrec package takes its optional dependencies (triton, torchrec, torch-tensorrt,
matplotlib, tzrec-gr for tzrec-acc, ...) through :func:`require`, so a missing one always
fails the same way: an ``ImportError`` that names the feature, the module and the
requirement to install::

    trt = require("torch_tensorrt", "tzrec-acc[tensorrt]", "TensorRT compilation")
"""

from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["require"]


def require(module: str, extra: str, feature: str) -> ModuleType:
    """Import ``module`` for ``feature``, or raise an ImportError naming what to install.

    Args:
        module: the import name, e.g. ``"torch_tensorrt"``.
        extra: the requirement that provides it, e.g. ``"tzrec-acc[tensorrt]"``.
        feature: what needs it, in words, for the message.

    Returns:
        The imported module.

    Raises:
        ImportError: ``module`` cannot be imported; the message reads ``"{feature} needs the
            optional dependency {module}, which is not installed: pip install '{extra}'"`` and
            ``name`` is ``module``.
    """
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ImportError(
            f"{feature} needs the optional dependency {module}, which is not installed: "
            f"pip install '{extra}'",
            name=module,
        ) from exc
