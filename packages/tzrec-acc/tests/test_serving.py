"""``tzrec_acc.serving``: one session API over a checkpoint and an exported package.

What is checked against what: a retrieval package (fx, exported by the CLI) recommends the
same ids as ``ServingSession.recommend`` on the checkpoint it was exported from, scores
within the float32 tolerance of ``tzrec_ops.tolerances``, with and without seen items, over
more users than its ``--max-batch``; the catalogue written beside it is the model's
normalized item table; ``predict RETRIEVAL.pt2`` writes those top-K as the raw ids of the
vocabulary the checkpoint carried (exported from the run's folder, stored beside the
package), as ``predict RUN_FOLDER`` does; what a package cannot do (per-user state, the
other kind's call, another device) raises naming the checkpoint route. The ranking
package's ``score`` is checked in test_predict (one export for both).
"""

from __future__ import annotations

import csv
import json

import pytest
import torch
from test_checkpoint import RETRIEVAL_KWARGS

from tzrec_acc import aot
from tzrec_acc.cli import main
from tzrec_acc.serving import PackageSession, items_path, load_session, predict_limits
from tzrec_gr.models import HSTURetrieval
from tzrec_gr.serving import Histories, ServingSession
from tzrec_gr.vocabulary import VOCABULARY_KEY, IdVocabularies, Vocabulary
from tzrec_ops.tolerances import torch_tolerance

SKUS = IdVocabularies(Vocabulary(["ann", "bob"]), Vocabulary([f"sku-{i:02d}" for i in range(30)]),
                      "fingerprint", "test skus")


def _in_process(path, batches, kind, imports):
    """``run_in_fresh_process`` without the fresh process (its own tests are in test_cli)."""
    run = torch.export.load(path).module()
    with torch.no_grad():
        return [aot.flat_outputs(run(*args)) for args in batches]


def _histories(users, num_items, seed):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 11, (users,), generator=gen).tolist()
    lengths[-1] = 1  # a user with one event: the package's row 0 of that user
    items = [torch.randint(0, num_items, (n,), generator=gen).tolist() for n in lengths]
    times = [torch.cumsum(torch.randint(0, 90, (n,), generator=gen), 0).tolist() for n in lengths]
    return items, times


@pytest.fixture(scope="module")
def retrieval_package(tmp_path_factory):
    """(checkpoint, package) of a one-layer retrieval model with a vocabulary of string
    ids, exported from its run's folder as an fx program."""
    folder = tmp_path_factory.mktemp("retrieval") / "run"
    folder.mkdir()
    patch = pytest.MonkeyPatch()
    patch.setattr(aot, "run_in_fresh_process", _in_process)
    try:
        torch.manual_seed(5)
        kwargs = {**RETRIEVAL_KWARGS, "num_layers": 1}  # torch.export's time grows with layers
        model = HSTURetrieval(**kwargs)
        torch.save({"format": 1, "config": {"model": "hstu-retrieval"}, "step": 1,
                    "model_config": {"model": "HSTURetrieval", "kwargs": kwargs},
                    "model": model.state_dict(), VOCABULARY_KEY: SKUS.state()},
                   folder / "best.pt")
        package = str(folder / "retrieval.pt2")
        code = main(["export", "--model", str(folder), "--format", "fx",
                     "--output", package, "--batch", "2", "--max-batch", "4"])
        assert code == 0
    finally:
        patch.undo()
    return folder / "best.pt", package


def test_retrieval_package_recommends_what_the_checkpoint_does(retrieval_package):
    best, package = retrieval_package
    served, reference = load_session(package), load_session(best.parent)  # the run's folder
    assert isinstance(served, PackageSession) and isinstance(reference, ServingSession)
    assert served.vocabularies.items == SKUS.items == reference.vocabularies.items
    assert served.vocabularies.source == "test skus"
    assert served.kind == "retrieval" and served.max_batch == 4
    limits = predict_limits(served)
    assert (limits.kind, limits.num_items, limits.max_events) == ("retrieval", 30, 10)
    assert predict_limits(reference) == limits
    # the catalogue beside the package: the model's L2-normalized table, row for row
    model = reference.model
    with torch.no_grad():
        want = model.item_embedding(torch.arange(model.num_items))
    torch.testing.assert_close(served.item_embeddings, want, rtol=0, atol=0)
    assert torch.equal(torch.load(items_path(package)), want)
    items, times = _histories(9, model.num_items, seed=2)  # 9 users: 3 package calls
    histories = Histories.from_lists(items, times)
    for exclude_seen in (True, False):
        got = served.recommend(histories, 6, exclude_seen=exclude_seen)
        expected = reference.recommend(histories, 6, exclude_seen=exclude_seen)
        assert torch.equal(got.ids, expected.ids), exclude_seen
        atol, rtol = torch_tolerance(expected.scores, torch.float32)
        torch.testing.assert_close(got.scores, expected.scores, atol=atol, rtol=rtol)
        seen = [set(row) & set(top) for row, top in zip(items, got.ids.tolist())]
        assert (not any(seen)) == exclude_seen
    # one user's answer does not depend on the batch it came in
    alone = served.recommend(Histories.from_lists(items[5:6], times[5:6]), 6)
    assert torch.equal(alone.ids, served.recommend(histories, 6).ids[5:6])


def test_predict_writes_a_retrieval_packages_top_k(retrieval_package, tmp_path, capsys):
    best, package = retrieval_package
    items, times = _histories(6, 30, seed=3)
    rows = [{"user_id": 10 + u, "item_ids": SKUS.items.raw(i), "timestamps": t}
            for u, (i, t) in enumerate(zip(items, times))]
    source = tmp_path / "users.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in rows))
    session = ServingSession.from_checkpoint(best)
    for model, ids in ((package, "raw"), (str(best.parent), "raw"), (package, "model")):
        out = tmp_path / "top10.csv"
        options = ["--ids", "model"] if ids == "model" else ["--include-seen"]
        code = main(["predict", model, "--input", str(source), "--output", str(out),
                     "--k", "10", "--no-progress", *options])
        captured = capsys.readouterr()
        if ids == "model":  # the raw ids are not rows: no user answered, nothing written
            assert code == 1 and "(6 rows read: 0 answered, 6 skipped)" in captured.err
            assert "skipped row 1: item_ids[0] must be an integer, got 'sku-" in captured.err
            continue
        assert code == 0, captured.err
        assert "6 users" in captured.out and "; seen items kept, as the trainer" in captured.out
        assert "item ids: raw (30 str ids of test skus" in captured.out
        assert model != package or f"package {package} (retrieval)" in captured.out
        with open(out, newline="") as f:
            written = list(csv.DictReader(f))
        top = session.recommend(Histories.from_lists(items, times), 10, exclude_seen=False)
        assert [int(r["user_id"]) for r in written] == [r["user_id"] for r in rows]
        assert [json.loads(r["item_ids"]) for r in written] == top.raw_ids(session.vocabularies)


def test_what_a_package_cannot_do_names_the_checkpoint(retrieval_package):
    _, package = retrieval_package
    session = load_session(package)
    h = Histories.from_lists([[1, 2]])
    for call in (lambda: session.open(["ann"], h), lambda: session.extend(["ann"], h),
                 lambda: session.close(["ann"])):
        with pytest.raises(TypeError, match=r"not possible from a package: .* keeps no "
                           r"per-user state.*load_session\('best.pt'\)"):
            call()
    with pytest.raises(TypeError, match="recommend from a package takes Histories, got list"):
        session.recommend(["ann"], 3)
    with pytest.raises(TypeError, match="score needs a ranking package; .* is a retrieval "
                       r"package, which answers recommend\(histories, k\)"):
        session.score(h, [[1]])
    with pytest.raises(ValueError, match=r"k must be an int in \[1, num_items=30\], got 31"):
        session.recommend(h, 31)
    with pytest.raises(ValueError, match="histories of user 0 has 11 events, more than the "
                       "model takes"):
        session.recommend(Histories.from_lists([list(range(11))]), 3)
    with pytest.raises(ValueError, match=r"device meta differs from the package's \(cpu\)"):
        load_session(package, device="meta")
    with pytest.raises(ValueError, match="backend applies to checkpoints"):
        load_session(package, backend="pytorch")


def _fake_package(tmp_path, served):
    package = tmp_path / "m.pt2"
    package.write_bytes(b"")
    sample = {"kind": "program", "imports": [], "batches": [()], "expected": [],
              "served": served}
    torch.save(sample, str(package) + ".sample.pt")
    return package


def test_package_files_that_cannot_serve_are_refused_before_loading(tmp_path):
    with pytest.raises(FileNotFoundError, match="no package at"):
        load_session(tmp_path / "none.pt2")
    with pytest.raises(FileNotFoundError, match="no checkpoint at"):
        load_session(tmp_path / "none.pt")
    served = {"model": "retrieval", "form": "full", "dynamic": ["users", "tokens"],
              "max_batch": 4, "num_items": 30, "max_events": 10, "items": "m.pt2.items.pt"}
    package = _fake_package(tmp_path, served)
    with pytest.raises(FileNotFoundError, match="m.pt2.items.pt: the catalogue that export "
                       "wrote beside the retrieval package"):
        load_session(package)
    torch.save(torch.zeros(29, 16), tmp_path / "m.pt2.items.pt")
    with pytest.raises(ValueError, match=r"must hold the \[30, E\] item table, got "
                       r"torch.Size\(\[29, 16\]\)"):
        load_session(package)
    (tmp_path / "m.pt2.sample.pt").unlink()
    with pytest.raises(FileNotFoundError, match="m.pt2.sample.pt"):
        PackageSession(package)
    with pytest.raises(ValueError, match="chunk_size must be an int >= 1, got 0"):
        PackageSession(package, chunk_size=0)
