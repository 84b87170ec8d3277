"""Optional adapters from torchrec inputs to the plain-tensor features of tzrec-gr.

torchrec is imported lazily; without it these functions raise ImportError naming the
``tzrec-gr[torchrec]`` extra. The only other use of torchrec in tzrec-gr is the torchrec
id table of :mod:`tzrec_gr.embeddings`.
"""

from __future__ import annotations

from typing import Any, Dict, Mapping

import torch

from tzrec_gr.features import lengths_key, sequence_key
from tzrec_ops.extras import require

__all__ = ["features_from_jagged_tensors", "features_from_kjt"]


def _require_torchrec() -> Any:
    jagged = require("torchrec.sparse.jagged_tensor", "tzrec-gr[torchrec]", "torchrec inputs")
    return jagged.JaggedTensor, jagged.KeyedJaggedTensor


def features_from_jagged_tensors(groups: Mapping[str, Any]) -> Dict[str, torch.Tensor]:
    """``{"uih": JaggedTensor, ...}`` -> ``{"uih.sequence": values, "uih.sequence_length":
    lengths, ...}``; plain tensors (e.g. dense ``contextual``) pass through unchanged.

    Args:
        groups (Mapping[str, JaggedTensor | torch.Tensor]): one entry per feature group.

    Returns:
        Dict[str, torch.Tensor]: the features of :mod:`tzrec_gr.preprocessors`.
    """
    jagged_cls, _ = _require_torchrec()
    out: Dict[str, torch.Tensor] = {}
    for name, value in groups.items():
        if isinstance(value, jagged_cls):
            out[sequence_key(name)] = value.values()
            out[lengths_key(name)] = value.lengths()
        elif isinstance(value, torch.Tensor):
            out[name] = value
        else:
            raise TypeError(
                f"feature group {name!r} must be a JaggedTensor or a torch.Tensor, "
                f"got {type(value).__name__}"
            )
    return out


def features_from_kjt(kjt: Any) -> Dict[str, torch.Tensor]:
    """A KeyedJaggedTensor of 1-D sequences (one key per group, e.g. ``uih_timestamp``)
    -> ``{"<key>.sequence": values [L], "<key>.sequence_length": lengths [B]}``."""
    _, kjt_cls = _require_torchrec()
    if not isinstance(kjt, kjt_cls):
        raise TypeError(f"kjt must be a KeyedJaggedTensor, got {type(kjt).__name__}")
    return features_from_jagged_tensors(kjt.to_dict())
