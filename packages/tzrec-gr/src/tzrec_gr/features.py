"""The feature schema: the keys of the feature dicts the preprocessors and models read.

Legend: B = batch, L_u / L_t = total history / candidate tokens, D = embedding width,
C = contextual features, Fc = width of each.

A feature group (the user interaction history ``"uih"``, the candidates ``"candidate"``) is a
jagged sequence; its keys are built from the group name by the functions below, and the
constants are those keys for the two standard groups. The strings are part of the data
format (saved batches, exported programs' input names, torchrec feature names): they never
change, so code names them through this module rather than spelling them out.

- ``uih.item_id`` (:data:`UIH_ITEM_ID`): [L_u] integer item ids;
- ``uih.sequence`` (:data:`UIH_SEQUENCE`): [L_u, D] their embeddings;
- ``uih.sequence_length`` (:data:`UIH_LENGTHS`): [B] events per user;
- ``uih_action.sequence`` (:data:`UIH_ACTIONS`): [L_u] integer action bitmasks;
- ``uih_timestamp.sequence`` (:data:`UIH_TIMESTAMPS`): [L_u] integer timestamps;
- ``uih_watchtime.sequence`` (:data:`UIH_WATCHTIMES`): [L_u] watch times;
- ``candidate.item_id``, ``candidate.sequence``, ``candidate.sequence_length``,
  ``candidate_timestamp.sequence`` (:data:`CANDIDATE_ITEM_ID`, :data:`CANDIDATE_SEQUENCE`,
  :data:`CANDIDATE_LENGTHS`, :data:`CANDIDATE_TIMESTAMPS`): the same for the [L_t]
  candidates;
- ``contextual`` (:data:`CONTEXTUAL`): [B, C * Fc] float contextual features;
- ``query_time`` (:data:`QUERY_TIME`): [B] integer request time, the time encoding's anchor.
"""

from __future__ import annotations

__all__ = [
    "CANDIDATE",
    "CANDIDATE_ITEM_ID",
    "CANDIDATE_LENGTHS",
    "CANDIDATE_SEQUENCE",
    "CANDIDATE_TIMESTAMPS",
    "CONTEXTUAL",
    "HISTORY",
    "QUERY_TIME",
    "UIH_ACTIONS",
    "UIH_ITEM_ID",
    "UIH_LENGTHS",
    "UIH_SEQUENCE",
    "UIH_TIMESTAMPS",
    "UIH_WATCHTIMES",
    "actions_key",
    "item_id_key",
    "lengths_key",
    "sequence_key",
    "timestamps_key",
    "watchtimes_key",
]

#: the group name of the user interaction history
HISTORY = "uih"
#: the group name of the candidates
CANDIDATE = "candidate"
#: [B, C * Fc] the users' contextual features
CONTEXTUAL = "contextual"
#: [B] the request time, the anchor of the time encoding
QUERY_TIME = "query_time"


def item_id_key(group: str) -> str:
    """The key of a group's integer item ids, e.g. ``"uih.item_id"``."""
    return f"{group}.item_id"


def sequence_key(group: str) -> str:
    """The key of a group's token embeddings, e.g. ``"uih.sequence"``."""
    return f"{group}.sequence"


def lengths_key(group: str) -> str:
    """The key of a group's [B] lengths, e.g. ``"uih.sequence_length"``."""
    return f"{group}.sequence_length"


def timestamps_key(group: str) -> str:
    """The key of a group's timestamps, e.g. ``"uih_timestamp.sequence"``."""
    return f"{group}_timestamp.sequence"


def actions_key(group: str) -> str:
    """The key of a group's action bitmasks, e.g. ``"uih_action.sequence"``."""
    return f"{group}_action.sequence"


def watchtimes_key(group: str) -> str:
    """The key of a group's watch times, e.g. ``"uih_watchtime.sequence"``."""
    return f"{group}_watchtime.sequence"


UIH_ITEM_ID = item_id_key(HISTORY)
UIH_SEQUENCE = sequence_key(HISTORY)
UIH_LENGTHS = lengths_key(HISTORY)
UIH_ACTIONS = actions_key(HISTORY)
UIH_TIMESTAMPS = timestamps_key(HISTORY)
UIH_WATCHTIMES = watchtimes_key(HISTORY)
CANDIDATE_ITEM_ID = item_id_key(CANDIDATE)
CANDIDATE_SEQUENCE = sequence_key(CANDIDATE)
CANDIDATE_LENGTHS = lengths_key(CANDIDATE)
CANDIDATE_TIMESTAMPS = timestamps_key(CANDIDATE)
