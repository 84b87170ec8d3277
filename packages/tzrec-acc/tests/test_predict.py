"""``python -m tzrec_acc predict`` (checkpoints and ranking packages) and ``export``'s fast
failure.

What is checked against what: predictions from a checkpoint == ``ServingSession`` on the
same histories; from a ``--form full`` ranking package (fx) == from its checkpoint (within
float32 tolerance), and so is ``tzrec_acc.serving.load_session(package).score``; packages
predict cannot serve are refused naming why; ``export`` refuses a bad ``--output``, a missing
model or config and bad options before loading anything. Retrieval packages: test_serving.
"""

from __future__ import annotations

import csv
import json
import time

import numpy as np
import pytest
import torch
from test_checkpoint import RANKING_KWARGS, bench_checkpoint

from tzrec_acc import aot
from tzrec_acc.cli import main
from tzrec_acc.serving import PackageSession, load_session
from tzrec_gr.models import HSTURanking
from tzrec_gr.serving import Histories, ServingSession
from tzrec_gr.vocabulary import VOCABULARY_KEY, IdVocabularies, Vocabulary


def _rows(n, num_items=30, seed=0, ranking=True):
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for u in range(n):
        length = int(torch.randint(1, 10, (1,), generator=gen))
        row = {
            "user_id": 100 + u,
            "item_ids": torch.randint(0, num_items, (length,), generator=gen).tolist(),
            "timestamps": torch.cumsum(torch.randint(0, 90, (length,), generator=gen), 0).tolist(),
        }
        if ranking:
            row["actions"] = torch.randint(0, 256, (length,), generator=gen).tolist()
            row["candidates"] = torch.randint(0, num_items, (3,), generator=gen).tolist()
        rows.append(row)
    return rows


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _read_csv(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _probs(path, tasks=("task_0", "task_1")):
    """[L_t, K] from a CSV of scores."""
    rows = _read_csv(path)
    return torch.cat(
        [torch.tensor([json.loads(r[t]) for t in tasks]).t() for r in rows]
    )


def _session_probs(best, rows):
    session = ServingSession.from_checkpoint(best)
    h = Histories.from_lists(
        [r["item_ids"] for r in rows],
        [r["timestamps"] for r in rows],
        actions=[r["actions"] for r in rows],
    )
    return session.score(h, [r["candidates"] for r in rows])


def test_predict_from_a_checkpoint_equals_the_session(tmp_path, capsys):
    bench_checkpoint(tmp_path / "best.pt")
    rows = _rows(6)
    rows[4] = {**rows[4], "timestamps": rows[4]["timestamps"][::-1] + [0]}  # row 5: bad
    out = tmp_path / "scores.csv"
    source = _jsonl(tmp_path / "u.jsonl", rows)
    code = main(["predict", str(tmp_path / "best.pt"), "--input", source,
                 "--output", str(out), "--batch-size", "2", "--no-progress"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "skipped row 5: item_ids has" in captured.err
    assert "5 users in" in captured.out and "users/s" in captured.out
    good = rows[:4] + rows[5:]
    assert [int(r["user_id"]) for r in _read_csv(out)] == [r["user_id"] for r in good]
    torch.testing.assert_close(_probs(out), _session_probs(tmp_path / "best.pt", good),
                               rtol=1e-5, atol=1e-6)
    code = main(["predict", str(tmp_path / "best.pt"), "--input", str(tmp_path / "u.jsonl"),
                 "--output", str(tmp_path / "again.csv"), "--on-error", "fail"])
    assert code == 1 and "row 5: item_ids has" in capsys.readouterr().err
    assert not (tmp_path / "again.csv").exists()


def test_retrieval_checkpoint_recommends(tmp_path, capsys):
    """A checkpoint without a vocabulary (model ids, a note); seen items left out by default
    (as ServingSession.recommend), kept with --include-seen."""
    bench_checkpoint(tmp_path / "best.pt", "hstu-retrieval")
    rows = _rows(3, ranking=False)
    out = tmp_path / "top.csv"
    session = ServingSession.from_checkpoint(tmp_path / "best.pt")
    h = Histories.from_lists([r["item_ids"] for r in rows], [r["timestamps"] for r in rows])
    for option, exclude in (([], True), (["--include-seen"], False), (["--exclude-seen"], True)):
        assert main(["predict", str(tmp_path / "best.pt"), "--input",
                     _jsonl(tmp_path / "u.jsonl", rows), "--output", str(out), "--k", "5",
                     *option]) == 0
        printed = capsys.readouterr().out
        assert f"note: {tmp_path / 'best.pt'} holds no id vocabulary" in printed
        assert ("seen items excluded" if exclude else "seen items kept") in printed
        want = session.recommend(h, 5, exclude_seen=exclude).ids.tolist()
        assert [json.loads(r["item_ids"]) for r in _read_csv(out)] == want
    assert main(["predict", str(tmp_path / "best.pt"), "--input", str(tmp_path / "u.jsonl"),
                 "--output", str(out), "--ids", "raw"]) == 2
    assert "--ids raw: " in capsys.readouterr().err


def test_a_run_folder_with_a_vocabulary_predicts_raw_ids(tmp_path, capsys):
    """``predict RUN_FOLDER``: its best.pt, else checkpoint.pt; raw ids in and out (ids 1..30:
    most are model rows too); an integer past int64 or an unknown raw id is one bad row."""
    run = tmp_path / "run"
    run.mkdir()
    bench_checkpoint(run / "checkpoint.pt")
    payload = torch.load(run / "checkpoint.pt", weights_only=True)
    vocab = IdVocabularies(Vocabulary([100, 101]), Vocabulary(np.arange(1, 31)), "fp", "log")
    torch.save({**payload, VOCABULARY_KEY: vocab.state()}, run / "checkpoint.pt")
    rows = _rows(4, seed=2)
    raw = [{**r, "item_ids": [i + 1 for i in r["item_ids"]],
            "candidates": [i + 1 for i in r["candidates"]]} for r in rows]
    raw[1] = {**raw[1], "timestamps": [*raw[1]["timestamps"][:-1], 99999999999999999999]}
    raw[2] = {**raw[2], "candidates": [0]}  # a model row, not a raw id
    out = tmp_path / "scores.csv"
    code = main(["predict", str(run), "--input", _jsonl(tmp_path / "u.jsonl", raw),
                 "--output", str(out), "--no-progress"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "item ids: raw (30 int ids of log" in captured.out
    assert "skipped row 2: timestamps[" in captured.err and "outside the 64-bit" in captured.err
    assert "skipped row 3: unknown item id 0 in candidates (position 0)" in captured.err
    got = _read_csv(out)
    assert [json.loads(r["candidates"]) for r in got] == [raw[i]["candidates"] for i in (0, 3)]
    good = [rows[0], rows[3]]
    torch.testing.assert_close(_probs(out), _session_probs(run, good), rtol=1e-5, atol=1e-6)


def _in_process(path, batches, kind, imports):
    """``run_in_fresh_process`` without the fresh process (its own tests are in test_cli):
    the export's parity check then costs no second Python start."""
    run = torch.export.load(path).module()
    with torch.no_grad():
        return [[t for t in aot.flat_outputs(run(*args))] for args in batches]


def test_ranking_package_predicts_what_its_checkpoint_does(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(aot, "run_in_fresh_process", _in_process)
    # one layer: torch.export's time grows with the layers
    kwargs = {**RANKING_KWARGS, "num_layers": 1}
    model = HSTURanking(**kwargs)
    torch.save({"format": 1, "config": {"model": "hstu-ranking"}, "step": 1,
                "model_config": {"model": "HSTURanking", "kwargs": kwargs},
                "model": model.state_dict()}, tmp_path / "best.pt")
    package = str(tmp_path / "ranking.pt2")
    assert main(["export", "--model", str(tmp_path / "best.pt"), "--format", "fx",
                 "--output", package, "--max-batch", "8"]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert "package vs the eager float32 model (the packaging)" in out
    assert "not quantized (--quantize none, --precision fp32)" in out
    assert "vs the float32 model on the same batches" not in out
    rows = _rows(11, seed=1)
    out = tmp_path / "scores.csv"
    source = _jsonl(tmp_path / "u.jsonl", rows)
    code = main(["predict", package, "--input", source,
                 "--output", str(out), "--batch-size", "64", "--no-progress"])
    assert code == 0, capsys.readouterr().err
    assert "11 users" in capsys.readouterr().out  # in batches of --max-batch 8
    torch.testing.assert_close(_probs(out), _session_probs(tmp_path / "best.pt", rows),
                               rtol=1e-4, atol=1e-5)
    # run --input is predict: the same rows, to a file or (no --output) to stdout
    again = tmp_path / "run.csv"
    code = main(["run", package, "--input", source, "--output", str(again), "--batch-size",
                 "5", "--no-progress"])
    assert code == 0, capsys.readouterr().err
    assert "wrote " + str(again) in capsys.readouterr().out
    # other batches (5 users, not 8): the same rows, the same scores up to float rounding
    assert [(r["user_id"], r["candidates"]) for r in _read_csv(again)] == [
        (r["user_id"], r["candidates"]) for r in _read_csv(out)]
    torch.testing.assert_close(_probs(again), _probs(out), rtol=1e-5, atol=1e-6)
    assert main(["run", package, "--input", source, "--no-progress"]) == 0
    captured = capsys.readouterr()
    assert captured.out == out.read_text()  # the batches of predict's default --batch-size
    assert "wrote stdout: 11 users" in captured.err
    assert main(["run", package, "--output", str(again)]) == 2
    err = capsys.readouterr().err
    assert "--output, --batch-size, --on-error and --ids apply with --input" in err
    # the session API over the same package: score as ServingSession.score, any batch size
    session = load_session(package)
    assert isinstance(session, PackageSession) and session.kind == "ranking"
    histories = Histories.from_lists([r["item_ids"] for r in rows],
                                     [r["timestamps"] for r in rows],
                                     actions=[r["actions"] for r in rows])
    dense = torch.tensor([r["candidates"] for r in rows])  # [11, 3]: 2 calls of 8 users at most
    got = session.score(histories, dense)
    assert got.shape == (11, 3, 2)
    torch.testing.assert_close(got.reshape(-1, 2), _session_probs(tmp_path / "best.pt", rows),
                               rtol=1e-4, atol=1e-5)
    with pytest.raises(TypeError, match=r"recommend needs a retrieval package"):
        session.recommend(histories, 3)
    with pytest.raises(TypeError, match="extend is not possible from a package"):
        session.extend([1], histories)


@pytest.mark.parametrize(
    "served, message",
    [
        ({"model": "retrieval", "form": "full"}, "is a retrieval package without the item "
         "table that top-K needs"),
        ({"model": "ranking", "form": "serving"}, "--form serving package: it scores against "
         "a cache that only the model's prefill makes"),
        ({"model": "ranking", "form": "full", "dynamic": []}, "--dynamic none: it takes the "
         "sample batch's shapes only"),
        (None, "does not describe the model (no 'served' entry)"),
    ],
)
def test_packages_predict_cannot_serve_are_refused(tmp_path, capsys, served, message):
    package = tmp_path / "m.pt2"
    package.write_bytes(b"")
    sample = {"kind": "program", "imports": [], "batches": [], "expected": []}
    if served is not None:
        sample["served"] = {"dynamic": ["users", "tokens"], **served}
    torch.save(sample, str(package) + ".sample.pt")
    source = _jsonl(tmp_path / "u.jsonl", _rows(1))
    assert main(["predict", str(package), "--input", source, "--output",
                 str(tmp_path / "o.csv")]) == 2
    assert message in capsys.readouterr().err


def test_predict_bad_files_exit_2(tmp_path, capsys):
    source = _jsonl(tmp_path / "u.jsonl", _rows(1))
    for argv, message in [
        (["m.pt", "--input", source, "--output", str(tmp_path / "no" / "o.csv")], "--output"),
        (["m.pt", "--input", source, "--output", str(tmp_path / "o.json")], "--output must end"),
        (["m.pt", "--input", str(tmp_path / "x.csv"), "--output", str(tmp_path / "o.csv")],
         "--input: no file at"),
        ([str(tmp_path / "m.pt"), "--input", source, "--output", str(tmp_path / "o.csv")],
         "model: no file at"),
    ]:
        assert main(["predict", *argv]) == 2
        assert message in capsys.readouterr().err


def test_export_fails_fast_on_a_missing_output_folder(tmp_path, capsys):
    bench_checkpoint(tmp_path / "best.pt")
    missing = tmp_path / "no-such-folder" / "m.pt2"
    start = time.perf_counter()
    code = main(["export", "--model", str(tmp_path / "best.pt"), "--output", str(missing)])
    seconds = time.perf_counter() - start
    assert code == 2 and seconds < 0.5, seconds
    err = capsys.readouterr().err
    assert err == f"error: --output {missing}: its folder {missing.parent} does not exist\n"
    out = str(tmp_path / "m.pt2")
    for argv, message in [
        (["--model", str(tmp_path / "none.pt"), "--output", out],
         "--model: no checkpoint or state dict at"),
        (["--model", str(tmp_path / "best.pt"), "--config", str(tmp_path / "c.json"),
          "--output", out], "--config: no model config at"),
        (["--model", str(tmp_path / "best.pt"), "--output", str(tmp_path)], "--output must end"),
        (["--model", str(tmp_path / "best.pt"), "--output", out, "--history", "0"],
         "--history must be >= 1"),
    ]:
        start = time.perf_counter()
        assert main(["export", *argv]) == 2, argv
        assert time.perf_counter() - start < 0.5
        assert message in capsys.readouterr().err
    if not torch.cuda.is_available():  # the option's own error, while the line is parsed
        with pytest.raises(SystemExit) as exit_:
            main(["export", "--model", str(tmp_path / "best.pt"), "--output", out,
                  "--device", "cuda"])
        assert exit_.value.code == 2
        assert "argument --device: cuda: no CUDA device is visible" in capsys.readouterr().err
    assert not (tmp_path / "m.pt2").exists()
