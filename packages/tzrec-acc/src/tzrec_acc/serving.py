"""One serving API over a training checkpoint and an exported package.

Legend: B = users, K = items returned (``recommend``) or tasks (``score``), I = catalogue
items, E = embedding width, L = history events of all users.

:func:`load_session` opens either kind of model file::

    session = load_session("runs/retrieval/best.pt")   # a tzrec_gr.serving.ServingSession
    session = load_session("retrieval.pt2")            # a PackageSession
    top = session.recommend(Histories.from_lists([[3, 5, 8], [1]]), k=10)

* a checkpoint (``best.pt``, a tzrec-bench run's folder, any name not ending in ``.pt2``) gives
  :meth:`tzrec_gr.serving.ServingSession.from_checkpoint`: ``recommend`` / ``score``,
  per-user state (``open`` / ``extend`` / ``close``), CUDA graphs;
* a package (``.pt2``) written by ``python -m tzrec_acc export --form full`` (an AOTInductor
  package, ``--format aoti``, or a saved exported program, ``fx`` / ``trt``) gives a
  :class:`PackageSession` with the same ``score(histories, candidates)`` (ranking) and
  ``recommend(histories, k, exclude_seen=True)`` (retrieval) calls. A full package re-encodes
  the whole histories on every call: it keeps no per-user state, so ``open`` / ``extend`` /
  ``close`` raise and name the checkpoint route.

A retrieval package is the user tower only (the user embedding after every history event);
``export`` writes the catalogue beside it (``PACKAGE.items.pt``: the L2-normalized item
embeddings, :func:`tzrec_acc.gr.item_table`, in the exported model's dtype), and
``recommend`` ranks each user's embedding after its newest event against it with
:func:`tzrec_gr.serving.catalogue_topk`, as ``ServingSession.recommend`` does.

Ids: both sessions take and return the model's item ids (rows ``0..N-1``) and carry the
training data's :class:`tzrec_gr.vocabulary.IdVocabularies` as ``session.vocabularies``
(None for a checkpoint without one): the checkpoint's, or for a package
the one ``export`` stored in its sample file. Raw ids go through it at the door::

    histories = Histories.from_raw(session.vocabularies, [["sku-3", "sku-5"]], [[10, 20]])
    session.recommend(histories, k=10).raw_ids(session.vocabularies)   # raw ids per user

tzrec-gr (``tzrec-acc[gr]``) is imported when a session is loaded, not by this module.
"""

from __future__ import annotations

import pathlib
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch
from torch.utils import _pytree as pytree

from tzrec_ops.extras import require

__all__ = [
    "PACKAGE_SUFFIX",
    "PackageSession",
    "items_path",
    "load_session",
    "predict_limits",
    "sample_path",
]

#: the suffix that makes :func:`load_session` read a file as a package
PACKAGE_SUFFIX = ".pt2"

#: the dynamic dims a package must have been exported with to serve any batch
_DYNAMIC = ("users", "tokens")

PathLike = Union[str, pathlib.Path]
Device = Optional[Union[torch.device, str]]


def _gr(module: str) -> Any:
    return require(f"tzrec_gr.{module}", "tzrec-acc[gr]", "serving a tzrec-gr model")


def sample_path(package: PathLike) -> str:
    """``PACKAGE.sample.pt``: the file ``export`` writes beside a package (the sample
    batches, the eager outputs, the package kind and what serving needs of the model)."""
    return str(package) + ".sample.pt"


def items_path(package: PathLike) -> str:
    """``PACKAGE.items.pt``: the catalogue ``export`` writes beside a retrieval package
    ([I, E] item embeddings as the model's top-K scores them)."""
    return str(package) + ".items.pt"


def load_session(
    path: PathLike,
    *,
    device: Device = None,
    chunk_size: int = 65536,
    backend: Optional[str] = None,
) -> Any:
    """A serving session over a training checkpoint or an exported package.

    Args:
        path: a tzrec-bench checkpoint (``best.pt``, or a run's folder: its ``best.pt``,
            else ``checkpoint.pt``), or a package (``.pt2``) written by
            ``python -m tzrec_acc export --form full`` (with ``PACKAGE.sample.pt`` beside
            it, and ``PACKAGE.items.pt`` for a retrieval model).
        device: where to serve. A checkpoint: default the CPU. A package runs where it was
            exported for (``export --device``); default that device, and another one is
            refused.
        chunk_size (int): catalogue items scored at a time by ``recommend``. Default: 65536.
        backend (str | None): checkpoints only: the ops backend to build the model with.
            Default: the saved one.

    Returns:
        tzrec_gr.serving.ServingSession | PackageSession: both answer
        ``recommend(histories, k, exclude_seen=True)`` (retrieval) and
        ``score(histories, candidates)`` (ranking).

    Raises:
        FileNotFoundError: no file at ``path`` (or a package without its sample file).
        ValueError: a file that is not such a checkpoint or package, a package that cannot
            serve (named why), a bad option.
        ImportError: tzrec-gr is not installed (``tzrec-acc[gr]``).
    """
    path = pathlib.Path(path)
    if path.suffix == PACKAGE_SUFFIX:
        if backend is not None:
            raise ValueError(
                f"backend applies to checkpoints; {path} is a package, whose ops were "
                "fixed at export"
            )
        return PackageSession(path, device=device, chunk_size=chunk_size)
    return _gr("serving").ServingSession.from_checkpoint(
        path, device=device, backend=backend, chunk_size=chunk_size
    )


def predict_limits(session: Any) -> Any:
    """The :class:`tzrec_gr.serving.files.Limits` of a session from :func:`load_session`
    (what a row must fit for ``predict``: kind, catalogue size, events per user, and for
    ranking the candidates, contextual width and task names)."""
    if isinstance(session, PackageSession):
        return session.limits
    return _gr("serving.files").session_limits(session)


def _limits(served: Dict[str, Any]) -> Any:
    """The :class:`tzrec_gr.serving.files.Limits` of a package's ``served`` entry: its
    kind, catalogue and bound, and what its server's ``package_fields`` stored (a field a
    server does not store keeps the default: a package of a model that scores no
    candidates stores no ``max_candidates``)."""
    return _gr("serving.files").Limits(
        served["model"],
        served["num_items"],
        served["max_events"],
        served.get("max_candidates", 0),
        served.get("contextual_width", 0),
        tuple(f"task_{i}" for i in range(served.get("num_tasks", 0))),
    )


def _slice(value: Optional[torch.Tensor], start: int, stop: int) -> Optional[torch.Tensor]:
    return None if value is None else value[start:stop]


class PackageSession:
    """A ``--form full`` package of ``python -m tzrec_acc export`` as a serving session.

    Answers the stateless calls of :class:`tzrec_gr.serving.ServingSession` from the
    package, in batches of at most the package's ``--max-batch`` users:
    ``score(histories, candidates)`` for a ranking package and
    ``recommend(histories, k, exclude_seen=True)`` for a retrieval package (with the
    catalogue ``export`` wrote beside it). Inputs are checked on the host against the
    model's catalogue and bounds (stored at export) before the package runs; they are
    moved to the package's device and cast to the dtypes it was exported with.

    Args:
        path: the package (``.pt2``), with ``PACKAGE.sample.pt`` (and, retrieval,
            ``PACKAGE.items.pt``) beside it.
        device: the device to serve on: the package's own (``export --device``); None
            takes it.
        chunk_size (int): catalogue items scored at a time by ``recommend``. Default: 65536.

    Attributes:
        kind (str): ``"retrieval"`` or ``"ranking"``.
        device (torch.device): where the package runs.
        max_batch (int): users per package call, at most (``export --max-batch``).
        limits (tzrec_gr.serving.files.Limits): what ``predict``'s rows must fit.
        package_kind (str): ``"aoti"`` (AOTInductor) or ``"program"`` (a saved exported
            program: ``fx`` or ``trt``).
        vocabularies (tzrec_gr.vocabulary.IdVocabularies | None): the raw ids of the
            model's training data, stored by ``export`` in the sample file (None: exported
            from a checkpoint without one).

    Raises:
        FileNotFoundError: no package or sample file.
        ValueError: a package that cannot serve, named why: a ``--form serving`` package
            (it needs a prefill cache), one exported with static dims, a sample file that
            does not describe the model, a retrieval package without its catalogue, a
            device other than the package's, a bad ``chunk_size``.
    """

    def __init__(self, path: PathLike, *, device: Device = None, chunk_size: int = 65536) -> None:
        if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
            raise ValueError(f"chunk_size must be an int >= 1, got {chunk_size!r}")
        path = pathlib.Path(path)
        self.path = path
        self.chunk_size = chunk_size
        if not path.is_file():
            raise FileNotFoundError(f"no package at {path}")
        sample_file = pathlib.Path(sample_path(path))
        if not sample_file.is_file():
            raise FileNotFoundError(
                f"no file at {sample_file} (write both with python -m tzrec_acc export)"
            )
        sample: Dict[str, Any] = torch.load(sample_file, weights_only=False)
        served = sample.get("served")
        if served is None:
            raise ValueError(
                f"{sample_file} does not describe the model (no 'served' entry): it is not "
                "the sample file of a package export wrote; export it again, or serve the "
                "checkpoint"
            )
        if served["form"] != "full":
            raise ValueError(
                f"{path} is a --form {served['form']} package: it scores against a cache "
                "that only the model's prefill makes; export --form full to serve a "
                "package, or serve the checkpoint (load_session('best.pt'))"
            )
        if set(served["dynamic"]) != set(_DYNAMIC):
            raise ValueError(
                f"{path} was exported with --dynamic {','.join(served['dynamic']) or 'none'}"
                ": it takes the sample batch's shapes only; export it with --dynamic "
                "users,tokens"
            )
        self.kind: str = served["model"]  # a label, for messages
        if _gr("serving.files").predict_kind(self.kind).takes_k and "items" not in served:
            raise ValueError(
                f"{path} is a {self.kind} package without the item table that top-K "
                "needs (its sample file names no PACKAGE.items.pt); export it again, or "
                "serve the checkpoint (load_session('best.pt'))"
            )
        self.limits = _limits(served)
        vocabulary = _gr("vocabulary")
        try:
            self.vocabularies = vocabulary.IdVocabularies.from_payload(sample, str(sample_file))
        except vocabulary.VocabularyError as exc:
            raise ValueError(str(exc)) from exc
        if self.vocabularies is not None and len(self.vocabularies.items) != self.limits.num_items:
            raise ValueError(
                f"{sample_file}: its item vocabulary has {len(self.vocabularies.items)} ids but "
                f"the model {self.limits.num_items} items; export the package again"
            )
        self.max_batch: int = int(served["max_batch"])
        self.package_kind: str = sample["kind"]
        self._example: Tuple[Any, ...] = tuple(sample["batches"][0])
        tensors = [t for t in pytree.tree_leaves(self._example) if isinstance(t, torch.Tensor)]
        self.device = tensors[0].device if tensors else torch.device("cpu")
        if device is not None and torch.device(device) != self.device:
            raise ValueError(
                f"device {device} differs from the package's ({self.device}): a package runs "
                "where it was exported for; export it again with --device, or serve the "
                "checkpoint on that device"
            )
        self._items: Optional[torch.Tensor] = None
        if self.limits.predicts.takes_k:  # its top-K ranks the catalogue export wrote
            table_file = path.parent / served["items"]
            if not table_file.is_file():
                raise FileNotFoundError(
                    f"no file at {table_file}: the catalogue that export wrote beside the "
                    f"{self.kind} package {path}; copy it with the package, or export again"
                )
            items = torch.load(table_file, map_location="cpu", weights_only=True)
            if not isinstance(items, torch.Tensor) or items.shape[:1] != (self.limits.num_items,):
                raise ValueError(
                    f"{table_file} must hold the [{self.limits.num_items}, E] item table, "
                    f"got {getattr(items, 'shape', type(items).__name__)}"
                )
            self._items = items.to(self.device)
        for module in sample["imports"]:
            __import__(module)
        if self.package_kind == "aoti":
            self._run = torch._inductor.aoti_load_package(str(path))
        else:
            self._run = torch.export.load(str(path)).module()

    # -- public API -----------------------------------------------------------------------

    @torch.no_grad()
    def score(self, users: Any, candidates: Any) -> torch.Tensor:
        """Per-task probabilities of each user's candidates (ranking packages).

        ``sigmoid`` of the package's logits for the histories followed by the candidates,
        which are shown at each user's query time (``histories.query_time``, default the
        newest event's time) unless they carry their own timestamps: what
        ``ServingSession.score`` gives for the same model, up to rounding.

        Args:
            users (tzrec_gr.serving.Histories): the users' histories (a package keeps no
                opened users).
            candidates: :class:`tzrec_gr.serving.Candidates`, a [B, T] integer tensor, or
                one id list per user (at most the model's ``max_targets`` each).

        Returns:
            torch.Tensor: float32 [L_t, K] in input order, or [B, T, K] for a [B, T]
            tensor, on the CPU.

        Raises:
            TypeError: a retrieval package, or user ids instead of histories.
            ValueError: a bad history or candidate (named, with the user's row), a
                different number of users in the two, candidate timestamps with a
                ``query_time`` (the package anchors time at the candidates).
        """
        self._require("ranking", "score", "recommend(histories, k)")
        serving = _gr("serving")
        histories = self._histories("score", users)
        dense = isinstance(candidates, torch.Tensor)
        if isinstance(candidates, serving.Candidates):
            cands = candidates
        elif dense:
            cands = serving.Candidates.from_dense(candidates)
        else:
            cands = serving.Candidates.from_lists(candidates)
        if cands.batch_size != histories.batch_size:
            raise ValueError(
                f"candidates are for {cands.batch_size} users but users has "
                f"{histories.batch_size}; they must match"
            )
        self._check(histories)
        cands.check(self.limits.num_items, self.limits.max_candidates)
        lengths = cands.lengths.detach().cpu().to(torch.int64)
        timestamps = cands.timestamps
        if timestamps is None:
            query_time = (
                histories.newest_timestamps()
                if histories.query_time is None
                else histories.query_time.detach().cpu().to(torch.int64)
            )
            timestamps = query_time.repeat_interleave(lengths)
        elif histories.query_time is not None:
            raise ValueError(
                "candidates have timestamps and histories a query_time: a full package "
                "anchors time at each user's newest token, it takes no separate query "
                "time; drop one of them, or serve the checkpoint (load_session('best.pt'))"
            )
        keys = _gr("features")
        h_off, c_off = histories.offsets, cands.offsets
        probs = []
        for start, stop in self._batches(histories.batch_size):
            hs, he = int(h_off[start]), int(h_off[stop])
            cs, ce = int(c_off[start]), int(c_off[stop])
            batch = {
                keys.UIH_ITEM_ID: histories.item_ids[hs:he],
                keys.UIH_LENGTHS: histories.lengths[start:stop],
                keys.UIH_ACTIONS: _slice(histories.actions, hs, he),
                keys.UIH_TIMESTAMPS: histories.timestamps[hs:he],
                keys.CANDIDATE_ITEM_ID: cands.item_ids[cs:ce],
                keys.CANDIDATE_LENGTHS: lengths[start:stop],
                keys.CANDIDATE_TIMESTAMPS: timestamps[cs:ce],
                keys.CONTEXTUAL: _slice(histories.contextual, start, stop),
            }
            (example,) = self._example
            missing = [k for k in example if batch.get(k) is None]
            if missing:
                raise ValueError(
                    f"the package takes {sorted(example)}; these users' batch has no "
                    f"{missing} (give histories.{missing[0].split('.')[-1]})"
                )
            args = {k: self._like(batch[k], v) for k, v in example.items()}
            out = self._run(args)
            logits = out[0] if isinstance(out, (list, tuple)) else out
            probs.append(torch.sigmoid(logits.float()).cpu())
        result = torch.cat(probs)
        if dense:
            return result.reshape(cands.batch_size, -1, result.shape[-1])
        return result

    @torch.no_grad()
    def recommend(self, users: Any, k: int = 10, *, exclude_seen: bool = True) -> Any:
        """The top-``k`` items of the catalogue for each user (retrieval packages).

        Each user's embedding after its newest event (the package's output row at the
        user's last event) ranked against the catalogue stored at export with
        :func:`tzrec_gr.serving.catalogue_topk`, in the catalogue's dtype: what
        ``ServingSession.recommend`` gives for the same model, up to rounding.

        Args:
            users (tzrec_gr.serving.Histories): the users' histories (a package keeps no
                opened users).
            k (int): items per user, in ``[1, num_items]``.
            exclude_seen (bool): never return an item of the user's history. Default: True.

        Returns:
            tzrec_gr.serving.TopK: ``ids`` [B, k] and ``scores`` [B, k] (cosines) on the
            package's device, best first, ties by smaller id; ``-1`` / ``-inf`` fill the
            slots of a user with fewer than ``k`` unseen items.

        Raises:
            TypeError: a ranking package, or user ids instead of histories.
            ValueError: a bad history (named, with the user's row) or ``k``.
        """
        self._require("retrieval", "recommend", "score(histories, candidates)")
        histories = self._histories("recommend", users)
        num_items = self.limits.num_items
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= num_items:
            raise ValueError(f"k must be an int in [1, num_items={num_items}], got {k!r}")
        self._check(histories)
        offsets = histories.offsets
        ids_like, lengths_like, times_like = self._example
        rows: List[torch.Tensor] = []
        for start, stop in self._batches(histories.batch_size):
            hs, he = int(offsets[start]), int(offsets[stop])
            lengths = histories.lengths[start:stop]
            out = self._run(
                self._like(histories.item_ids[hs:he], ids_like),
                self._like(lengths, lengths_like),
                self._like(histories.timestamps[hs:he], times_like),
            )
            embeddings = out[0] if isinstance(out, (list, tuple)) else out  # [L, E]
            last = (offsets[start + 1 : stop + 1] - hs - 1).to(embeddings.device)
            rows.append(embeddings[last])  # every history has an event (checked)
        assert self._items is not None
        users_emb = torch.cat(rows).to(self._items.dtype)
        return _gr("serving").catalogue_topk(
            users_emb,
            self._items,
            k,
            exclude=(histories.item_ids, offsets) if exclude_seen else None,
            chunk_size=self.chunk_size,
        )

    def open(self, user_ids: Any, histories: Any) -> None:
        """Not possible from a package: see :meth:`extend`."""
        self._stateless("open")

    def extend(self, user_ids: Any, events: Any) -> None:
        """Not possible from a package: a ``--form full`` package re-encodes whole
        histories on every call and keeps no per-user state (``open`` / ``extend`` /
        ``close``); serve the checkpoint (``load_session("best.pt")``) for that.

        Raises:
            TypeError: always, naming the checkpoint route.
        """
        self._stateless("extend")

    def close(self, user_ids: Any) -> None:
        """Not possible from a package: see :meth:`extend`."""
        self._stateless("close")

    @property
    def item_embeddings(self) -> Optional[torch.Tensor]:
        """[I, E] the catalogue ``recommend`` ranks against (retrieval; None for ranking)."""
        return self._items

    def __repr__(self) -> str:
        return (
            f"PackageSession({str(self.path)!r}, kind={self.kind!r}, "
            f"package_kind={self.package_kind!r}, device={str(self.device)!r}, "
            f"max_batch={self.max_batch})"
        )

    # -- internals ------------------------------------------------------------------------

    def _stateless(self, call: str) -> None:
        raise TypeError(
            f"{call} is not possible from a package: {self.path} re-encodes whole histories "
            "on every call and keeps no per-user state; pass Histories to "
            f"{self._answers}, or serve the training "
            "checkpoint (tzrec_acc.serving.load_session('best.pt'), a ServingSession) to "
            "open, extend and close users"
        )

    @property
    def _answers(self) -> str:
        """The call this package answers: ``recommend`` where its predictions are the
        top-k of the catalogue, else ``score`` (of candidates)."""
        return "recommend" if self.limits.predicts.takes_k else "score"

    def _require(self, kind: str, call: str, other: str) -> None:
        """TypeError unless this package answers ``call`` (of a ``kind`` package)."""
        if self._answers != call:
            raise TypeError(
                f"{call} needs a {kind} package; {self.path} is a {self.kind} package, which "
                f"answers {other}"
            )

    def _histories(self, call: str, users: Any) -> Any:
        serving = _gr("serving")
        if not isinstance(users, serving.Histories):
            raise TypeError(
                f"{call} from a package takes Histories, got {type(users).__name__}: a "
                "package keeps no opened users; serve the training checkpoint "
                "(tzrec_acc.serving.load_session('best.pt')) to call it with user ids"
            )
        if users.batch_size == 0:
            raise ValueError(f"{call}: users is empty; give at least one user")
        return users

    def _check(self, histories: Any) -> None:
        """``histories`` against the model: ids, order, actions / contextual, bound."""
        limits = self.limits
        histories.check(
            limits.num_items,
            needs_actions="actions" in limits.predicts.columns,
            contextual_width=limits.contextual_width,
        )
        lengths = histories.offsets[1:] - histories.offsets[:-1]
        if bool((lengths > limits.max_events).any()):
            b = int((lengths > limits.max_events).nonzero()[0, 0])
            raise ValueError(
                f"histories of user {b} has {int(lengths[b])} events, more than the model "
                f"takes ({limits.max_events}); keep the newest {limits.max_events}"
            )

    def _batches(self, users: int) -> Sequence[Tuple[int, int]]:
        return [(s, min(s + self.max_batch, users)) for s in range(0, users, self.max_batch)]

    def _like(self, value: torch.Tensor, example: torch.Tensor) -> torch.Tensor:
        return value.to(device=example.device, dtype=example.dtype)
