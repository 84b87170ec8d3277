"""Optional dependencies: imported only by the feature that needs them."""

from __future__ import annotations

import importlib
from types import ModuleType


def require(module: str, extra: str, feature: str) -> ModuleType:
    """Import ``module`` for ``feature``, or raise an ImportError naming what to install.

    Args:
        module: the import name, e.g. ``"torch_tensorrt"``.
        extra: the requirement that provides it, e.g. ``"tzrec-acc[tensorrt]"``.
        feature: what needs it, in words, for the message.
    """
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ImportError(
            f"{feature} needs the optional dependency {module}, which is not installed: "
            f"pip install '{extra}'",
            name=module,
        ) from exc
