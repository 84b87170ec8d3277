"""``tzrec-bench predict``: best.pt -> a file of top-10 recommendations or candidate scores.

What is checked against what: the file's rows == ``ServingSession.recommend`` / ``score``
on the same histories in the same batches (the session is tested against brute force in
tzrec-gr); item ids are the raw ids of the trained run's vocabulary in and out (a file
without a vocabulary reads model ids, with a note); every kind of bad row is reported by its
row number and skipped (counted) or failed on (exit 1, nothing written); Parquet, CSV and
JSONL inputs give the same output; seen items are left out unless --include-seen.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from tzrec_bench.cli import main
from tzrec_bench.train import checkpoint
from tzrec_bench.train.config import TrainConfig
from tzrec_bench.train.factory import build_model, model_config
from tzrec_bench.train.loop import train
from tzrec_bench.train.ranking import TASK_BITS
from tzrec_gr.checkpoint import write_payload
from tzrec_gr.serving import Histories, ServingSession
from tzrec_gr.vocabulary import VOCABULARY_KEY, IdVocabularies, Vocabulary

ML_100K = Path(__file__).resolve().parents[3].parent / "shared" / "data" / "ml-100k"

TINY = dict(
    data="synthetic", synthetic_users=48, synthetic_items=120, max_seq_len=16,
    embedding_dim=16, num_layers=1, num_heads=2, num_negatives=16, num_candidates=4,
    batch_size=16, lr=1e-2, eval_batch_size=64, log_every=1, progress=False, plot=False,
)
NUM_ITEMS = 119  # the synthetic data's 120 items less one it never draws (seed 0)
ITEMS = 100  # ids the test users draw from


def _write_best(path: Path, config: TrainConfig, num_items: int, task_bits=(),
                vocabularies=None):
    """A best.pt as the trainer writes it (its writer is tested in test_trainer.py), with
    the weights of a fresh model (and ``vocabularies``, when given)."""
    torch.manual_seed(0)
    model = build_model(config, num_items, task_bits)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "config": config.to_dict(), "model_config": model_config(config, num_items, task_bits),
        "step": 0, "metrics": {}, "model": model.state_dict()}
    if vocabularies is not None:
        payload[VOCABULARY_KEY] = vocabularies.state()
    write_payload(path, payload)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A trained retrieval run (2 steps) and a ranking best.pt written in its format."""
    root = tmp_path_factory.mktemp("runs")
    train(TrainConfig(**{**TINY, "model": "hstu-retrieval", "max_steps": 2,
                         "out_dir": str(root / "hstu-retrieval")}))
    ranking = TrainConfig(**{**TINY, "model": "hstu-ranking"})
    bits = (int(TASK_BITS["like"]), int(TASK_BITS["long_view"]))
    _write_best(root / "hstu-ranking" / checkpoint.BEST, ranking, NUM_ITEMS, bits)
    return root


def _vocabulary(run):
    """The trained run's item vocabulary (raw ids of the synthetic data)."""
    vocabularies = ServingSession.from_checkpoint(run).vocabularies
    assert vocabularies is not None
    return vocabularies.items


def _raw(rows, items):
    """``rows`` (model ids) with their item ids written as ``items``' raw ids."""
    return [{**r, **{c: items.raw(r[c]) for c in ("item_ids", "candidates") if c in r}}
            for r in rows]


def _users(n, seed=0, ranking=False):
    """Users with the model's item ids (see ``_raw``)."""
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for u in range(n):
        length = int(torch.randint(1, 24, (1,), generator=gen))  # some past the bound (16)
        row = {
            "user_id": f"u{u}",
            "item_ids": torch.randint(0, ITEMS, (length,), generator=gen).tolist(),
            "timestamps": torch.cumsum(torch.randint(0, 50, (length,), generator=gen), 0)
            .tolist(),
        }
        if ranking:
            row["actions"] = torch.randint(0, 8, (length,), generator=gen).tolist()
            row["candidates"] = torch.randint(0, ITEMS, (3,), generator=gen).tolist()
        rows.append(row)
    return rows


def _write(path: Path, rows):
    if path.suffix == ".parquet":
        pq.write_table(pa.Table.from_pylist(rows), path)
    elif path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    else:
        with open(path, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            for r in rows:
                writer.writerow({k: " ".join(map(str, v)) if isinstance(v, list) else v
                                 for k, v in r.items()})
    return path


def _read(path: Path):
    if path.suffix == ".parquet":
        return pq.read_table(path).to_pylist()
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    out = []
    for r in rows:
        row = {"user_id": r.pop("user_id")}
        for k, v in r.items():  # each list is a JSON list in its cell
            row[k] = json.loads(v)
        out.append(row)
    return out


def _expected_top(best: Path, rows, k, batch):
    """Top-k raw ids and scores of the users of ``rows`` (raw ids), seen items excluded."""
    session = ServingSession.from_checkpoint(best)
    vocab = session.vocabularies
    ids, scores = [], []
    for s in range(0, len(rows), batch):
        chunk = rows[s : s + batch]
        h = Histories.from_raw(vocab, [r["item_ids"][-16:] for r in chunk],
                               [r["timestamps"][-16:] for r in chunk])
        top = session.recommend(h, k=k + 8)
        raw = [vocab.items.raw(row) for row in top.ids.tolist()]
        for r, i, v in zip(chunk, raw, top.scores.tolist()):
            kept = [(a, b) for a, b in zip(i, v) if a not in set(r["item_ids"])][:k]
            ids.append([a for a, _ in kept])
            scores.append([b for _, b in kept])
    return ids, scores


@pytest.mark.parametrize("suffix, out", [(".parquet", ".parquet"), (".csv", ".csv"),
                                         (".jsonl", ".parquet")])
def test_top10_file_equals_the_session_from_one_command(runs, tmp_path, capsys, suffix, out):
    items = _vocabulary(runs / "hstu-retrieval")
    rows = _raw(_users(11), items)
    source = _write(tmp_path / f"users{suffix}", rows)
    target = tmp_path / f"top10{out}"
    best = runs / "hstu-retrieval" / checkpoint.BEST
    code = main(["predict", str(runs / "hstu-retrieval"), "--input", str(source),
                 "--output", str(target), "--batch-size", "4", "--no-progress",
                 "--exclude-seen"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "users/s" in captured.out and "11 users" in captured.out
    assert "; seen items excluded (--include-seen to rank them too)\n" in captured.out
    assert f"item ids: raw ({len(items)} int ids" in captured.out
    got = _read(target)
    assert [r["user_id"] for r in got] == [r["user_id"] for r in rows]
    want_ids, want_scores = _expected_top(best, rows, 10, 4)
    assert [r["item_ids"] for r in got] == want_ids
    for r, s in zip(got, want_scores):
        assert r["scores"] == pytest.approx(s, rel=1e-6, abs=1e-6)
    # histories longer than the bound keep their newest events, and their older items
    # stay excluded
    long = [i for i, r in enumerate(rows) if len(r["item_ids"]) > 16]
    assert long and "histories cut to the model's newest events" in captured.out
    for i in long:
        assert not set(got[i]["item_ids"]) & set(rows[i]["item_ids"])


@pytest.mark.parametrize("option", [["--include-seen"], ["--no-exclude-seen"]])
def test_seen_items_are_kept_with_include_seen_and_k(runs, tmp_path, capsys, option):
    """The trainer's rule (TrainConfig.exclude_seen is False): seen items are ranked like
    any other with --include-seen, and with --no-exclude-seen (its older spelling)."""
    rows = _users(3)
    short = [{**r, "item_ids": r["item_ids"][-5:], "timestamps": r["timestamps"][-5:]}
             for r in rows]
    source = _write(tmp_path / "u.jsonl", _raw(short, _vocabulary(runs / "hstu-retrieval")))
    target = tmp_path / "top.csv"
    assert main(["predict", str(runs / "hstu-retrieval" / checkpoint.BEST), "--input",
                 str(source), "--output", str(target), "--k", "3", *option]) == 0
    assert "; seen items kept, as the trainer's metrics rank them (--include-seen)" in (
        capsys.readouterr().out)
    session = ServingSession.from_checkpoint(runs / "hstu-retrieval" / checkpoint.BEST)
    h = Histories.from_lists([r["item_ids"] for r in short], [r["timestamps"] for r in short])
    top = session.recommend(h, k=3, exclude_seen=False)
    got = [[int(i) for i in r["item_ids"]] for r in _read(target)]
    assert got == top.raw_ids(session.vocabularies)
    # --ids model: the same top-3 as the model's rows
    source = _write(tmp_path / "rows.jsonl", short)
    assert main(["predict", str(runs / "hstu-retrieval"), "--input", str(source), "--output",
                 str(target), "--k", "3", "--ids", "model", *option]) == 0
    assert "item ids: the model's rows 0..N-1 (--ids model)" in capsys.readouterr().out
    assert [[int(i) for i in r["item_ids"]] for r in _read(target)] == top.ids.tolist()


def test_ranking_scores_equal_the_session(runs, tmp_path, capsys):
    rows = [{**r, "item_ids": r["item_ids"][-16:], "timestamps": r["timestamps"][-16:],
             "actions": r["actions"][-16:]} for r in _users(5, seed=1, ranking=True)]
    source = _write(tmp_path / "users.csv", rows)
    target = tmp_path / "scores.parquet"
    best = runs / "hstu-ranking" / checkpoint.BEST
    code = main(["predict", str(best), "--input", str(source), "--output", str(target),
                 "--no-progress"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    # a best.pt without a vocabulary (written before checkpoints held one): model ids
    assert f"note: {best} holds no id vocabulary" in captured.out
    got = pq.read_table(target).to_pylist()
    session = ServingSession.from_checkpoint(best)
    h = Histories.from_lists([r["item_ids"] for r in rows], [r["timestamps"] for r in rows],
                             actions=[r["actions"] for r in rows])
    probs = session.score(h, [r["candidates"] for r in rows])  # [L_t, tasks]
    tasks = [c for c in got[0] if c not in ("user_id", "candidates")]
    assert tasks == ["like", "long_view"]
    assert probs.shape[1] == len(tasks)
    flat = torch.tensor([[r[t][j] for t in tasks] for r in got for j in range(3)])
    torch.testing.assert_close(flat, probs, rtol=1e-5, atol=1e-6)
    assert [r["candidates"] for r in got] == [r["candidates"] for r in rows]
    assert main(["predict", str(best), "--input", str(source), "--output", str(target),
                 "--ids", "raw"]) == 2
    assert "--ids raw: " in capsys.readouterr().err


BAD = {  # raw ids 1, 2, 3 are items of the synthetic data
    "unknown item id": ({"item_ids": [1, 500], "timestamps": [1, 2]},
                        "unknown item id 500 in item_ids (position 1): not one of the model's "
                        "119 raw item ids"),
    "string id": ({"item_ids": ["a"], "timestamps": [1]},
                  "unknown item id 'a' in item_ids (position 0)"),
    "timestamp past int64": ({"item_ids": [1, 2], "timestamps": [1, 99999999999999999999]},
                             "timestamps[1] is 99999999999999999999, outside the 64-bit "
                             "integer range"),
    "item id past int64": ({"item_ids": [1, 99999999999999999999], "timestamps": [1, 2]},
                           "unknown item id 99999999999999999999 in item_ids (position 1)"),
    "unsorted": ({"item_ids": [1, 2, 3], "timestamps": [5, 9, 7]},
                 "timestamps are not sorted: position 2 (7) is older than position 1 (9)"),
    "empty": ({"item_ids": [], "timestamps": []}, "empty history"),
    "lengths": ({"item_ids": [1, 2], "timestamps": [1]},
                "item_ids has 2 events but timestamps has 1"),
    "not integers": ({"item_ids": [1], "timestamps": ["a"]}, "timestamps[0] must be an integer"),
}


@pytest.mark.parametrize("kind", list(BAD))
def test_bad_rows_are_named_by_row_number_skipped_or_failed(runs, tmp_path, capsys, kind):
    rows = _raw(_users(4), _vocabulary(runs / "hstu-retrieval"))
    bad, message = BAD[kind]
    rows[2] = {**rows[2], **bad}  # row 3
    source = _write(tmp_path / "users.jsonl", rows)
    target = tmp_path / "top.parquet"
    argv = ["predict", str(runs / "hstu-retrieval"), "--input", str(source), "--output",
            str(target), "--no-progress", "--unknown-items", "skip-user"]
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert f"skipped row 3: {message}" in captured.err
    assert "4 rows read: 3 answered, 1 skipped" in captured.out
    assert [r["user_id"] for r in pq.read_table(target).to_pylist()] == ["u0", "u1", "u3"]
    target.unlink()
    assert main([*argv, "--on-error", "fail"]) == 1
    err = capsys.readouterr().err
    assert f"row 3: {message}" in err and "--on-error fail" in err and err.count("\n") == 1
    assert not target.exists() and not list(tmp_path.glob(".top.parquet*"))


def test_ranking_rows_need_candidates_and_actions(runs, tmp_path, capsys):
    rows = [{**r, "item_ids": r["item_ids"][-16:], "timestamps": r["timestamps"][-16:],
             "actions": r["actions"][-16:]} for r in _users(4, seed=2, ranking=True)]
    rows[0] = {**rows[0], "candidates": []}
    rows[1] = {**rows[1], "candidates": list(range(9))}  # max_targets is 4
    del rows[3]["candidates"]
    source = _write(tmp_path / "users.jsonl", rows)
    argv = ["predict", str(runs / "hstu-ranking"), "--input", str(source), "--output",
            str(tmp_path / "s.csv"), "--no-progress"]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "skipped row 1: candidates is empty" in err
    assert "skipped row 2: 9 candidates, more than the model's max_targets (4)" in err
    assert "skipped row 4: candidates is missing" in err
    assert [r["user_id"] for r in _read(tmp_path / "s.csv")] == ["u2"]


def test_options_and_files_fail_before_the_model_loads(runs, tmp_path, capsys):
    source = _write(tmp_path / "users.csv", _raw(_users(2), _vocabulary(runs / "hstu-retrieval")))
    run = str(runs / "hstu-retrieval")
    cases = [
        (["--output", str(tmp_path / "nope" / "top.csv")], 2, "--output"),
        (["--output", str(tmp_path / "top.txt")], 2, "--output must end with one of"),
        (["--input", str(tmp_path / "users.txt")], 2, "--input must end with one of"),
        (["--input", str(tmp_path / "none.csv")], 1, "--input: no file at"),
        (["--k", "1000"], 2, "--k must be in [1, 119] (the catalogue), got 1000"),
    ]
    for options, status, message in cases:
        argv = ["predict", run, "--input", str(source), "--output", str(tmp_path / "t.csv")]
        if options[0] in argv:
            argv[argv.index(options[0]) + 1] = options[1]
        else:
            argv += options
        assert main(argv) == status, options
        assert message in capsys.readouterr().err, options
    (tmp_path / "no-columns.csv").write_text("user,items\n1,2\n")
    assert main(["predict", run, "--input", str(tmp_path / "no-columns.csv"), "--output",
                 str(tmp_path / "t.csv")]) == 2
    assert "has no column user_id, item_ids, timestamps" in capsys.readouterr().err
    assert main(["predict", str(tmp_path / "none"), "--input", str(source), "--output",
                 str(tmp_path / "t.csv")]) == 2
    assert "no checkpoint at" in capsys.readouterr().err
    # the output folder is checked first: before the checkpoint is even looked for
    assert main(["predict", str(tmp_path / "none"), "--input", str(source), "--output",
                 str(tmp_path / "nope" / "t.csv")]) == 2
    assert "--output" in capsys.readouterr().err


@pytest.mark.skipif(not (ML_100K / "u.data.gz").is_file() and not (ML_100K / "u.data").is_file(),
                    reason=f"MovieLens 100K is not at {ML_100K}")
def test_ml_100k_best_pt_to_top10_file(tmp_path, capsys):
    """A best.pt of the ML-100K config's shape (random weights: what is tested is the
    path, not the quality) with the data's vocabulary -> top-10 for every user from a
    Parquet file of their histories in MovieLens' own item ids (1..1682: nearly all of them
    are model rows too, which predict must not read them as: issue 45)."""
    from tzrec_bench.data import load_dataset

    ds = load_dataset("ml-100k", ML_100K, cache_dir=tmp_path)
    config = TrainConfig(data="ml-100k", max_seq_len=50, embedding_dim=32, num_layers=1,
                         num_heads=2)
    vocab = IdVocabularies(Vocabulary(ds.user_raw_ids), Vocabulary(ds.item_raw_ids))
    _write_best(tmp_path / "best.pt", config, ds.num_items, vocabularies=vocab)
    users = range(len(ds.offsets) - 1)
    rows = [{"user_id": int(ds.user_raw_ids[u]),
             "item_ids": ds.item_raw_ids[ds.item_ids[ds.offsets[u]:ds.offsets[u + 1]]].tolist(),
             "timestamps": ds.timestamps[ds.offsets[u]:ds.offsets[u + 1]].tolist()}
            for u in users]
    source = _write(tmp_path / "users.parquet", rows)
    target = tmp_path / "top10.parquet"
    assert main(["predict", str(tmp_path / "best.pt"), "--input", str(source), "--output",
                 str(target), "--batch-size", "256", "--no-progress", "--exclude-seen"]) == 0
    got = pq.read_table(target).to_pylist()
    assert len(got) == 943 and all(len(r["item_ids"]) == 10 for r in got)
    assert "943 users" in capsys.readouterr().out
    for r, g in zip(rows[:20], got[:20]):  # the newest 50 events and older ones excluded
        assert g["user_id"] == r["user_id"] and not set(g["item_ids"]) & set(r["item_ids"])
    session = ServingSession.from_checkpoint(tmp_path / "best.pt")
    short = [i for i, r in enumerate(rows[:256]) if len(r["item_ids"]) <= 50][:8]
    h = Histories.from_raw(session.vocabularies, [rows[i]["item_ids"] for i in short],
                           [rows[i]["timestamps"] for i in short])
    # the same users in another batch: equal up to rounding (ties aside)
    top = session.recommend(h, k=10)
    raw = top.raw_ids(session.vocabularies)
    for j, i in enumerate(short):
        assert got[i]["scores"] == pytest.approx(top.scores[j].tolist(), abs=1e-5)
        assert set(got[i]["item_ids"]) <= set(ds.item_raw_ids.tolist())
        assert len(set(got[i]["item_ids"]) & set(raw[j])) >= 8  # (ties may swap the last)
