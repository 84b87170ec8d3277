"""What every server of a model kind answers: the common protocol of
:class:`~tzrec_gr.serving.RankingServer` and :class:`~tzrec_gr.serving.RetrievalServer`.

Legend: B = users.

A server wraps one trained model and holds the serving around it: each kind's own tensor API
(``prefill``, ``score``, ``extend`` and the pure ``*_step`` functions ``torch.export``
records), and this protocol, which :class:`~tzrec_gr.serving.ServingSession` calls for a
request of :class:`~tzrec_gr.serving.Histories` (checked at the door,
:mod:`tzrec_gr.serving.inputs`, and encoded without checking them again). The session never
asks which kind it serves: what differs lives in the two subclasses.
"""

from __future__ import annotations

import abc
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from tzrec_gr.features import UIH_ITEM_ID, UIH_LENGTHS, UIH_TIMESTAMPS
from tzrec_gr.serving import transducer as cached
from tzrec_gr.serving._graphs import GraphPool, GraphSet
from tzrec_gr.serving.inputs import Histories
from tzrec_gr.stu import ServingCache
from tzrec_ops.jagged import to_device

__all__ = ["ModelServer"]

Features = Dict[str, torch.Tensor]


class ModelServer(abc.ABC):
    """The serving of one model (in eval mode, without gradients).

    Args:
        model (nn.Module): the trained model; the server serves it as it is (its device,
            dtype and mode are the caller's: the session moves it and sets eval mode).

    Attributes:
        model (nn.Module): as given.
        kind (str): ``"retrieval"`` or ``"ranking"``: a label for messages and output
            files, never a switch.
        model_name (str): the model class this kind serves (for messages).
        call (str): the session call this kind answers (``"recommend"`` or ``"score"``).
        answers (str): that call with its arguments (for messages).
        request_size (str): the :meth:`~tzrec_gr.serving.ServingSession.warm_up` size of
            that call (``"k"`` or ``"candidates"``).
        needs_actions (bool): histories carry action bitmasks.
        keeps_query_time (bool): a user's query time is kept between requests (the time
            its candidates are shown at by default).
    """

    kind: str = ""
    model_name: str = ""
    call: str = ""
    answers: str = ""
    request_size: str = ""
    needs_actions: bool = False
    keeps_query_time: bool = False

    def __init__(self, model: nn.Module) -> None:
        self.model = model

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

    @abc.abstractmethod
    def prefill_histories(self, histories: Histories, device: torch.device) -> ServingCache:
        """Encode histories checked by :meth:`check_histories` (not checked again)."""

    @abc.abstractmethod
    def extend_histories(
        self, cache: ServingCache, events: Histories, device: torch.device
    ) -> ServingCache:
        """``cache`` (of this model) with ``events`` appended, checked by
        :meth:`check_histories` with ``after`` and fitting :attr:`max_events`; only where
        :attr:`extends_incrementally`."""

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
