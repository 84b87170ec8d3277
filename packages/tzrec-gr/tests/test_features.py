"""The feature schema: its keys are a data format and must never change."""

from __future__ import annotations

from tzrec_gr import features


def test_the_keys_are_the_stored_strings():
    assert (features.HISTORY, features.CANDIDATE) == ("uih", "candidate")
    assert (features.CONTEXTUAL, features.QUERY_TIME) == ("contextual", "query_time")
    assert [
        features.UIH_ITEM_ID,
        features.UIH_SEQUENCE,
        features.UIH_LENGTHS,
        features.UIH_ACTIONS,
        features.UIH_TIMESTAMPS,
        features.UIH_WATCHTIMES,
        features.CANDIDATE_ITEM_ID,
        features.CANDIDATE_SEQUENCE,
        features.CANDIDATE_LENGTHS,
        features.CANDIDATE_TIMESTAMPS,
    ] == [
        "uih.item_id",
        "uih.sequence",
        "uih.sequence_length",
        "uih_action.sequence",
        "uih_timestamp.sequence",
        "uih_watchtime.sequence",
        "candidate.item_id",
        "candidate.sequence",
        "candidate.sequence_length",
        "candidate_timestamp.sequence",
    ]


def test_a_named_group_gets_the_same_key_shapes():
    assert features.sequence_key("user") == "user.sequence"
    assert features.lengths_key("user") == "user.sequence_length"
    assert features.timestamps_key("user") == "user_timestamp.sequence"
    assert features.actions_key("user") == "user_action.sequence"
    assert features.watchtimes_key("user") == "user_watchtime.sequence"
    assert features.item_id_key("user") == "user.item_id"
