"""The plugin hooks of tzrec-ops (the ops each backend may implement are declared in
:mod:`tzrec_ops.contract`).

A backend plugin is a plain module that implements one or both hooks below with
``@tzrec_ops.hookimpl`` and is announced by an entry point in the ``tzrec_ops`` group::

    [project.entry-points.tzrec_ops]
    acme = "tzrec_ops_acme.plugin"

The built-in backends (``pytorch``, ``triton``, ``triton_tma``) and the ROCm autotune
configs are registered through tzrec-ops' own entry points in exactly this way.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, List, Optional

import pluggy

if TYPE_CHECKING:
    import torch

    from tzrec_ops.contract import Backend

PROJECT_NAME = "tzrec_ops"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


# -- backends ----------------------------------------------------------------------------


@hookspec
def tzrec_ops_register_backends() -> List["Backend"]:
    """Announce the backends a plugin provides.

    Called once, when the registry is first built (lazily, on the first op call, on
    ``python -m tzrec_ops info`` or on ``tzrec_ops.registry.backends()``).

    Returns:
        A list of :class:`tzrec_ops.contract.Backend` records (also importable as
        ``tzrec_ops.Backend``). Each record names the ops it implements as
        ``"module:function"`` strings, so that announcing a backend imports none of its
        kernels; each function takes its op's declared arguments by keyword
        (:data:`tzrec_ops.contract.OPS`), and its parameters are checked against them when
        it is first chosen (:func:`tzrec_ops.contract.check_implementation`). Backend names
        must be unique across all plugins; a duplicate is an error.
    """


# -- autotuning --------------------------------------------------------------------------


@hookspec
def tzrec_ops_autotune_configs(kernel: str, device: "torch.device") -> Optional[List[Any]]:
    """Offer extra autotune configurations for a kernel on a device.

    Called when a Triton kernel builds its autotuner for ``device`` (once per kernel and
    device). Every plugin's answer is collected; ``None`` means "nothing to add".

    Args:
        kernel: the kernel's stable name, e.g. ``"hstu_attention_fwd"`` or ``"addmm"``.
        device: the device the kernel will run on. ROCm devices report ``type == "cuda"``;
            check ``torch.version.hip`` to tell them apart.

    Returns:
        A list of ``triton.Config`` objects, or ``None``.
    """
