"""Input preprocessors: turn grouped features into one jagged token sequence per sample.

Legend: B = batch, L_u / L_t = total history (UIH) / candidate tokens, Du / Dt their
embedding widths, E = output width, C = contextual prefix tokens, Fc = width of one
contextual feature, U_b / T_b = history / candidate tokens of sample b.

Features are a plain ``Dict[str, torch.Tensor]`` (use :mod:`tzrec_gr.torchrec_adapters` for
torchrec inputs). With ``name = "uih"`` the keys are (:mod:`tzrec_gr.features` names them):

=============================== ===================== =====================================
key                             shape                 meaning
=============================== ===================== =====================================
``uih.sequence``                [L_u, Du] float       history item embeddings
``uih.sequence_length``         [B] int               U_b
``uih_timestamp.sequence``      [L_u] int             history timestamps (seconds)
``uih_action.sequence``         [L_u] int             action bitmask (with an action encoder)
``uih_watchtime.sequence``      [L_u] int             watch time (with watch-time actions)
``candidate.sequence``          [L_t, Dt] float       candidate item embeddings
``candidate.sequence_length``   [B] int               T_b (= num_targets)
``candidate_timestamp.sequence`` [L_t] int            candidate timestamps
``contextual``                  [B, C * Fc] float     contextual features (C > 0)
=============================== ===================== =====================================

Sizes are never read from the device: the caller passes upper bounds ``max_uih_len`` and
``max_targets``; totals come from tensor shapes.

Output sequence of sample b: ``[C contextual tokens | U_b history | T_b candidates]``
(with interleaving, each history token becomes a (content, action) pair; in training the
candidates too).

:mod:`~tzrec_gr.preprocessors.base` holds the output, the interface and the contextual
prefix both preprocessors share; :mod:`~tzrec_gr.preprocessors.contextual_interleave` and
:mod:`~tzrec_gr.preprocessors.uih` hold one preprocessor each.
"""

from tzrec_gr.preprocessors.base import (
    ContextualProjection,
    InputPreprocessor,
    PreprocessorOutput,
)
from tzrec_gr.preprocessors.contextual_interleave import ContextualInterleavePreprocessor
from tzrec_gr.preprocessors.uih import UIHPreprocessor

__all__ = [
    "PreprocessorOutput",
    "InputPreprocessor",
    "ContextualProjection",
    "ContextualInterleavePreprocessor",
    "UIHPreprocessor",
]
