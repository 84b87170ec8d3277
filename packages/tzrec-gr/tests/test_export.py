"""torch.export of the models (pytorch backend, CPU) with a dynamic batch and token counts.

Each model is exported with bounded (``Dim(..., max=...)``) and unbounded (``Dim.DYNAMIC``,
``Dim.AUTO``) batch and token dims, then run on batches of other sizes than the example and
compared with eager. The pytorch attention cuts the batch into chunks to bound its memory; a
small chunk budget makes it do so in the traced graph too. Saved programs are loaded in a
fresh process that imports only torch and tzrec_ops, as a server would; an AOTInductor
package of the ranking model is compiled and run in a fresh process as well.

Float32 with ``torch.testing.assert_close``'s default tolerances: an exported graph with a
symbolic batch may run attention one sequence at a time where eager batches it, which
changes the order of float sums, not the result beyond those tolerances.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from typing import Any, Callable, Dict, Iterator, List, Sequence, Tuple

import pytest
import torch
from torch.export import Dim

from tzrec_gr.models import HSTURanking, HSTURetrieval
from tzrec_ops.backends.pytorch import hstu_attention
from tzrec_ops.backends.pytorch.hstu_attention import set_use_fbgemm
from tzrec_ops.testing.aoti import run_package

NUM_ITEMS = 40
MAX_LEN = 12  # retrieval max_seq_len, ranking max_uih_len
MAX_TARGETS = 4
MAX_BATCH = 64
# with this budget one attention chunk holds one sequence and a few of its query rows
# (H = 2, N <= 18, A + V = 8: a sequence's upcast keys and values take up to 288 elements)
ONE_SEQUENCE_CHUNKS = 400

# history and candidate lengths per user of each batch; the first batch is the export example
BATCHES = [[5, 0, 12], [3, 9, 1, 12, 7, 2], [4, 6]]
CANDIDATES = [[2, 1, 4], [1, 4, 3, 2, 1, 1], [4, 1]]

Args = Tuple[Any, ...]


@pytest.fixture
def chunks() -> Iterator[Callable[[int], None]]:
    """Sets the pytorch attention's chunk budget for one test."""
    yield hstu_attention.set_chunk_elements
    hstu_attention.set_chunk_elements(None)


# ------------------------------------------------------------------------------- models


def _retrieval() -> HSTURetrieval:
    torch.manual_seed(0)
    model = HSTURetrieval(
        NUM_ITEMS, 8, num_layers=2, dropout_ratio=0.0, backend="pytorch", max_seq_len=MAX_LEN
    )
    return model.eval()


def _ranking() -> HSTURanking:
    torch.manual_seed(0)
    model = HSTURanking(
        NUM_ITEMS,
        4,
        8,
        [1, 2],
        [1, 2, 4],
        num_layers=2,
        contextual_feature_dim=3,
        max_contextual_seq_len=2,
        dropout_ratio=0.0,
        backend="pytorch",
        max_uih_len=MAX_LEN,
        max_targets=MAX_TARGETS,
    )
    return model.eval()


def _history(lengths: Sequence[int]) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(item ids [L], lengths [B], increasing timestamps [L])."""
    total = sum(lengths)
    ids = torch.randint(0, NUM_ITEMS, (total,))
    timestamps = 1000 + torch.cumsum(torch.randint(30, 4000, (total,)), 0)
    return ids, torch.tensor(lengths), timestamps


def _retrieval_args(batch: int) -> Args:
    return _history(BATCHES[batch])


def _ranking_args(batch: int) -> Args:
    ids, lengths, timestamps = _history(BATCHES[batch])
    targets = torch.tensor(CANDIDATES[batch])
    total = int(targets.sum())
    features = {
        "uih.item_id": ids,
        "uih.sequence_length": lengths,
        "uih_action.sequence": torch.randint(0, 8, ids.shape),
        "uih_timestamp.sequence": timestamps,
        "candidate.item_id": torch.randint(0, NUM_ITEMS, (total,)),
        "candidate.sequence_length": targets,
        "candidate_timestamp.sequence": torch.full((total,), int(timestamps[-1]) + 600),
        "contextual": torch.randn(lengths.shape[0], 6),
    }
    return (features,)


def _dims(kind: str) -> Tuple[Any, Any, Any]:
    """(batch, history tokens, candidate tokens) dims of this kind."""
    if kind == "bounded":
        return (
            Dim("batch", min=1, max=MAX_BATCH),
            Dim("uih_tokens", max=MAX_BATCH * MAX_LEN),
            Dim("candidate_tokens", max=MAX_BATCH * MAX_TARGETS),
        )
    unbounded = Dim.DYNAMIC if kind == "dynamic" else Dim.AUTO
    return unbounded, unbounded, unbounded


def _retrieval_shapes(kind: str) -> Tuple[Dict[int, Any], ...]:
    batch, tokens, _ = _dims(kind)
    return ({0: tokens}, {0: batch}, {0: tokens})


def _ranking_shapes(kind: str) -> Tuple[Dict[str, Dict[int, Any]]]:
    batch, uih, candidates = _dims(kind)
    return (
        {
            "uih.item_id": {0: uih},
            "uih.sequence_length": {0: batch},
            "uih_action.sequence": {0: uih},
            "uih_timestamp.sequence": {0: uih},
            "candidate.item_id": {0: candidates},
            "candidate.sequence_length": {0: batch},
            "candidate_timestamp.sequence": {0: candidates},
            "contextual": {0: batch, 1: Dim.STATIC},
        },
    )


MODELS = {
    "retrieval": (_retrieval, _retrieval_args, _retrieval_shapes),
    "ranking": (_ranking, _ranking_args, _ranking_shapes),
}


def _export(
    name: str, kind: str
) -> Tuple[torch.nn.Module, torch.export.ExportedProgram, List[Args]]:
    """(eager model, exported program, argument tuples of every batch in BATCHES)."""
    build, make_args, shapes = MODELS[name]
    model = build()
    torch.manual_seed(1)
    batches = [make_args(b) for b in range(len(BATCHES))]
    program = torch.export.export(model, batches[0], dynamic_shapes=shapes(kind))
    return model, program, batches


# -------------------------------------------------------------------------------- tests


def _check_batches(model: torch.nn.Module, run: Callable[..., Any], batches: List[Args]) -> None:
    for args in batches:
        torch.testing.assert_close(run(*args), model(*args))


@pytest.mark.parametrize(
    "kind, budget",
    [("bounded", None), ("bounded", ONE_SEQUENCE_CHUNKS), ("auto", None)],
    ids=["bounded", "bounded-chunked", "auto"],
)
@pytest.mark.parametrize("name", list(MODELS))
def test_exported_program_matches_eager_on_other_batch_sizes(name, kind, budget, chunks):
    chunks(budget)
    model, program, batches = _export(name, kind)
    _check_batches(model, program.module(), batches)


_LOADER = textwrap.dedent(
    """
    import sys
    import torch
    import tzrec_ops  # noqa: F401  (what a server imports besides torch)
    try:  # the pytorch backend's graphs hold fbgemm's jagged ops when it is installed
        import fbgemm_gpu  # noqa: F401
    except ImportError:
        pass

    folder = sys.argv[1]
    program = torch.export.load(folder + "/model.pt2").module()
    for args, expected in torch.load(folder + "/cases.pt"):
        torch.testing.assert_close(program(*args), expected)
    print("loaded and matched")
    """
)


@pytest.mark.parametrize("name", list(MODELS))
def test_saved_program_loads_in_a_fresh_process(name, tmp_path, chunks):
    """Unbounded dims and several attention chunks, saved and loaded by a new process."""
    chunks(ONE_SEQUENCE_CHUNKS)
    model, program, batches = _export(name, "dynamic")
    _check_batches(model, program.module(), batches)
    torch.export.save(program, str(tmp_path / "model.pt2"))
    torch.save([(args, model(*args)) for args in batches], tmp_path / "cases.pt")
    loaded = subprocess.run(
        [sys.executable, "-c", _LOADER, str(tmp_path)], capture_output=True, text=True
    )
    assert loaded.returncode == 0, loaded.stderr[-3000:]
    assert "loaded and matched" in loaded.stdout


def test_aoti_package_of_the_ranking_model_round_trips(tmp_path, chunks):
    """Bounded dims and several attention chunks (a while loop in the compiled package).
    About a minute on 2 CPU cores, most of it the C++ compile. fbgemm's jagged ops are
    kept out of the graph (when installed), so the package loads with torch alone."""
    chunks(ONE_SEQUENCE_CHUNKS)
    set_use_fbgemm(False)
    try:
        model, program, batches = _export("ranking", "bounded")
    finally:
        set_use_fbgemm(None)
    package = torch._inductor.aoti_compile_and_package(
        program, package_path=str(tmp_path / "ranking.pt2")
    )
    for args in batches[:2]:
        (got,) = run_package(package, args)
        torch.testing.assert_close(got, model(*args))
