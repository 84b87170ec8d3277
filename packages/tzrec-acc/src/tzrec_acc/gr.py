"""What export needs to know about tzrec-gr's models, in one place.

Legend: B = users, T = cached tokens, L_u / L_t = history / candidate tokens.

* :func:`model_kind` names the supported models (``HSTURanking``, ``HSTURetrieval``);
* :func:`sample_inputs` makes a synthetic batch a model takes (for parity checks, the CLI's
  ``run`` and the benchmarks);
* :func:`dynamic_shapes` gives ``torch.export`` a dynamic users dim and dynamic token dims;
* :func:`item_table` is a retrieval model's catalogue as its top-K scores it (the
  L2-normalized item embeddings), which ``export`` writes beside a retrieval package;
* :class:`RankingServingStep` / :class:`RetrievalServingStep` are the cached serving forms
  (``RankingServer.score`` / ``RetrievalServer.extend(update_cache=False)`` of
  :mod:`tzrec_gr.serving`) as modules, so that they export: their ``forward`` puts the
  cache back together from its tensors and calls the server's pure step
  (``RankingServer.score_step``, ``RetrievalServer.event_embeddings_step``) at the model's
  bounds, where the methods over a ``ServingCache`` read the new tokens' longest length on
  the host (the new tokens are
  padded to the bound inside the graph, which changes no output). The exported call takes
  the cache's tensors rather than the ``ServingCache`` pytree, so that a package runs where
  tzrec-gr is not imported.

tzrec-gr is imported by the functions that need it (``tzrec-acc[gr]``).
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

import torch
from torch import nn
from torch.export import Dim

from tzrec_ops.extras import require

__all__ = [
    "SUPPORTED_MODELS",  # noqa: F822 (module __getattr__: a view of the model registry)
    "RankingServingStep",
    "RetrievalServingStep",
    "dynamic_shapes",
    "item_table",
    "model_kind",
    "sample_inputs",
    "serving_step",
]

Args = Tuple[Any, ...]


def _serving() -> Any:
    """:mod:`tzrec_gr.serving`, the servers and the cache."""
    return require("tzrec_gr.serving", "tzrec-acc[gr]", "exporting tzrec-gr models")


def __getattr__(name: str) -> Any:
    if name == "SUPPORTED_MODELS":  # a view of the model registry, not a list of its own
        return _supported()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _supported() -> Tuple[str, ...]:
    """The class names of the registered models a server serves, sorted."""
    server = require("tzrec_gr.serving.server", "tzrec-acc[gr]", "exporting tzrec-gr models")
    return tuple(sorted(server.servable_models()))


def _server(model: nn.Module) -> Any:
    """The model's server (:func:`tzrec_gr.serving.server_for`): what export asks about the
    model; TypeError naming the supported models for any other model."""
    try:
        return _serving().server_for(model)
    except TypeError:
        raise TypeError(
            f"model must be one of tzrec_gr.models.{', '.join(_supported())}, "
            f"got {type(model).__module__}.{type(model).__qualname__}"
        ) from None


def model_kind(model: nn.Module) -> str:
    """``"ranking"`` or ``"retrieval"`` (its server's ``kind``, a label); TypeError for a
    model no server serves."""
    return _server(model).kind


def _check_positive(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")


def sample_inputs(
    model: nn.Module,
    batch: int = 4,
    history: Optional[int] = None,
    candidates: Optional[int] = None,
    seed: int = 0,
    device: Optional[torch.device] = None,
) -> Args:
    """A synthetic batch for ``model`` (the positional arguments of its ``forward``).

    Args:
        model: an ``HSTURanking`` or ``HSTURetrieval``.
        batch: B users.
        history: the longest history; lengths are uniform in [0.9 * history, history].
            Default: the model's bound.
        candidates: ranking only, the most candidates per user (lengths uniform in
            [1, candidates], the first user's ``candidates - 1``). Default: the model's
            ``max_targets``.
        seed: the generator's seed (the same seed gives the same batch).
        device: where the tensors go. Default: the CPU.
    """
    return _server(model).example_inputs(batch, history, candidates, seed, device)


def item_table(model: nn.Module, chunk_size: int = 65536) -> torch.Tensor:
    """[I, E] a retrieval model's catalogue as its retrieval scores it: each item's
    ``model.item_embedding`` (the L2-normalized row of its table, in the model's dtype and
    with its quantized table when quantized), on the model's device, without gradients.

    ``tzrec_gr.serving.ServingSession.recommend`` ranks a user's embedding against these
    rows; a retrieval package holds only the user tower, so ``export`` writes this table
    beside it for :class:`tzrec_acc.serving.PackageSession`.

    Args:
        model: an ``HSTURetrieval``.
        chunk_size: items embedded at a time. Default: 65536.

    Raises:
        TypeError: ``model`` is not a retrieval model.
    """
    table = _server(model).item_table(chunk_size)
    if table is None:
        raise TypeError(
            f"item_table needs an HSTURetrieval, got {type(model).__name__} (a ranking "
            "model scores candidates, it has no catalogue top-K)"
        )
    return table


def _dims(model: nn.Module, max_batch: int) -> Tuple[Dim, Dim, Dim]:
    """(users, history tokens, candidate tokens), bounded by the model's bounds."""
    _check_positive("max_batch", max_batch)
    server = _server(model)
    per_user = server.max_events
    # a dim's upper bound must be at least 2 for torch.export to keep it symbolic
    users = Dim("users", min=1, max=max(2, max_batch))
    history = Dim("history_tokens", max=max(2, max_batch * per_user))
    targets = max(1, server.max_candidates)  # a model that scores no candidates: 1
    return users, history, Dim("candidate_tokens", max=max(2, max_batch * targets))


def dynamic_shapes(model: nn.Module, args: Args, max_batch: int = 256) -> Any:
    """``dynamic_shapes`` for ``torch.export.export(model, args, ...)``: a dynamic number of
    users (1 to ``max_batch``) and of history and candidate tokens (up to the model's
    per-user bounds times ``max_batch``)."""
    users, history, targets = _dims(model, max_batch)
    return _server(model).forward_shapes(args, users, history, targets)


# ------------------------------------------------------------------ cached serving forms


class _ServingStep(nn.Module):
    """A server's pure step as a module (what ``torch.export`` takes), over the cache's
    tensors.

    The servers' steps take a ``tzrec_gr.serving.ServingCache`` whole (a pytree), but an
    AOTInductor package whose inputs hold one can only be called where tzrec-gr is
    imported (its input spec names the class), so the exported call takes the cache as
    :data:`CACHE_FIELDS` tensors: :meth:`cache_arguments` and :meth:`cache` are the one
    place that takes a cache apart and puts it back together.
    """

    #: the cache's tensors, in the order of the call's first arguments
    CACHE_FIELDS: Tuple[str, ...] = ("keys", "values", "offsets", "lengths")
    #: the server's pure step this module calls (``ModelServer.export_step``)
    STEP: str = ""

    @classmethod
    def for_export(cls, model: nn.Module, new: int) -> "_ServingStep":
        """The step of ``model`` taking at most ``new`` new tokens per user."""
        return cls(model)

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        if model.training:
            raise ValueError("model must be in eval mode for serving; call model.eval() first")
        self.model = model  # the weights the step reads, registered for export
        self.server = _serving().server_for(model)
        self.eval()

    @classmethod
    def cache_arguments(cls, cache: Any) -> Args:
        """The call's cache arguments: ``cache``'s :data:`CACHE_FIELDS`."""
        return tuple(getattr(cache, name) for name in cls.CACHE_FIELDS)

    @classmethod
    def cache(cls, *tensors: Any) -> Any:
        """The ``ServingCache`` of the call's cache arguments (its ``max_len`` None: the
        model's ``max_cached_len`` bounds it, as an exported step needs)."""
        return _serving().ServingCache(**dict(zip(cls.CACHE_FIELDS, tensors, strict=True)))


class RankingServingStep(_ServingStep):
    """``RankingServer.score(cache, candidates)`` over plain tensors
    (``RankingServer.score_step`` with the candidates padded to ``max_targets``).

    Call Args:
        keys, values (Tuple[torch.Tensor, ...]): each STU layer's cached keys / values
            [T, H * A] (``cache.keys``, ``cache.values``).
        offsets (torch.Tensor): [B + 1] int64 offsets of the cached tokens.
        lengths (torch.Tensor): [B] int64 cached tokens per user.
        query_time (torch.Tensor | None): [B] the cache's time anchor.
        contextual (torch.Tensor | None): [B, C * Fc] the cache's contextual features.
        candidates (Dict[str, torch.Tensor]): ``candidate.*`` features as for ``score``.

    Returns:
        torch.Tensor: [L_t, K] logits, as ``score`` gives.
    """

    CACHE_FIELDS = (*_ServingStep.CACHE_FIELDS, "query_time", "contextual")
    STEP = "score_step"

    @classmethod
    def inputs(cls, cache: Any, candidates: Dict[str, torch.Tensor]) -> Args:
        """The call arguments for a cache from ``prefill`` and a candidate batch."""
        return (*cls.cache_arguments(cache), candidates)

    def forward(
        self,
        keys: Tuple[torch.Tensor, ...],
        values: Tuple[torch.Tensor, ...],
        offsets: torch.Tensor,
        lengths: torch.Tensor,
        query_time: Optional[torch.Tensor],
        contextual: Optional[torch.Tensor],
        candidates: Dict[str, torch.Tensor],
    ) -> torch.Tensor:
        cache = self.cache(keys, values, offsets, lengths, query_time, contextual)
        return self.server.score_step(cache, candidates)


class RetrievalServingStep(_ServingStep):
    """``RetrievalServer.extend(cache, ..., update_cache=False)[0]`` over plain tensors
    (``RetrievalServer.event_embeddings_step`` with the new events padded to ``max_new``):
    the user embedding after each new event, the cache unchanged.

    Call Args:
        keys, values, offsets, lengths: the cache, as for :class:`RankingServingStep`.
        item_ids (torch.Tensor): [L'] the new events' items.
        new_lengths (torch.Tensor): [B] new events per user, at most ``max_new``.
        timestamps (torch.Tensor): [L'] their timestamps.

    Returns:
        torch.Tensor: [L', E].
    """

    STEP = "event_embeddings_step"

    @classmethod
    def for_export(cls, model: nn.Module, new: int) -> "_ServingStep":
        return cls(model, new)

    def __init__(self, model: nn.Module, max_new: int) -> None:
        _check_positive("max_new", max_new)
        super().__init__(model)
        self.max_new = max_new

    @classmethod
    def inputs(
        cls, cache: Any, item_ids: torch.Tensor, lengths: torch.Tensor, timestamps: torch.Tensor
    ) -> Args:
        """The call arguments for a cache from ``prefill`` and a batch of new events."""
        return (*cls.cache_arguments(cache), item_ids, lengths, timestamps)

    def forward(
        self,
        keys: Tuple[torch.Tensor, ...],
        values: Tuple[torch.Tensor, ...],
        offsets: torch.Tensor,
        lengths: torch.Tensor,
        item_ids: torch.Tensor,
        new_lengths: torch.Tensor,
        timestamps: torch.Tensor,
    ) -> torch.Tensor:
        cache = self.cache(keys, values, offsets, lengths)
        return self.server.event_embeddings_step(
            cache, item_ids, new_lengths, timestamps, self.max_new
        )


def serving_step(
    model: nn.Module, history: int, new: int, batch: int = 4, seed: int = 0, max_batch: int = 256
) -> Tuple[nn.Module, Args, Any]:
    """The cached serving form of ``model``, call arguments for it and their dynamic shapes.

    The cache holds ``history``-event histories (the server's ``prefill`` of a sample
    batch); the step scores ``new`` candidates per user (ranking) or runs ``new`` appended
    events per user (retrieval).

    Returns:
        (the step module, its call arguments, ``dynamic_shapes`` for ``torch.export``).
    """
    server = _server(model)
    _check_positive("new", new)
    server.check_step_sizes(history, new)
    device = next(model.parameters()).device
    # new candidates per user (a model that scores none ignores them, its new are events)
    args = sample_inputs(model, batch, history, new, seed, device)
    users, tokens, news = _dims(model, max_batch)
    cache, request, request_shapes = server.step_example(args, new, seed, users, news, max_batch)
    step = _step_class(server).for_export(model, new)
    kv_dims = ({0: tokens},) * len(cache.keys)  # the cache's keys and values are tuples
    shapes = (kv_dims, kv_dims, {0: users + 1}, {0: users}, *request_shapes)
    return step, step.inputs(cache, *request), shapes


def _step_class(server: Any) -> type:
    """The step module that calls the server's :attr:`export_step` (a
    :class:`RankingServingStep` calls ``score_step``, a :class:`RetrievalServingStep`
    ``event_embeddings_step``)."""
    for cls in (RankingServingStep, RetrievalServingStep):
        if cls.STEP == server.export_step:
            return cls
    raise TypeError(f"{type(server).__name__} has no serving step that export can export")
