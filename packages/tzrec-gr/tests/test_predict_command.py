"""The one driver of the predict commands (:func:`tzrec_gr.serving.predict_command.run_predict`):
its header (the seen-items rule only where predictions are a top-k of the catalogue), the ids
line, users from a source other than ``--input``, and the exit status; and the columns a row
needs per kind (:attr:`Limits.extra_columns`)."""

from __future__ import annotations

import argparse
import csv
import types

import pytest

from tzrec_gr.models.registry import get_model
from tzrec_gr.serving import ServingSession
from tzrec_gr.serving.files import Limits, PredictError, add_predict_arguments, session_limits
from tzrec_gr.serving.predict_command import run_predict

SETTINGS = types.SimpleNamespace(
    embedding_dim=16, max_seq_len=12, num_heads=2, num_layers=1, dropout=0.0,
    num_negatives=4, temperature=0.05, num_candidates=3, backend=None,
)


def _session(name, bits=()):
    record = get_model(name)
    return ServingSession(record.model_class(**record.trainer_kwargs(SETTINGS, 50, bits)))


def _args(tmp_path, *options):
    parser = argparse.ArgumentParser()
    add_predict_arguments(parser, input_required=False)
    return parser.parse_args(["--output", str(tmp_path / "out.csv"), "--no-progress",
                              *map(str, options)])


def _run(session, args, **kwargs):
    return run_predict(session, session_limits(session), args, prog="tool predict",
                       title="a model", model_file="m.pt", batch_size=4, **kwargs)


def test_a_top_k_run_says_its_seen_rule_and_ids_then_writes(tmp_path, capsys):
    source = tmp_path / "users.jsonl"
    source.write_text('{"user_id": 7, "item_ids": [3, 5, 8], "timestamps": [1, 2, 3]}\n')
    assert _run(_session("hstu-retrieval"), _args(tmp_path, "--input", source, "--k", 3)) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == ("tool predict: a model; seen items excluded (--include-seen to rank "
                        "them too)")
    assert lines[1].startswith("note: m.pt holds no id vocabulary")
    assert lines[2].startswith(f"wrote {tmp_path / 'out.csv'}: 1 users in ")
    with open(tmp_path / "out.csv", newline="") as f:
        (row,) = list(csv.DictReader(f))
    assert row["user_id"] == "7" and len(row["item_ids"].split(",")) == 3


def test_a_run_of_candidate_scores_has_no_seen_rule(tmp_path, capsys):
    source = tmp_path / "users.jsonl"
    source.write_text(
        '{"user_id": 7, "item_ids": [3, 5], "timestamps": [1, 2], "actions": [1, 0], '
        '"candidates": [4, 9]}\n')
    session = _session("hstu-ranking", (1, 2))
    assert _run(session, _args(tmp_path, "--input", source, "--include-seen")) == 0
    assert capsys.readouterr().out.splitlines()[0] == "tool predict: a model"


def test_users_from_another_source_get_the_vocabulary_and_may_end_the_run(tmp_path, capsys):
    session = _session("hstu-retrieval")
    seen = []

    def users(items):
        seen.append(items)
        return 1, iter([(1, {"user_id": "a", "item_ids": [1, 2], "timestamps": [5, 6]})])

    assert _run(session, _args(tmp_path), users=users, destination="stdout") == 0
    out = capsys.readouterr().out
    assert seen == [None]  # no vocabulary: the model's ids
    assert out.splitlines()[-1].startswith("wrote stdout: 1 users in ")
    assert _run(session, _args(tmp_path, "--output", tmp_path / "none.csv"),
                users=lambda items: 1) == 1
    assert "wrote" not in capsys.readouterr().out and not (tmp_path / "none.csv").exists()


def test_a_bad_ids_option_is_a_predict_error_before_the_header(tmp_path, capsys):
    with pytest.raises(PredictError, match="--ids raw: m.pt holds no id vocabulary"):
        _run(_session("hstu-retrieval"), _args(tmp_path, "--input", "u.jsonl", "--ids", "raw"))
    assert capsys.readouterr().out == ""


def test_a_row_needs_its_kinds_columns_and_contextual_only_where_the_model_takes_it():
    assert Limits("retrieval", 10, 5).extra_columns == ()
    assert Limits("ranking", 10, 5, 3, 0, ("click",)).extra_columns == ("actions", "candidates")
    assert Limits("ranking", 10, 5, 3, 4, ("click",)).extra_columns == (
        "actions", "candidates", "contextual")
