"""What every server of a model kind answers: the common protocol of
:class:`~tzrec_gr.serving.RankingServer` and :class:`~tzrec_gr.serving.RetrievalServer`.

Legend: B = users.

A server wraps one trained model and holds the serving around it: each kind's own tensor API
(``prefill``, ``score``, ``extend`` and the pure ``*_step`` functions ``torch.export``
records), and this protocol, which :class:`~tzrec_gr.serving.ServingSession` calls for a
request of :class:`~tzrec_gr.serving.Histories` (checked at the door,
:mod:`tzrec_gr.serving.inputs`, and encoded without checking them again). The session never
asks which kind it serves: what differs lives in the two subclasses.

Which server serves a model is the model registry's business
(:mod:`tzrec_gr.models.registry`): :func:`server_for` finds the model's record (by its class,
or the nearest registered base class) and builds the server its record names
(:attr:`ModelRecord.server <tzrec_gr.models.registry.ModelRecord>`), or else the one
registered here for the record's name with :func:`register_server`. The models stand below
serving and cannot name their servers: tzrec-gr's own servers register themselves here
(at the bottom of :mod:`.ranking` and :mod:`.retrieval`); a model plugin, which stands above
serving, may put its server in its record or register it here.
"""

from __future__ import annotations

import abc
import threading
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from tzrec_gr.features import UIH_ITEM_ID, UIH_LENGTHS, UIH_TIMESTAMPS
from tzrec_gr.models.registry import (
    ModelRecord,
    ModelRegistryError,
    get_model,
    model_names,
    record_for_class,
)
from tzrec_gr.serving import transducer as cached
from tzrec_gr.serving._graphs import GraphPool, GraphSet
from tzrec_gr.serving._rows import Limits
from tzrec_gr.serving.inputs import Histories
from tzrec_gr.stu import ServingCache
from tzrec_ops.jagged import to_device

__all__ = [
    "ModelServer",
    "ServerFactory",
    "check_positive",
    "example_lengths",
    "example_new_lengths",
    "register_server",
    "servable_models",
    "server_factory",
    "server_for",
]

Features = Dict[str, torch.Tensor]
#: builds the server of a model instance (a :class:`ModelServer` subclass is one)
ServerFactory = Callable[[nn.Module], "ModelServer"]

_SERVERS: Dict[str, ServerFactory] = {}  # a record's name -> its server factory
_LOCK = threading.Lock()


def register_server(model: str, factory: ServerFactory) -> None:
    """Serve the registered model named ``model`` with ``factory`` (used where the model's
    record has no :attr:`~tzrec_gr.models.registry.ModelRecord.server`; registering the
    same factory again does nothing).

    Raises:
        ValueError: another factory serves that model already.
    """
    if not callable(factory):
        raise ValueError(f"the server of model {model!r} must be callable, got {factory!r}")
    with _LOCK:
        if _SERVERS.get(model, factory) is not factory:
            raise ValueError(
                f"model {model!r} is served by {_SERVERS[model]!r} already; cannot serve it "
                f"with {factory!r}"
            )
        _SERVERS[model] = factory


def _record(model: nn.Module) -> Optional[ModelRecord]:
    """The record of ``model``'s class or of its nearest registered base class."""
    for cls in type(model).__mro__:
        if isinstance(cls, type) and issubclass(cls, nn.Module) and cls is not nn.Module:
            try:
                return record_for_class(cls)
            except ModelRegistryError:
                continue
    return None


def _servable() -> List[str]:
    """The class names of the registered models a server serves, in the registry's order."""
    records = [get_model(name) for name in model_names()]
    return [r.model_class.__name__ for r in records if r.server or r.name in _SERVERS]


def server_factory(name: str) -> Optional[ServerFactory]:
    """What builds the server of the registered model named ``name`` (its record's
    :attr:`~tzrec_gr.models.registry.ModelRecord.server`, else the registered one); None:
    the model is not served. A :class:`ModelServer` subclass's facts can be read from it
    without a model instance."""
    record = get_model(name)
    return record.server or _SERVERS.get(record.name)


def servable_models() -> List[str]:
    """The class names of the registered models that a server serves, in the registry's
    order."""
    return _servable()


def _article(name: str) -> str:
    """"an" before a vowel or an acronym (an HSTURanking), else "a"."""
    return "an" if name[:1] in "AEIOU" or name[:2].isupper() else "a"


def server_for(model: nn.Module) -> "ModelServer":
    """The server of ``model``: what its record in the model registry names (e.g. a
    :class:`~tzrec_gr.serving.RetrievalServer` for an HSTURetrieval, a
    :class:`~tzrec_gr.serving.RankingServer` for an HSTURanking).

    Raises:
        TypeError: ``model`` is of no registered model with a server.
    """
    record = _record(model)
    factory = None if record is None else server_factory(record.name)
    if factory is None:
        names = " or ".join(f"{_article(name)} {name}" for name in _servable())
        raise TypeError(f"model must be {names}, got {type(model).__name__}")
    return factory(model)


def check_positive(name: str, value: int) -> None:
    """ValueError unless ``value`` is an int >= 1 (not a bool)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")


def example_lengths(users: int, longest: int, generator: torch.Generator) -> torch.Tensor:
    """[B] lengths uniform in [ceil(0.9 * longest), longest] (all ``longest`` when small)."""
    low = max(0, -(-9 * longest // 10))
    return torch.randint(low, longest + 1, (users,), generator=generator)


def example_new_lengths(users: int, most: int, generator: torch.Generator) -> torch.Tensor:
    """[B] lengths uniform in [1, most], the first user's ``most - 1``: an example batch
    where every user has ``most`` would let torch.export specialize the padded serving
    path away (and tie the token count to the users)."""
    lengths = torch.randint(1, most + 1, (users,), generator=generator)
    lengths[0] = most - 1
    return lengths


class ModelServer(abc.ABC):
    """The serving of one model (in eval mode, without gradients).

    Args:
        model (nn.Module): the trained model; the server serves it as it is (its device,
            dtype and mode are the caller's: the session moves it and sets eval mode).

    Attributes:
        model (nn.Module): as given.
        kind (str): ``"retrieval"`` or ``"ranking"``: a label for messages and output
            files, never a switch.
        model_class (type | None): the model class this server serves (its subclasses
            too; the constructor refuses anything else); a plugin's server subclasses a
            tzrec-gr server and names its own class here. None: no check.
        model_name (str): that class's name (for messages).
        call (str): the session call this kind answers (``"recommend"`` or ``"score"``).
        answers (str): that call with its arguments (for messages).
        request_size (str): the :meth:`~tzrec_gr.serving.ServingSession.warm_up` size of
            that call (``"k"`` or ``"candidates"``).
        needs_actions (bool): histories carry action bitmasks.
        keeps_query_time (bool): a user's query time is kept between requests (the time
            its candidates are shown at by default).
    """

    kind: str = ""
    model_class: Optional[type] = None
    model_name: str = ""
    call: str = ""
    answers: str = ""
    request_size: str = ""
    needs_actions: bool = False
    keeps_query_time: bool = False

    def __init__(self, model: nn.Module) -> None:
        if self.model_class is not None and not isinstance(model, self.model_class):
            raise TypeError(f"{type(self).__name__} serves {self.model_name} models, got "
                            f"{type(model).__name__}")
        self.model = model

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.model_class is not None:
            cls.model_name = cls.model_class.__name__

    # -- the model's sizes ----------------------------------------------------------------

    @property
    def owner_id(self) -> int:
        """The ``owner`` of the caches this model builds (its transducer's)."""
        return self.model.transducer.owner_id

    @property
    def time_encoded(self) -> bool:
        """Whether the model encodes time (its caches then hold each user's query time)."""
        return self.model.transducer.time_encoded

    @property
    def dtype(self) -> torch.dtype:
        """The model's parameter dtype."""
        return next(self.model.parameters()).dtype

    @property
    @abc.abstractmethod
    def max_events(self) -> int:
        """The most events of one user the model takes."""

    @property
    def contextual_width(self) -> int:
        """C * Fc, the width of a user's contextual features (0 without them)."""
        return 0

    @property
    @abc.abstractmethod
    def extends_incrementally(self) -> bool:
        """Whether new events can run against kept keys and values alone (exactly what
        prefilling the longer history gives); False: re-encode the longer history."""

    def warm_up_length(self, events: int) -> int:
        """The ``lengths`` size of :meth:`~tzrec_gr.serving.ServingSession.warm_up` of a
        user with ``events`` events: the items it has seen."""
        return events

    @property
    def max_candidates(self) -> int:
        """The most candidates of one user the model scores (0: it scores none, it ranks
        the whole catalogue)."""
        return 0

    # -- export (tzrec-acc asks these rather than the model's kind) ----------------------

    #: the pure step the exported serving form (``tzrec_acc export --form serving``) calls,
    #: e.g. ``"score_step"``; "" where the model has none
    export_step: str = ""
    #: the forward over plain tensors that tzrec-acc's FX tracing records
    #: (``tzrec_acc.fx.traceable``): ``"candidate_logits"`` (a ranking batch's features ->
    #: each candidate's task logits) or ``"event_embeddings"`` (histories -> each event's
    #: embedding); "" where the model has none
    trace_forward: str = ""

    def example_inputs(
        self,
        batch: int = 4,
        history: Optional[int] = None,
        candidates: Optional[int] = None,
        seed: int = 0,
        device: Optional[torch.device] = None,
    ) -> Tuple[Any, ...]:
        """A synthetic batch for the model: the positional arguments of its ``forward``
        (``tzrec_acc.gr.sample_inputs``).

        Args:
            batch: B users.
            history: the longest history; lengths are uniform in [0.9 * history, history].
                Default: :attr:`max_events`.
            candidates: the most candidates per user, where the model scores candidates
                (ignored by one that scores none). Default: :attr:`max_candidates`.
            seed: the generator's seed (the same seed gives the same batch).
            device: where the tensors go. Default: the CPU.

        Raises:
            ValueError: a size below 1 or above the model's bound.
        """
        raise NotImplementedError(f"{type(self).__name__} makes no example inputs")

    def forward_shapes(
        self, args: Tuple[Any, ...], users: Any, history: Any, candidates: Any
    ) -> Any:
        """``dynamic_shapes`` of the model's ``forward`` for ``args`` (from
        :meth:`example_inputs`), given the ``torch.export`` dims of the users, the history
        tokens and the candidate tokens."""
        raise NotImplementedError(f"{type(self).__name__} has no export shapes")

    def step_example(
        self, args: Tuple[Any, ...], new: int, seed: int, users: Any, candidates: Any,
        max_batch: int,
    ) -> Tuple[ServingCache, Tuple[Any, ...], Tuple[Any, ...]]:
        """(the cache of ``args``' histories, the call arguments of :attr:`export_step`
        after the cache, their ``dynamic_shapes``) for exporting the serving form.

        Args:
            args: from :meth:`example_inputs` with at most ``new`` candidates per user.
            new: the most new tokens (candidates or appended events) per user.
            seed: the seed ``args`` were made with.
            users, candidates: the ``torch.export`` dims of the users and the candidate
                tokens.
            max_batch: the most users of a call.
        """
        raise NotImplementedError(f"{type(self).__name__} has no exported serving step")

    def check_step_sizes(self, history: int, new: int) -> None:
        """Check that ``history`` events then ``new`` tokens fit the model's serving step.

        Raises:
            ValueError: they do not.
        """
        return None

    def _example_histories(
        self, batch: int, history: Optional[int], seed: int
    ) -> Tuple[torch.Generator, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(the generator, [B] lengths, [L] item ids, [L] timestamps) of an example batch's
        histories (:meth:`example_inputs`)."""
        bound = self.max_events
        history = bound if history is None else history
        check_positive("batch", batch)
        check_positive("history", history)
        if history > bound:
            raise ValueError(f"history ({history}) must be <= the model's bound ({bound})")
        gen = torch.Generator().manual_seed(seed)
        lengths = example_lengths(batch, history, gen)
        total = int(lengths.sum())
        ids = torch.randint(0, self.model.num_items, (total,), generator=gen)
        timestamps = 1_000_000 + torch.cumsum(torch.randint(30, 4000, (total,), generator=gen), 0)
        return gen, lengths, ids, timestamps

    def item_table(self, chunk_size: int = 65536) -> Optional[torch.Tensor]:
        """[I, E] the catalogue the model's top-K ranks against, on the model's device and
        without gradients (``export`` writes it beside a package); None: the model ranks no
        catalogue (it scores candidates).

        Raises:
            ValueError: ``chunk_size`` is not an int >= 1.
        """
        return None

    def package_fields(self) -> Dict[str, int]:
        """What an exported package's sample file records of the model for serving it,
        besides its kind, its catalogue size and the catalogue's file (the ``served``
        entry; ``tzrec_acc.serving.PackageSession`` reads it)."""
        return {"max_events": int(self.max_events)}

    def predict_limits(self, tasks: Optional[Sequence[str]] = None) -> Limits:
        """The :class:`~tzrec_gr.serving.files.Limits` a row of predictions from files must
        fit (:func:`~tzrec_gr.serving.files.session_limits`).

        Args:
            tasks: a name per task for the output columns, where the predictions have a
                column per task (ignored by a server whose predictions have none).
        """
        return Limits(self.kind, self.model.num_items, self.max_events)

    def check_cache(self, cache: Optional[ServingCache]) -> None:
        """Serving needs eval mode, and a cache this model built (None: no cache).

        Raises:
            RuntimeError: the model is in training mode.
            ValueError: the cache was built by another model.
        """
        cached.check_cache(self.model.transducer, cache)

    # -- requests of Histories (the session) ---------------------------------------------

    def check_histories(
        self,
        histories: Histories,
        *,
        allow_empty: bool = False,
        contextual: bool = True,
        after: Optional[List[Optional[int]]] = None,
    ) -> None:
        """Check a request's ``histories`` on the host against the model
        (:meth:`Histories.check <tzrec_gr.serving.Histories.check>`).

        Args:
            histories (Histories): the request's histories.
            allow_empty (bool): users may have no events (appended events).
            contextual (bool): require the contextual features (whole histories).
            after: per user, the newest timestamp kept (appended events); None: whole
                histories, which must also fit :attr:`max_events`.

        Raises:
            TypeError: ``histories`` is not a :class:`Histories`.
            ValueError: a bad history (named, with the user's row).
        """
        if not isinstance(histories, Histories):
            raise TypeError(f"histories must be a Histories, got {type(histories).__name__}")
        histories.check(
            self.model.num_items,
            allow_empty=allow_empty,
            needs_actions=self.needs_actions,
            contextual_width=self.contextual_width if contextual else 0,
            after=after,
            max_events=self.max_events if after is None else None,
        )

    def history_features(self, histories: Histories, device: torch.device) -> Features:
        """The ``uih.*`` features of checked ``histories`` on ``device`` (the lengths' host
        copy kept; actions only where the model reads them)."""
        return {
            UIH_ITEM_ID: histories.item_ids.to(device),
            UIH_LENGTHS: to_device(histories.lengths.detach().cpu().to(torch.int64), device),
            UIH_TIMESTAMPS: histories.timestamps.to(device),
        }

    def request_times(self, histories: Histories) -> Optional[torch.Tensor]:
        """[B] CPU the users' query times to keep (:attr:`keeps_query_time`), else None."""
        return histories.query_times() if self.keeps_query_time else None

    @torch.no_grad()
    def prefill_histories(self, histories: Histories, device: torch.device) -> ServingCache:
        """Encode histories checked by :meth:`check_histories` (not checked again): their
        features, contextual features (where given) and query times (where the model
        :attr:`keeps_query_time`; else None) moved to ``device``, through :meth:`encode`."""
        contextual = histories.contextual
        times = self.request_times(histories)
        return self.encode(
            self.history_features(histories, device),
            None if contextual is None else contextual.to(device),
            None if times is None else times.to(device),
        )

    @abc.abstractmethod
    def encode(
        self,
        features: Features,
        contextual: Optional[torch.Tensor],
        query_time: Optional[torch.Tensor],
    ) -> ServingCache:
        """:meth:`prefill_histories` of histories already on the device: ``features`` the
        ``uih.*`` features (actions where :attr:`needs_actions`; the lengths' host copy
        known), ``contextual`` [B, C * Fc] (or None), ``query_time`` [B] (or None where
        the model anchors no time gaps on it). Reads nothing on the host, so a CUDA graph
        can capture it (:mod:`._encode_graphs`)."""

    @abc.abstractmethod
    def extend_histories(
        self, cache: ServingCache, events: Histories, device: torch.device
    ) -> ServingCache:
        """``cache`` (of this model) with ``events`` appended, checked by
        :meth:`check_histories` with ``after`` and fitting :attr:`max_events`; only where
        :attr:`extends_incrementally`."""

    #: the server has the pure incremental step :meth:`extend_features` (with
    #: :attr:`user_embedding_width`), which the session's extend graphs capture; a
    #: server without it (a plugin's may extend incrementally by other means) extends eager
    has_extend_step: bool = False

    @property
    def user_embedding_width(self) -> int:
        """The width of the user embedding its caches keep (where :attr:`has_extend_step`)."""
        raise NotImplementedError(f"{type(self).__name__} has no incremental extend step")

    def extend_features(
        self,
        cache: ServingCache,
        features: Features,
        max_events: int,
        new_lengths: Optional[torch.Tensor] = None,
    ) -> ServingCache:
        """:meth:`extend_histories`' cache, the new events given as the model's features on
        the device; reads nothing on the host (where :attr:`has_extend_step`).

        Args:
            new_lengths (torch.Tensor | None): [B] the real new events per user where
                ``features`` give every user the same number, padded at the end (a
                graph's buffers). None: the features' lengths are the real ones.
        """
        raise NotImplementedError(f"{type(self).__name__} has no incremental extend step")

    @abc.abstractmethod
    def cuda_graphs(
        self,
        *,
        device: torch.device,
        pool: GraphPool,
        batch_buckets: Sequence[int],
        length_buckets: Optional[Sequence[int]],
        candidate_buckets: Optional[Sequence[int]],
        max_graphs: int,
        chunk_size: int,
        catalogue: Callable[[], torch.Tensor],
        strict: bool,
    ) -> Tuple[Optional[GraphSet], str]:
        """The CUDA graphs of this kind's session call: (the graph set, "") or (None, why
        not).

        Args:
            device, pool, batch_buckets, length_buckets, candidate_buckets, max_graphs,
                chunk_size: the session's.
            catalogue: returns the session's [I, E] catalogue (the same tensor each time).
            strict (bool): ``cuda_graphs="on"``: raise where graphs cannot be used.
        """
