"""The action bits of an event's bitmask (``SequenceDataset.actions``).

The bits follow KuaiRand's feedback columns in the order of the tzrec KuaiRand benchmark
config, so a model's action encoder can be given ``[int(a) for a in Action]`` as its weights.
"""

from __future__ import annotations

import enum


class Action(enum.IntFlag):
    """One bit per kind of feedback; an event's mask ORs the ones that happened."""

    CLICK = 1
    LIKE = 2
    FOLLOW = 4
    COMMENT = 8
    FORWARD = 16
    HATE = 32
    LONG_VIEW = 64
    PROFILE_ENTER = 128
