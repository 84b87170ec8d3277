"""The example model plugin (examples/tzrec-gr-model-example, installed as a wheel by
``nox -s test-plugins``) through tzrec's tools, unchanged: the registry lists it,
``tzrec-bench train --model one-layer-hstu`` trains it, ``evaluate`` and ``predict`` read its
checkpoint, ``ServingSession`` serves it and ``python -m tzrec_acc export`` exports it; a
broken model plugin beside it is listed as failed and takes nothing down.

Each tool runs in a fresh process, as a user runs it, on tiny synthetic data on the CPU.
"""

from __future__ import annotations

import csv
import importlib.metadata
import json
import os
import pathlib
import subprocess
import sys
import textwrap
from typing import Dict, Optional

import pytest

DIST = "tzrec-gr-model-example"
try:
    VERSION = importlib.metadata.version(DIST)
except importlib.metadata.PackageNotFoundError:
    pytest.skip(f"{DIST} (examples/tzrec-gr-model-example) is not installed: "
                "`nox -s test-plugins` builds it as a wheel and installs it",
                allow_module_level=True)

import torch  # noqa: E402

from tzrec_gr.models import HSTURanking, HSTURetrieval  # noqa: E402
from tzrec_gr.models.registry import failed_model_plugins, get_model, model_names  # noqa: E402
from tzrec_gr.serving import Histories, ServingSession  # noqa: E402

NAME = "one-layer-hstu"
TINY = ["--data", "synthetic", "--synthetic-users", "48", "--synthetic-items", "120",
        "--max-seq-len", "16", "--embedding-dim", "16", "--num-heads", "2",
        "--num-negatives", "16", "--batch-size", "16", "--eval-batch-size", "64",
        "--max-steps", "3", "--no-plot", "--no-progress"]
# users of the model's ids: (item ids, timestamps)
USERS = {"u0": ([3, 7, 11, 20], [100, 160, 220, 400]), "u1": ([5, 9], [50, 90])}


def _run(
    *args: str, env: Optional[Dict[str, str]] = None, timeout: int = 300
) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("TZREC_GR_STRICT")}
    environ.update(env or {})
    return subprocess.run([sys.executable, *args], capture_output=True, text=True,
                          env=environ, timeout=timeout)


def _ok(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> pathlib.Path:
    """A run folder of ``tzrec-bench train --model one-layer-hstu`` (3 steps)."""
    out = tmp_path_factory.mktemp("runs") / NAME
    _ok(_run("-m", "tzrec_bench", "train", "--model", NAME, *TINY, "--out-dir", str(out)))
    return out


def _histories() -> Histories:
    ids = [i for items, _ in USERS.values() for i in items]
    times = [t for _, stamps in USERS.values() for t in stamps]
    lengths = [len(items) for items, _ in USERS.values()]
    return Histories(item_ids=torch.tensor(ids), lengths=torch.tensor(lengths),
                     timestamps=torch.tensor(times))


# -- the registry ---------------------------------------------------------------------------


def test_the_registry_lists_the_plugin_from_its_entry_point():
    (ep,) = [ep for ep in importlib.metadata.entry_points(group="tzrec_gr.models")
             if ep.name == NAME]
    assert ep.value == "tzrec_gr_model_example.model" and ep.dist.metadata["Name"] == DIST
    record = get_model(NAME)
    assert record.model_class.__name__ == "OneLayerHSTU" and record.task == "retrieval"
    assert record.model_class.__module__ == "tzrec_gr_model_example.model"
    assert not issubclass(record.model_class, (HSTURetrieval, HSTURanking))
    assert NAME in model_names("retrieval") and failed_model_plugins() == []


def test_train_offers_the_plugin_as_a_model_with_its_description():
    # wide enough that argparse breaks no line (it would break names at their hyphens)
    shown = " ".join(_ok(_run("-m", "tzrec_bench", "train", "--help",
                              env={"COLUMNS": "10000"})).split())
    assert f"{NAME} (retrieval): one HSTU layer with a learned projection head" in shown


# -- train, evaluate, predict ----------------------------------------------------------------


def test_train_writes_a_checkpoint_of_the_plugin_model(run):
    payload = torch.load(run / "best.pt", map_location="cpu", weights_only=True)
    assert payload["model_config"]["model"] == "OneLayerHSTU"
    assert payload["model_config"]["kwargs"]["max_seq_len"] == 16
    metrics = json.loads((run / "metrics.json").read_text())
    assert metrics["steps"] == 3 and metrics["test"]["count"] == 48


def test_evaluate_gives_the_metrics_train_wrote(run):
    out = _ok(_run("-m", "tzrec_bench", "evaluate", str(run), "--split", "test",
                   "--no-progress"))
    test = json.loads((run / "metrics.json").read_text())["test"]
    assert out.splitlines()[0].startswith(f"{NAME} on synthetic")
    for metric in ("hr@10", "ndcg@50", "mrr"):
        assert f"{metric:<8}  {test[metric]:.4f}" in out, out


def test_predict_writes_what_the_serving_session_recommends(run, tmp_path):
    rows = [{"user_id": u, "item_ids": items, "timestamps": stamps}
            for u, (items, stamps) in USERS.items()]
    source = tmp_path / "users.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in rows))
    output = tmp_path / "top.csv"
    _ok(_run("-m", "tzrec_bench", "predict", str(run), "--input", str(source), "--output",
             str(output), "--ids", "model", "--k", "5", "--no-progress"))
    with open(output, newline="") as f:
        written = {r["user_id"]: json.loads(r["item_ids"]) for r in csv.DictReader(f)}
    top = ServingSession.from_checkpoint(run).recommend(_histories(), k=5)
    assert written == dict(zip(USERS, top.ids.tolist()))


# -- serving and export -----------------------------------------------------------------------


def test_the_serving_session_serves_the_trained_plugin_model(run):
    session = ServingSession.from_checkpoint(run)
    model = session.model
    assert type(model).__name__ == "OneLayerHSTU"
    assert type(session.server).__name__ == "OneLayerHSTUServer"
    histories = _histories()
    top = session.recommend(histories, k=5, exclude_seen=False)
    with torch.no_grad():  # brute force: each user's embedding against every item
        users = model.user_embedding(histories.item_ids, histories.lengths,
                                     histories.timestamps)
        scores = users @ model.item_embedding(torch.arange(model.num_items)).T
    expected = scores.topk(5, dim=1)
    torch.testing.assert_close(top.scores, expected.values, rtol=1e-5, atol=1e-5)
    assert top.ids.tolist() == expected.indices.tolist()
    # opened users extended by their last events answer as their whole histories
    first = Histories(item_ids=torch.tensor([3, 7, 5]), lengths=torch.tensor([2, 1]),
                      timestamps=torch.tensor([100, 160, 50]))
    rest = Histories(item_ids=torch.tensor([11, 20, 9]), lengths=torch.tensor([2, 1]),
                     timestamps=torch.tensor([220, 400, 90]))
    session.open(list(USERS), first)
    session.extend(list(USERS), rest)
    opened = session.recommend(list(USERS), k=5, exclude_seen=False)
    torch.testing.assert_close(opened.scores, top.scores, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("form", ["full", "serving"])
def test_tzrec_acc_exports_the_plugin_model_and_runs_the_package(run, tmp_path, form):
    package = tmp_path / f"{form}.pt2"
    out = _ok(_run("-m", "tzrec_acc", "export", "--model", str(run), "--format", "fx",
                   "--form", form, "--history", "8", "--output", str(package)))
    assert "MISMATCH" not in out and out.count(" ok") >= 2, out
    assert package.is_file()
    assert "package vs the eager outputs stored at export" in _ok(
        _run("-m", "tzrec_acc", "run", str(package)))


def test_tzrec_acc_exports_the_plugin_model_from_a_state_dict_and_config(run, tmp_path):
    payload = torch.load(run / "best.pt", map_location="cpu", weights_only=True)
    torch.save(payload["model"], tmp_path / "weights.pt")
    (tmp_path / "model.json").write_text(json.dumps(payload["model_config"]))
    out = _ok(_run("-m", "tzrec_acc", "export", "--model", str(tmp_path / "weights.pt"),
                   "--config", str(tmp_path / "model.json"), "--format", "fx", "--history",
                   "8", "--output", str(tmp_path / "m.pt2")))
    assert "MISMATCH" not in out


# -- a broken model plugin ---------------------------------------------------------------------


@pytest.fixture
def broken_dist(tmp_path) -> Dict[str, str]:
    """The environment of a process that also sees a test-only distribution,
    ``broken-model-plugin`` 0.3, whose ``tzrec_gr.models`` entry point fails to import."""
    (tmp_path / "broken_model_plugin.py").write_text(
        "raise ImportError('needs the gizmo package')\n")
    info = tmp_path / "broken_model_plugin-0.3.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: broken-model-plugin\nVersion: 0.3\n")
    (info / "entry_points.txt").write_text(
        "[tzrec_gr.models]\nbroken = broken_model_plugin\n")
    path = os.pathsep.join(p for p in (str(tmp_path), os.environ.get("PYTHONPATH")) if p)
    return {"PYTHONPATH": path}


_LIST = textwrap.dedent("""
    from tzrec_gr.models.registry import failed_model_plugins, model_names
    print(",".join(model_names()))
    for failed in failed_model_plugins():
        print(failed.describe())
""")


def test_a_broken_model_plugin_is_listed_as_failed_and_the_others_load(broken_dist):
    result = _run("-c", _LIST, env=broken_dist)
    names, *failed = _ok(result).splitlines()
    assert NAME in names.split(",") and "hstu-retrieval" in names.split(",")
    assert failed == ["model plugin 'broken' (broken_model_plugin) from distribution "
                      "broken-model-plugin 0.3: ImportError('needs the gizmo package')"]
    assert "skipping tzrec_gr model plugin 'broken'" in result.stderr


def test_a_broken_model_plugin_does_not_take_the_tools_down(broken_dist, run):
    result = _run("-m", "tzrec_bench", "evaluate", str(run), "--split", "test",
                  "--no-progress", env=broken_dist)
    assert _ok(result).splitlines()[0].startswith(f"{NAME} on synthetic")
    assert "skipping tzrec_gr model plugin 'broken'" in result.stderr


def test_strict_plugins_make_the_broken_one_an_error(broken_dist):
    result = _run("-c", _LIST, env={**broken_dist, "TZREC_GR_STRICT_PLUGINS": "1"})
    assert result.returncode == 1
    assert ("ModelRegistryError: failed to load tzrec_gr model plugin 'broken' "
            "(broken_model_plugin) from distribution broken-model-plugin 0.3") in result.stderr

