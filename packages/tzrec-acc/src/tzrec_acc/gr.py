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
    "SUPPORTED_MODELS",
    "RankingServingStep",
    "RetrievalServingStep",
    "dynamic_shapes",
    "item_table",
    "model_kind",
    "sample_inputs",
    "serving_step",
]

SUPPORTED_MODELS = ("HSTURanking", "HSTURetrieval")

Args = Tuple[Any, ...]


def _models() -> Any:
    return require("tzrec_gr.models", "tzrec-acc[gr]", "exporting tzrec-gr models")


def _serving() -> Any:
    """:mod:`tzrec_gr.serving`, the servers and the cache."""
    return require("tzrec_gr.serving", "tzrec-acc[gr]", "exporting tzrec-gr models")


def _keys() -> Any:
    """:mod:`tzrec_gr.features`, the feature keys."""
    return require("tzrec_gr.features", "tzrec-acc[gr]", "exporting tzrec-gr models")


def _history_keys() -> Tuple[str, ...]:
    keys = _keys()
    return (keys.UIH_ITEM_ID, keys.UIH_LENGTHS, keys.UIH_ACTIONS, keys.UIH_TIMESTAMPS)


def _candidate_keys() -> Tuple[str, ...]:
    keys = _keys()
    return (keys.CANDIDATE_ITEM_ID, keys.CANDIDATE_LENGTHS, keys.CANDIDATE_TIMESTAMPS)


def model_kind(model: nn.Module) -> str:
    """``"ranking"`` or ``"retrieval"``; TypeError for any other model."""
    models = _models()
    if isinstance(model, models.HSTURanking):
        return "ranking"
    if isinstance(model, models.HSTURetrieval):
        return "retrieval"
    raise TypeError(
        f"model must be one of tzrec_gr.models.{', '.join(SUPPORTED_MODELS)}, "
        f"got {type(model).__module__}.{type(model).__qualname__}"
    )


def _lengths(users: int, longest: int, generator: torch.Generator) -> torch.Tensor:
    """[B] lengths uniform in [ceil(0.9 * longest), longest] (all ``longest`` when small)."""
    low = max(0, -(-9 * longest // 10))
    return torch.randint(low, longest + 1, (users,), generator=generator)


def _new_lengths(users: int, most: int, generator: torch.Generator) -> torch.Tensor:
    """[B] lengths uniform in [1, most], the first user's ``most - 1``: an example batch
    where every user has ``most`` would let torch.export specialize the padded serving
    path away (and tie the token count to the users)."""
    lengths = torch.randint(1, most + 1, (users,), generator=generator)
    lengths[0] = most - 1
    return lengths


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
    kind = model_kind(model)
    bound = model.max_uih_len if kind == "ranking" else model.max_seq_len
    history = bound if history is None else history
    _check_positive("batch", batch)
    _check_positive("history", history)
    if history > bound:
        raise ValueError(f"history ({history}) must be <= the model's bound ({bound})")
    gen = torch.Generator().manual_seed(seed)
    lengths = _lengths(batch, history, gen)
    total = int(lengths.sum())
    ids = torch.randint(0, model.num_items, (total,), generator=gen)
    timestamps = 1_000_000 + torch.cumsum(torch.randint(30, 4000, (total,), generator=gen), 0)
    if kind == "retrieval":
        return tuple(t.to(device) for t in (ids, lengths, timestamps))
    candidates = model.max_targets if candidates is None else candidates
    _check_positive("candidates", candidates)
    if candidates > model.max_targets:
        raise ValueError(
            f"candidates ({candidates}) must be <= the model's max_targets ({model.max_targets})"
        )
    targets = _new_lengths(batch, candidates, gen)
    n = int(targets.sum())
    pre = model.transducer.input_preprocessor
    keys = _keys()
    features = {
        keys.UIH_ITEM_ID: ids,
        keys.UIH_LENGTHS: lengths,
        keys.UIH_ACTIONS: torch.randint(0, 256, (total,), generator=gen),
        keys.UIH_TIMESTAMPS: timestamps,
        keys.CANDIDATE_ITEM_ID: torch.randint(0, model.num_items, (n,), generator=gen),
        keys.CANDIDATE_LENGTHS: targets,
        keys.CANDIDATE_TIMESTAMPS: torch.full((n,), int(timestamps.max()) + 600),
    }
    width = pre.contextual_seq_len() * pre.contextual_feature_dim
    if width:
        features[keys.CONTEXTUAL] = torch.randn(batch, width, generator=gen)
    return ({k: v.to(device) for k, v in features.items()},)


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
    if model_kind(model) != "retrieval":
        raise TypeError(
            f"item_table needs an HSTURetrieval, got {type(model).__name__} (a ranking "
            "model scores candidates, it has no catalogue top-K)"
        )
    _check_positive("chunk_size", chunk_size)
    device = next(model.parameters()).device
    with torch.no_grad():
        rows = [
            model.item_embedding(
                torch.arange(start, min(start + chunk_size, model.num_items), device=device)
            )
            for start in range(0, model.num_items, chunk_size)
        ]
    return torch.cat(rows)


def _dims(model: nn.Module, max_batch: int) -> Tuple[Dim, Dim, Dim]:
    """(users, history tokens, candidate tokens), bounded by the model's bounds."""
    _check_positive("max_batch", max_batch)
    kind = model_kind(model)
    per_user = model.max_uih_len if kind == "ranking" else model.max_seq_len
    # a dim's upper bound must be at least 2 for torch.export to keep it symbolic
    users = Dim("users", min=1, max=max(2, max_batch))
    history = Dim("history_tokens", max=max(2, max_batch * per_user))
    targets = model.max_targets if kind == "ranking" else 1
    return users, history, Dim("candidate_tokens", max=max(2, max_batch * targets))


def dynamic_shapes(model: nn.Module, args: Args, max_batch: int = 256) -> Any:
    """``dynamic_shapes`` for ``torch.export.export(model, args, ...)``: a dynamic number of
    users (1 to ``max_batch``) and of history and candidate tokens (up to the model's
    per-user bounds times ``max_batch``)."""
    users, history, targets = _dims(model, max_batch)
    if model_kind(model) == "retrieval":
        return ({0: history}, {0: users}, {0: history})
    (features,) = args
    keys = _keys()
    shapes: Dict[str, Any] = {}
    for key in features:
        if key in (keys.UIH_LENGTHS, keys.CANDIDATE_LENGTHS, keys.QUERY_TIME):
            shapes[key] = {0: users}
        elif key == keys.CONTEXTUAL:
            shapes[key] = {0: users, 1: Dim.STATIC}
        elif key in _candidate_keys():
            shapes[key] = {0: targets}
        else:
            shapes[key] = {0: history}
    return (shapes,)


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


def _ranking_request(
    model: nn.Module, args: Args, users: Dim, candidates: Dim
) -> Tuple[nn.Module, Any, Args, Any]:
    """(step, cache of the sample's histories, the candidates, the dims of the step's
    arguments after the cache's tensors) for ranking."""
    (features,) = args
    keys = _keys()
    history = {k: v for k, v in features.items() if k in (*_history_keys(), keys.CONTEXTUAL)}
    batch = features[keys.UIH_LENGTHS].shape[0]
    query_time = features[keys.CANDIDATE_TIMESTAMPS].max().repeat(batch)
    cache = _serving().RankingServer(model).prefill(history, query_time)
    request = {k: features[k] for k in _candidate_keys()}
    shapes = (
        None if cache.query_time is None else {0: users},
        None if cache.contextual is None else {0: users, 1: Dim.STATIC},
        {k: {0: users} if k == keys.CANDIDATE_LENGTHS else {0: candidates} for k in request},
    )
    return RankingServingStep(model), cache, (request,), shapes


def _retrieval_request(
    model: nn.Module, args: Args, users: Dim, events: Dim, new: int, seed: int
) -> Tuple[nn.Module, Any, Args, Any]:
    """(step, cache of the sample's histories, ``new`` events per user at most, their dims)
    for retrieval."""
    ids, lengths, timestamps = args
    cache = _serving().RetrievalServer(model).prefill(ids, lengths, timestamps)
    gen = torch.Generator().manual_seed(seed + 1)
    new_lengths = _new_lengths(lengths.shape[0], new, gen)
    total = int(new_lengths.sum())
    new_ids = torch.randint(0, model.num_items, (total,), generator=gen)
    new_ts = int(timestamps.max()) + torch.arange(1, total + 1) * 60
    request = tuple(t.to(ids.device) for t in (new_ids, new_lengths, new_ts))
    return RetrievalServingStep(model, new), cache, request, ({0: events}, {0: users}, {0: events})


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
    kind = model_kind(model)
    _check_positive("new", new)
    if kind == "retrieval" and history + new > model.max_seq_len:
        raise ValueError(
            f"history + new ({history} + {new}) must be <= the model's max_seq_len "
            f"({model.max_seq_len})"
        )
    device = next(model.parameters()).device
    args = sample_inputs(model, batch, history, new if kind == "ranking" else None, seed, device)
    users, tokens, news = _dims(model, max_batch)
    if kind == "ranking":
        step, cache, request, request_shapes = _ranking_request(model, args, users, news)
    else:
        new_events = Dim("new_tokens", max=max(2, max_batch * new))
        step, cache, request, request_shapes = _retrieval_request(
            model, args, users, new_events, new, seed
        )
    kv_dims = ({0: tokens},) * len(cache.keys)  # the cache's keys and values are tuples
    shapes = (kv_dims, kv_dims, {0: users + 1}, {0: users}, *request_shapes)
    return step, step.inputs(cache, *request), shapes
