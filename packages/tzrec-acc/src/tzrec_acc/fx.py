"""FX symbolic tracing with leaf modules, and trace-time wrappers.

:func:`symbolic_trace` records a module's forward as a ``torch.fx.GraphModule``. Modules of
the leaf types are recorded as single ``call_module`` nodes instead of being traced
through: tzrec-gr's layers check their inputs with Python control flow on shapes, which a
symbolic trace cannot follow, so they are leaves by default. The tracer is torchrec's
(``torchrec.fx.Tracer``, which also knows torchrec's input types) when torchrec is
installed, ``torch.fx.Tracer`` otherwise.

The wrappers below run as plain functions in eager mode; in a trace each becomes one
``call_function`` node, so the graph keeps the call (for later passes) instead of the
Python it would run on a proxy:

* :func:`fx_arange`, :func:`fx_numel`, :func:`fx_int`: sizes and ranges computed from
  traced values;
* :func:`fx_unwrap_optional_tensor`: an ``Optional[Tensor]`` known to be set;
* :func:`mark_sparse`, :func:`mark_dense`, :func:`mark_keyed_tensor`: identities that name
  a value as the boundary between the sparse part (embedding lookups) and the dense part;
  :func:`tzrec_acc.passes.split_sparse_dense` cuts the graph there.

:class:`TraceableRanking` and :class:`TraceableRetrieval` are tzrec-gr's models'
forwards over plain tensors with the embedding lookups marked sparse: the models' own
``forward`` checks its inputs (raising clear errors in eager mode), which symbolic tracing
cannot run; check a batch in eager mode before serving a traced graph.
"""

from __future__ import annotations

from typing import Any, Dict, Iterable, Optional, Tuple, Type

import torch
from torch import nn

from tzrec_ops.extras import require

__all__ = [
    "MARKS",
    "TraceableRanking",
    "TraceableRetrieval",
    "WRAPPERS",
    "default_leaf_modules",
    "fx_arange",
    "fx_int",
    "fx_numel",
    "fx_unwrap_optional_tensor",
    "mark_dense",
    "mark_keyed_tensor",
    "mark_sparse",
    "symbolic_trace",
    "traceable",
]


def fx_arange(end: Any, device: Optional[torch.device] = None) -> torch.Tensor:
    """``torch.arange(end)`` (int64), with ``end`` a traced size."""
    return torch.arange(end, device=device)


def fx_unwrap_optional_tensor(value: Optional[torch.Tensor]) -> torch.Tensor:
    """``value``, which must not be None."""
    if value is None:
        raise ValueError("expected a tensor, got None")
    return value


def fx_int(value: Any) -> int:
    """``int(value)`` of a traced scalar (reads a tensor's value on the host)."""
    return int(value)


def fx_numel(value: torch.Tensor) -> int:
    """``value.numel()`` of a traced tensor."""
    return value.numel()


def mark_sparse(name: str, value: torch.Tensor) -> torch.Tensor:
    """``value``, named ``name`` as an output of the sparse part (an embedding lookup)."""
    return value


def mark_dense(name: str, value: torch.Tensor) -> torch.Tensor:
    """``value``, named ``name`` as an input of the dense part that the sparse part does
    not compute (it stays an input of the dense graph)."""
    return value


def mark_keyed_tensor(name: str, value: Any, sparse: bool = True) -> Any:
    """``value`` (a torchrec ``KeyedTensor`` or a ``Dict[str, Tensor]``), named as a sparse
    output (``sparse=True``) or a dense input."""
    return value


WRAPPERS = (
    fx_arange,
    fx_unwrap_optional_tensor,
    fx_int,
    fx_numel,
    mark_sparse,
    mark_dense,
    mark_keyed_tensor,
)
# the boundary marks, for passes
MARKS = (mark_sparse, mark_dense, mark_keyed_tensor)

# Calls written as ``tzrec_acc.fx.<name>(...)`` become nodes because torch.fx patches these
# names in this module while it traces (registration only: nothing changes outside a trace);
# calls through a name imported elsewhere become nodes through the tracer's autowrap list.
for _wrapper in WRAPPERS:
    torch.fx.wrap(_wrapper.__name__)
del _wrapper


def default_leaf_modules() -> Tuple[Type[nn.Module], ...]:
    """tzrec-gr's modules that check inputs with Python control flow (none without it)."""
    try:
        from tzrec_gr.hstu_transducer import HSTUTransducer
        from tzrec_gr.layers import LayerNorm, Linear, SwishLayerNorm
        from tzrec_gr.stu import STU
    except ImportError:
        return ()
    return (HSTUTransducer, STU, Linear, LayerNorm, SwishLayerNorm)


def _features() -> Any:
    """:mod:`tzrec_gr.features`, the feature keys of tzrec-gr's models."""
    return require("tzrec_gr.features", "tzrec-acc[gr]", "tracing tzrec-gr models")


def _base_tracer() -> Tuple[type, bool]:
    """(torchrec's tracer class, True) when torchrec imports, else (torch.fx.Tracer, False)."""
    try:
        from torchrec.fx.tracer import Tracer
    except ImportError:
        return torch.fx.Tracer, False
    return Tracer, True


def _make_tracer(leaves: Tuple[Type[nn.Module], ...]) -> torch.fx.Tracer:
    base, is_torchrec = _base_tracer()

    class LeafTracer(base):  # type: ignore[misc, valid-type]
        def is_leaf_module(self, m: nn.Module, qualified_name: str) -> bool:
            return isinstance(m, leaves) or super().is_leaf_module(m, qualified_name)

    if is_torchrec:
        tracer = LeafTracer(leaf_modules=[t.__name__ for t in leaves])
        # torchrec's constructor takes no autowrap list; torch.fx keeps it in this set
        tracer._autowrap_function_ids.update(id(f) for f in WRAPPERS)
        return tracer
    return LeafTracer(autowrap_functions=WRAPPERS)


def symbolic_trace(
    root: nn.Module,
    leaf_modules: Iterable[Type[nn.Module]] = (),
    concrete_args: Optional[Dict[str, Any]] = None,
) -> torch.fx.GraphModule:
    """Trace ``root.forward`` into a GraphModule.

    Args:
        root: the module.
        leaf_modules: more module types to keep as single nodes (added to
            :func:`default_leaf_modules`).
        concrete_args: arguments fixed for the trace (e.g. ``{"contextual": None}``).
    """
    extra = tuple(leaf_modules)
    bad = [t for t in extra if not (isinstance(t, type) and issubclass(t, nn.Module))]
    if bad:
        raise TypeError(f"leaf_modules must be nn.Module subclasses, got {bad!r}")
    tracer = _make_tracer(default_leaf_modules() + extra)
    graph = tracer.trace(root, concrete_args)
    name = type(root).__name__
    return torch.fx.GraphModule(tracer.root, graph, name)


class TraceableRanking(nn.Module):
    """``HSTURanking.forward`` over plain tensors, embedding lookups marked sparse.

    Call Args: the ranking batch's features in the order of :meth:`keys`
    (``uih.item_id``, ``uih.sequence_length``, ``uih_action.sequence``,
    ``uih_timestamp.sequence``, ``candidate.item_id``, ``candidate.sequence_length``,
    ``candidate_timestamp.sequence``), then ``contextual`` (None for a model without
    contextual features).
    """

    #: the server's :attr:`~tzrec_gr.serving.ModelServer.trace_forward` this form records
    FORWARD = "candidate_logits"

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    @staticmethod
    def keys() -> Tuple[str, ...]:
        """The feature keys of the call's tensor arguments before ``contextual``, in order
        (named by :mod:`tzrec_gr.features`)."""
        f = _features()
        return (
            f.UIH_ITEM_ID,
            f.UIH_LENGTHS,
            f.UIH_ACTIONS,
            f.UIH_TIMESTAMPS,
            f.CANDIDATE_ITEM_ID,
            f.CANDIDATE_LENGTHS,
            f.CANDIDATE_TIMESTAMPS,
        )

    @classmethod
    def inputs(cls, batch: Dict[str, torch.Tensor]) -> Tuple[Optional[torch.Tensor], ...]:
        """The call arguments for a ranking batch (a dict of features)."""
        return (*(batch[k] for k in cls.keys()), batch.get(_features().CONTEXTUAL))

    def forward(
        self,
        uih_ids: torch.Tensor,
        uih_lengths: torch.Tensor,
        uih_actions: torch.Tensor,
        uih_timestamps: torch.Tensor,
        candidate_ids: torch.Tensor,
        candidate_lengths: torch.Tensor,
        candidate_timestamps: torch.Tensor,
        contextual: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        model, f = self.model, _features()
        cand = mark_sparse(f.CANDIDATE_SEQUENCE, model.item_embeddings(candidate_ids))
        features = {
            f.UIH_ITEM_ID: uih_ids,
            f.UIH_LENGTHS: uih_lengths,
            f.UIH_ACTIONS: uih_actions,
            f.UIH_TIMESTAMPS: uih_timestamps,
            f.UIH_SEQUENCE: mark_sparse(f.UIH_SEQUENCE, model.item_embeddings(uih_ids)),
            f.CANDIDATE_ITEM_ID: candidate_ids,
            f.CANDIDATE_LENGTHS: candidate_lengths,
            f.CANDIDATE_TIMESTAMPS: candidate_timestamps,
            f.CANDIDATE_SEQUENCE: cand,
        }
        if contextual is not None:
            features[f.CONTEXTUAL] = mark_dense(f.CONTEXTUAL, contextual)
        out = model.transducer(features, model.max_uih_len, model.max_targets)
        return model.head(out.candidate_embeddings, cand)


class TraceableRetrieval(nn.Module):
    """``HSTURetrieval.forward(item_ids, lengths, timestamps)``, the lookup marked sparse."""

    #: the server's :attr:`~tzrec_gr.serving.ModelServer.trace_forward` this form records
    FORWARD = "event_embeddings"

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(
        self, item_ids: torch.Tensor, lengths: torch.Tensor, timestamps: torch.Tensor
    ) -> torch.Tensor:
        model, f = self.model, _features()
        features = {
            f.UIH_SEQUENCE: mark_sparse(f.UIH_SEQUENCE, model.item_embeddings(item_ids)),
            f.UIH_LENGTHS: lengths,
            f.UIH_TIMESTAMPS: timestamps,
        }
        return model.transducer(features, model.max_seq_len).full_embeddings


#: the traceable forms, each found by its FORWARD
_FORMS = (TraceableRanking, TraceableRetrieval)


def traceable(model: nn.Module) -> nn.Module:
    """The traceable form of a tzrec-gr model: the form whose ``FORWARD`` is its server's
    :attr:`~tzrec_gr.serving.ModelServer.trace_forward` (:class:`TraceableRanking` of an
    ``HSTURanking``, :class:`TraceableRetrieval` of an ``HSTURetrieval`` or of a subclass).

    Raises:
        TypeError: a model without a traceable form here (naming those with one).
    """
    require("tzrec_gr.serving", "tzrec-acc[gr]", "tracing tzrec-gr models")  # their servers
    from tzrec_gr.models.registry import get_model, model_names
    from tzrec_gr.serving.server import server_factory, server_for

    forms = {form.FORWARD: form for form in _FORMS}
    try:
        forward = server_for(model).trace_forward
    except TypeError:  # a model no server serves
        forward = ""
    if forward in forms:
        return forms[forward](model)
    classes = sorted(get_model(name).model_class.__name__ for name in model_names()
                     if getattr(server_factory(name), "trace_forward", "") in forms)
    raise TypeError(
        f"model must be one of tzrec_gr.models.{', '.join(classes)}, got "
        f"{type(model).__module__}.{type(model).__qualname__}"
    )
