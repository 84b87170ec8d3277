"""Small graph passes over ``torch.fx.GraphModule``s; each returns what it did.

They compose, e.g. for a serving split::

    gm = fx.symbolic_trace(fx.traceable(model))
    sparse, dense = split_sparse_dense(gm)       # cut at the sparse marks
    eliminate_dead_code(dense)                   # the lookups are dead in the dense part
    prune_unused_attributes(dense)               # ... and so are the embedding tables

* :func:`eliminate_dead_code`: drop nodes whose results nothing uses;
* :func:`prune_unused_attributes`: drop parameters, buffers and submodules no node uses;
* :func:`split_sparse_dense`: the sparse part (up to :func:`tzrec_acc.fx.mark_sparse`
  marks) and the dense part (the rest, taking the marked values as inputs);
* :class:`OperatorMap` / :func:`map_operators`: replace the targets of ``call_function``
  nodes through a table callers extend (e.g. a ``tzrec_ops::`` op of one backend by
  another backend's), on traced or exported (``ExportedProgram.module()``) graphs.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Set, Tuple

import torch
from torch import fx

from tzrec_acc.fx import mark_keyed_tensor, mark_sparse

__all__ = [
    "OperatorMap",
    "SparseDenseSplit",
    "eliminate_dead_code",
    "map_operators",
    "prune_unused_attributes",
    "split_sparse_dense",
]


def eliminate_dead_code(gm: fx.GraphModule) -> int:
    """Remove the nodes whose values nothing uses (pure ones only); returns how many."""
    before = len(gm.graph.nodes)
    gm.graph.eliminate_dead_code()
    gm.recompile()
    return before - len(gm.graph.nodes)


def _used_names(gm: fx.GraphModule) -> Set[str]:
    """Qualified names of the attributes and submodules the graph's nodes use."""
    return {str(n.target) for n in gm.graph.nodes if n.op in ("get_attr", "call_module")}


def _covered(name: str, used: Set[str]) -> bool:
    """``name`` is used, or lies inside or above something used."""
    return any(name == u or name.startswith(u + ".") or u.startswith(name + ".") for u in used)


def prune_unused_attributes(gm: fx.GraphModule) -> List[str]:
    """Delete the parameters, buffers and submodules of ``gm`` that no node uses.

    Returns:
        The qualified names removed (parameters and buffers by name, whole submodules by
        their own name).
    """
    used = _used_names(gm)
    removed: List[str] = []
    for name, _ in list(gm.named_modules()):
        inside_removed = any(name.startswith(r + ".") for r in removed)
        if name and not inside_removed and not _covered(name, used):
            parent, _, attr = name.rpartition(".")
            delattr(gm.get_submodule(parent) if parent else gm, attr)
            removed.append(name)
    tensors = [
        *gm.named_parameters(remove_duplicate=False),
        *gm.named_buffers(remove_duplicate=False),
    ]
    for name, _ in tensors:
        if not _covered(name, used):
            parent, _, attr = name.rpartition(".")
            delattr(gm.get_submodule(parent) if parent else gm, attr)
            removed.append(name)
    gm.recompile()
    return removed


@dataclasses.dataclass
class SparseDenseSplit:
    """The two halves of a marked graph: ``dense(*inputs, *sparse(*inputs))`` equals the
    original ``gm(*inputs)``.

    Attributes:
        sparse: takes the original inputs and returns the marked values, in ``names`` order.
        dense: takes the original inputs and then the marked values.
        names: the marks' names.
    """

    sparse: fx.GraphModule
    dense: fx.GraphModule
    names: Tuple[str, ...]

    def __iter__(self) -> Iterator[fx.GraphModule]:
        return iter((self.sparse, self.dense))


def _ancestors(nodes: List[fx.Node]) -> Set[fx.Node]:
    seen: Set[fx.Node] = set()
    stack = list(nodes)
    while stack:
        node = stack.pop()
        if node not in seen:
            seen.add(node)
            stack.extend(node.all_input_nodes)
    return seen


def _is_sparse_mark(node: fx.Node) -> bool:
    if node.op != "call_function":
        return False
    if node.target is mark_sparse:
        return True
    sparse = node.kwargs.get("sparse", node.args[2] if len(node.args) > 2 else True)
    return node.target is mark_keyed_tensor and bool(sparse)


def split_sparse_dense(gm: fx.GraphModule) -> SparseDenseSplit:
    """Cut ``gm`` at its sparse marks (:func:`~tzrec_acc.fx.mark_sparse`, and
    :func:`~tzrec_acc.fx.mark_keyed_tensor` with ``sparse=True``).

    The dense part still holds the nodes that computed the marked values (now unused) and
    the attributes they read: run :func:`eliminate_dead_code` and
    :func:`prune_unused_attributes` on it.

    Raises:
        ValueError: the graph has no sparse mark, or two marks share a name.
    """
    marks = [n for n in gm.graph.nodes if _is_sparse_mark(n)]
    if not marks:
        raise ValueError(
            "the graph has no sparse mark; mark the embedding lookups with "
            "tzrec_acc.fx.mark_sparse(name, value) before tracing"
        )
    names = tuple(str(n.args[0]) for n in marks)
    if len(set(names)) != len(names):
        raise ValueError(f"sparse marks must have distinct names, got {list(names)}")
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]

    sparse_graph = fx.Graph()
    env: Dict[fx.Node, fx.Node] = {}
    needed = _ancestors(marks)
    for node in gm.graph.nodes:
        if node in needed or node.op == "placeholder":
            env[node] = sparse_graph.node_copy(node, lambda n: env[n])
    sparse_graph.output(tuple(env[m] for m in marks))

    dense_graph = fx.Graph()
    # no defaults: the marked values come after the original inputs, and a parameter
    # without a default cannot follow one with a default
    env = {p: dense_graph.placeholder(p.name, p.type) for p in placeholders}
    for mark, name in zip(marks, names):
        env[mark] = dense_graph.placeholder(name.replace(".", "_"))
    for node in gm.graph.nodes:
        if node not in env:
            env[node] = dense_graph.node_copy(node, lambda n: env[n])
    return SparseDenseSplit(
        fx.GraphModule(gm, sparse_graph, "SparsePart"),
        fx.GraphModule(gm, dense_graph, "DensePart"),
        names,
    )


Target = Any  # a Python callable, an OpOverload or an OpOverloadPacket


class OperatorMap:
    """A table of ``call_function`` target replacements; extend it with :meth:`register`.

    A replacement takes the same arguments as what it replaces. An ``OpOverloadPacket``
    key (``torch.ops.ns.op``) matches each of its overloads.
    """

    def __init__(self, table: Optional[Mapping[Target, Callable[..., Any]]] = None) -> None:
        self._table: Dict[Target, Callable[..., Any]] = {}
        for source, target in (table or {}).items():
            self.register(source, target)

    def register(self, source: Target, replacement: Callable[..., Any]) -> "OperatorMap":
        """Map ``source`` to ``replacement``; returns the map (calls chain)."""
        if not callable(source) or not callable(replacement):
            raise TypeError(
                f"source and replacement must be callables or torch ops, got "
                f"{type(source).__name__} and {type(replacement).__name__}"
            )
        self._table[source] = replacement
        return self

    def lookup(self, target: Target) -> Optional[Callable[..., Any]]:
        """The replacement for ``target``, or None."""
        if target in self._table:
            return self._table[target]
        if isinstance(target, torch._ops.OpOverload):
            return self._table.get(target.overloadpacket)
        return None

    def __len__(self) -> int:
        return len(self._table)


def map_operators(gm: fx.GraphModule, table: OperatorMap) -> Dict[str, int]:
    """Replace the targets of ``gm``'s ``call_function`` nodes found in ``table``.

    Returns:
        How many nodes were replaced, per original target's name.
    """
    counts: Dict[str, int] = {}
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        replacement = table.lookup(node.target)
        if replacement is not None:
            name = str(node.target)
            counts[name] = counts.get(name, 0) + 1
            node.target = replacement
    gm.recompile()
    return counts
