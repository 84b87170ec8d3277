"""The plugin contract: what a backend is (:class:`Backend`) and what each op asks of it
(:data:`OPS`).

Every op is declared once here, with

* ``params``: the arguments its implementation receives, **by keyword**, in this order (the
  public function's arguments minus ``backend``; all of them on every call, ``None`` where the
  caller gave none);
* ``options``: the keys of the call the backends' ``supports(op, call)`` check receives besides
  ``device`` and ``dtype``, with what each value means;
* ``grads``: the arguments it differentiates (empty: forward only, the output never requires
  grad);
* ``module``: the module of :mod:`tzrec_ops.ops` that defines the public op; the built-in
  backends keep its implementation in their module of the same name;
* ``fast_path``: the public op falls back to other ops when no backend accepts the call, so a
  backend may leave it out without losing any call.

The public functions dispatch with exactly these names, taken from their own arguments by
:meth:`OpSpec.arguments` (``tests/test_contract.py`` checks it with a recording backend); every
implementation a plugin registers is held to them by :func:`check_implementation`, as pluggy
holds a hookimpl to its hookspec; the built-in plugins build their op tables from :data:`OPS`
(:func:`mirrored_op_table`), and the hook contract in the tzrec-ops README is
:func:`contract_markdown`'s output (a test compares them). A change here is a change of the
plugin contract: see the README.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
from typing import Any, Callable, Dict, Iterable, Mapping, Optional, Tuple

Availability = Callable[[], Optional[str]]
Supports = Callable[[str, Mapping[str, Any]], Optional[str]]

# the call keys every op passes to ``supports``
COMMON_OPTIONS: Dict[str, str] = {
    "device": "torch.device of the call's tensors",
    "dtype": "torch.dtype of the call's main input",
}


@dataclasses.dataclass(frozen=True)
class OpSpec:
    """One op's contract (see the module docstring)."""

    name: str
    params: Tuple[str, ...]
    options: Mapping[str, str]
    grads: Tuple[str, ...]
    summary: str
    module: str
    fast_path: bool = False

    def call_keys(self) -> Tuple[str, ...]:
        """Every key of the ``call`` mapping a ``supports`` check receives for this op."""
        return (*COMMON_OPTIONS, *self.options)

    def public_op(self) -> Callable[..., Any]:
        """The public function of this op (imported from ``tzrec_ops.ops.<module>``)."""
        return getattr(importlib.import_module(f"tzrec_ops.ops.{self.module}"), self.name)


_ATTENTION_MASK = {
    "causal": "bool: causal mask (False: bidirectional)",
    "num_targets": "bool: num_targets was given",
    "max_attn_len": "int: window w (0: none)",
    "contextual_seq_len": "int: contextual prefix length C (0: none)",
}

_SPECS = (
    OpSpec(
        "hstu_mha",
        (
            "max_seq_len", "alpha", "q", "k", "v", "seq_offsets", "causal", "dropout_pr",
            "training", "num_targets", "max_attn_len", "contextual_seq_len",
            "min_full_attn_seq_len", "sort_by_length", "attn_func", "scaling_seqlen",
        ),
        {
            "causal": _ATTENTION_MASK["causal"],
            "dropout_pr": "float: attention dropout in effect (0.0 when not training)",
            "num_targets": _ATTENTION_MASK["num_targets"],
            "max_attn_len": _ATTENTION_MASK["max_attn_len"],
            "contextual_seq_len": _ATTENTION_MASK["contextual_seq_len"],
            "min_full_attn_seq_len": "int: full-attention tail under a window (0: off)",
            "sort_by_length": "bool: scheduling hint, results are identical",
            "attn_func": "bool: an arbitrary mask tensor was given",
        },
        ("q", "k", "v"),
        "jagged HSTU attention [L, H, V]",
        module="hstu_attention",
    ),
    OpSpec(
        "delta_hstu_mha",
        (
            "max_seq_len", "alpha", "delta_q", "k", "v", "seq_offsets", "num_targets",
            "max_attn_len", "contextual_seq_len", "scaling_seqlen", "delta_k", "delta_v",
        ),
        {
            "num_targets": _ATTENTION_MASK["num_targets"],
            "max_attn_len": _ATTENTION_MASK["max_attn_len"],
            "contextual_seq_len": _ATTENTION_MASK["contextual_seq_len"],
            "split_kv": "bool: split cached form (delta_k/delta_v given)",
        },
        (),
        "cached attention of each sequence's last D queries [B * D, H, V]",
        module="hstu_attention",
    ),
    OpSpec("addmm", ("input", "mat1", "mat2"), {}, ("input", "mat1", "mat2"),
           "input + mat1 @ mat2", module="mm"),
    OpSpec("layer_norm", ("x", "weight", "bias", "eps"), {}, ("x", "weight", "bias"),
           "layer norm over the last dim", module="layer_norm"),
    OpSpec("rms_norm", ("x", "weight", "eps"), {}, ("x", "weight"),
           "RMS norm over the last dim", module="layer_norm"),
    OpSpec("swish_layer_norm", ("x", "weight", "bias", "eps"), {}, ("x", "weight", "bias"),
           "x * sigmoid(layer_norm(x))", module="layer_norm"),
    OpSpec(
        "layer_norm_mul_dropout",
        ("x", "u", "weight", "bias", "eps", "dropout_ratio", "training", "concat_ux", "seed"),
        {
            "dropout_ratio": "float: dropout in effect (0.0 when not training)",
            "concat_ux": "bool: output [u | x | y]",
        },
        ("x", "u", "weight", "bias"),
        "dropout(u * layer_norm(x))",
        module="layer_norm",
    ),
    OpSpec(
        "group_norm_mul_dropout",
        (
            "x", "u", "weight", "bias", "eps", "dropout_ratio", "training", "num_heads",
            "concat_ux", "seed",
        ),
        {
            "dropout_ratio": "float: dropout in effect (0.0 when not training)",
            "concat_ux": "bool: output [u | x | y]",
        },
        ("x", "u", "weight", "bias"),
        "dropout(u * group_norm(x)), one group per head",
        module="layer_norm",
    ),
    OpSpec(
        "concat_2D_jagged",
        (
            "values_left", "values_right", "max_len_left", "max_len_right", "offsets_left",
            "offsets_right",
        ),
        {},
        ("values_left", "values_right"),
        "per sequence, left rows then right rows",
        module="jagged_2d",
    ),
    OpSpec(
        "split_2D_jagged",
        (
            "max_seq_len", "values", "total_len_left", "total_len_right", "max_len_left",
            "max_len_right", "offsets_left", "offsets_right",
        ),
        {},
        ("values",),
        "inverse of concat_2D_jagged",
        module="jagged_2d",
    ),
    OpSpec(
        "jagged_dense_bmm_broadcast_add",
        ("max_seq_len", "seq_offsets", "jagged", "dense", "bias"),
        {},
        ("jagged", "dense", "bias"),
        "per sequence b: jagged_b @ dense[b] + bias[b]",
        module="jagged_2d",
    ),
    OpSpec(
        "add_positional_embeddings",
        (
            "alpha", "max_seq_len", "position_embeddings_weight", "seq_offsets", "seq_lengths",
            "seq_embeddings", "num_targets", "interleave_targets",
        ),
        {},
        ("position_embeddings_weight", "seq_embeddings"),
        "alpha * x + position table row",
        module="position",
    ),
    OpSpec(
        "add_timestamp_positional_embeddings",
        (
            "alpha", "max_seq_len", "max_contextual_seq_len", "position_embeddings_weight",
            "timestamp_embeddings_weight", "seq_offsets", "seq_lengths", "seq_embeddings",
            "timestamps", "num_targets", "interleave_targets", "time_bucket_fn",
            "time_bucket_increments", "query_time",
        ),
        {
            "time_bucket_fn": "str: 'sqrt' or 'log'",
            "query_time": "bool: per-sequence query times were given",
        },
        ("position_embeddings_weight", "timestamp_embeddings_weight", "seq_embeddings"),
        "alpha * x + position row + time-bucket row",
        module="position",
    ),
    OpSpec(
        "hstu_compute_uqvk",
        (
            "x", "norm_weight", "norm_bias", "norm_eps", "num_heads", "attn_dim", "hidden_dim",
            "uvqk_weight", "uvqk_bias", "recompute_normed_x_in_backward",
            "recompute_uvqk_in_backward",
        ),
        {
            "recompute_normed_x_in_backward": "bool: memory/time trade, same results",
            "recompute_uvqk_in_backward": "bool: memory/time trade, same results",
        },
        ("x", "norm_weight", "norm_bias", "uvqk_weight", "uvqk_bias"),
        "STU input projection: (SiLU(u), q, k, v)",
        module="hstu_compute",
    ),
    OpSpec(
        "hstu_compute_output",
        (
            "attn", "u", "x", "norm_weight", "norm_bias", "norm_eps", "output_weight",
            "num_heads", "linear_dim", "dropout_ratio", "training", "concat_ux", "group_norm",
            "recompute_y_in_backward",
        ),
        {
            "dropout_ratio": "float: dropout in effect (0.0 when not training)",
            "concat_ux": "bool: y = [u | attn | y]",
            "group_norm": "bool: per-head norm",
            "recompute_y_in_backward": "bool: memory/time trade, same results",
        },
        ("attn", "u", "x", "norm_weight", "norm_bias", "output_weight"),
        "STU output block: x + dropout(u * norm(attn)) @ W",
        module="hstu_compute",
    ),
    OpSpec(
        "hstu_preprocess_and_attention",
        (
            "x", "norm_weight", "norm_bias", "norm_eps", "num_heads", "attn_dim", "hidden_dim",
            "uvqk_weight", "uvqk_bias", "max_seq_len", "seq_offsets", "attn_alpha", "causal",
            "num_targets", "max_attn_len", "contextual_seq_len", "recompute_uvqk_in_backward",
            "recompute_normed_x_in_backward", "sort_by_length", "prefill", "attn_func",
            "scaling_seqlen",
        ),
        {
            **_ATTENTION_MASK,
            "attn_func": "bool: an arbitrary mask tensor was given",
            "scaling_seqlen": "int: the divisor S (-1: max_seq_len)",
        },
        ("x", "norm_weight", "norm_bias", "uvqk_weight", "uvqk_bias"),
        "fused hstu_compute_uqvk + hstu_mha, returns (u, attn, None, None); never called "
        "with prefill=True",
        module="hstu_compute",
        fast_path=True,
    ),
)

OPS: Dict[str, OpSpec] = {spec.name: spec for spec in _SPECS}


def op_table(package: str, modules: Mapping[str, Iterable[str]]) -> Dict[str, str]:
    """A :attr:`Backend.ops` table: ``{op: "package.module:op"}`` for the ops listed under
    each module of ``package``; an op that is not declared in :data:`OPS` is an error."""
    table: Dict[str, str] = {}
    for module, ops in modules.items():
        for op in ops:
            if op not in OPS:
                raise ValueError(f"{op!r} is not a tzrec_ops op; declared ops: {sorted(OPS)}")
            table[op] = f"{package}.{module}:{op}"
    return table


def mirrored_op_table(package: str, *, fast_paths: bool = True) -> Dict[str, str]:
    """A :attr:`Backend.ops` table for a backend ``package`` laid out like
    :mod:`tzrec_ops.ops`, as the built-in backends are: ``{op: "package.<module>:op"}`` for
    every declared op, ``module`` being the op's :attr:`OpSpec.module`; without the
    ``fast_path`` ops when ``fast_paths`` is False."""
    return {
        name: f"{package}.{spec.module}:{name}"
        for name, spec in OPS.items()
        if fast_paths or not spec.fast_path
    }


def _always_available() -> Optional[str]:
    return None


def _supports_every_call(op: str, call: Mapping[str, Any]) -> Optional[str]:
    return None


class BackendError(RuntimeError):
    """A backend was requested that does not exist or cannot run the call."""


@dataclasses.dataclass(frozen=True)
class Backend:
    """One implementation of some or all tzrec ops.

    Args:
        name: unique backend name, used by ``backend=`` and ``TZREC_OPS_BACKEND``.
        priority: higher wins in automatic selection.
        ops: op name (a key of :data:`OPS`) -> ``"module:function"`` of the implementation,
            which receives the op's declared ``params`` by keyword, already validated.
        availability: returns ``None`` if the backend can run on this machine, else a human
            reason ("triton is not installed (pip install 'tzrec-ops[triton]')"). Called once.
        supports: ``supports(op, call)`` returns ``None`` if the backend can run this call,
            else a reason. ``call`` holds the op's declared call keys (``device``, ``dtype``
            and its options). A backend refuses here whatever it cannot compute exactly:
            it is never called with a call it refused, and a call it accepted must match the
            oracle.
        description: one line for ``python -m tzrec_ops info``.
        automatic: returns ``None`` if automatic selection may pick this backend, else a
            reason (e.g. the Triton CPU interpreter serves explicit requests only).
    """

    name: str
    priority: int
    ops: Mapping[str, str]
    availability: Availability = _always_available
    supports: Supports = _supports_every_call
    description: str = ""
    automatic: Availability = _always_available
    _cache: Dict[str, Any] = dataclasses.field(default_factory=dict, compare=False, repr=False)

    def unavailable_reason(self) -> Optional[str]:
        """Why this backend cannot run on this machine, or ``None`` if it can (cached)."""
        if "availability" not in self._cache:
            try:
                reason = self.availability()
            except Exception as exc:  # a broken check must not take the host down
                reason = f"availability check raised {exc!r}"
            self._cache["availability"] = reason
        return self._cache["availability"]

    def rejection(self, op: str, call: Mapping[str, Any]) -> Optional[str]:
        """Why this backend cannot run ``op`` for ``call``, or ``None`` if it can."""
        if op not in self.ops:
            return f"does not implement {op}"
        reason = self.unavailable_reason()
        if reason is not None:
            return f"unavailable: {reason}"
        try:
            return self.supports(op, call)
        except Exception as exc:
            return f"supports check raised {exc!r}"

    def implementation(self, op: str) -> Callable[..., Any]:
        """Import (once) and return the function implementing ``op``."""
        key = "impl:" + op
        if key not in self._cache:
            if op not in self.ops:
                raise BackendError(f"backend {self.name!r} does not implement {op}")
            module_name, _, attr = self.ops[op].partition(":")
            self._cache[key] = getattr(importlib.import_module(module_name), attr)
        return self._cache[key]


class ContractError(TypeError):
    """An implementation's parameters differ from its op's declaration."""


def _describe(fn: Callable[..., Any]) -> str:
    module = getattr(fn, "__module__", None)
    name = getattr(fn, "__qualname__", None) or type(fn).__name__
    return f"{module}:{name}" if module else name


def _signature(fn: Callable[..., Any], evaluated: bool) -> inspect.Signature:
    """``fn``'s signature, its annotations evaluated when ``evaluated`` and possible (one
    that names what its module imports only for type checkers stays a string)."""
    if evaluated:
        try:
            return inspect.signature(fn, eval_str=True)
        except Exception:  # noqa: BLE001 - any failing annotation: compare the strings
            pass
    return inspect.signature(fn)


def _annotation_text(annotation: Any) -> str:
    return annotation if isinstance(annotation, str) else inspect.formatannotation(annotation)


def check_implementation(
    spec: OpSpec, fn: Callable[..., Any], *, backend: str = "", annotations: bool = False
) -> None:
    """Raise :class:`ContractError` unless ``fn`` implements ``spec`` as it is called.

    As pluggy checks a hookimpl against its hookspec: ``fn``'s parameters are the declared
    ``params``, with the same names in the same order, each one passable by keyword (no
    positional-only parameter, no ``*args``, no ``**kwargs``, nothing more). An
    implementation always receives every argument, so it need not give defaults; a default it
    gives is the public op's. With ``annotations``, an annotation it gives equals the public
    op's (the built-in backends and the conformance suite check this; the registry does
    not reject a plugin for a type hint).

    The message names the backend, the op, the implementation and the first parameter that
    differs.
    """
    where = f"{spec.name} implementation {_describe(fn)}"
    if backend:
        where = f"backend {backend!r}: {where}"
    try:
        params = list(_signature(fn, annotations).parameters.values())
    except (TypeError, ValueError) as exc:
        raise ContractError(f"{where} has no signature to check ({exc})") from exc
    public = {
        name: p
        for name, p in _signature(spec.public_op(), annotations).parameters.items()
        if name in spec.params
    }
    declared = ", ".join(spec.params)
    for p in params:
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            star = "*" if p.kind is p.VAR_POSITIONAL else "**"
            raise ContractError(
                f"{where} takes {star}{p.name}: name the declared parameters instead ({declared})"
            )
        if p.kind is p.POSITIONAL_ONLY:
            raise ContractError(
                f"{where}: parameter {p.name!r} is positional-only, but every argument is "
                f"passed by keyword"
            )
        if p.name not in spec.params:
            raise ContractError(
                f"{where} has parameter {p.name!r}, which {spec.name} does not declare "
                f"(declared: {declared})"
            )
    names = [p.name for p in params]
    for name in spec.params:
        if name not in names:
            raise ContractError(f"{where} lacks parameter {name!r} (declared: {declared})")
    for position, (p, name) in enumerate(zip(params, spec.params)):
        if p.name != name:
            raise ContractError(
                f"{where}: parameter {p.name!r} is at position {position}, where {spec.name} "
                f"declares {name!r} (declared: {declared})"
            )
    for p in params:
        want = public[p.name]
        if p.default is not p.empty and (
            want.default is want.empty
            or type(p.default) is not type(want.default)
            or p.default != want.default
        ):
            expected = "none" if want.default is want.empty else repr(want.default)
            raise ContractError(
                f"{where}: parameter {p.name!r} defaults to {p.default!r}, the public op's "
                f"default is {expected}"
            )
        if annotations and p.annotation is not p.empty and want.annotation is not want.empty:
            got, expected = p.annotation, want.annotation
            if isinstance(got, str) or isinstance(expected, str):
                got, expected = _annotation_text(got), _annotation_text(expected)
            if got != expected:
                raise ContractError(
                    f"{where}: parameter {p.name!r} is annotated {_annotation_text(got)}, "
                    f"the public op's is {_annotation_text(expected)}"
                )


def contract_markdown() -> str:
    """The README's table of ops: arguments, ``supports`` keys, differentiated arguments."""
    lines = [
        "| op | implementation arguments (by keyword) | `supports` call keys | gradients for |",
        "|---|---|---|---|",
    ]
    for spec in OPS.values():
        name = f"`{spec.name}`" + (" (fast path)" if spec.fast_path else "")
        params = ", ".join(spec.params)
        options = ", ".join(f"`{key}` ({meaning})" for key, meaning in spec.options.items())
        grads = ", ".join(spec.grads) or "none (forward only)"
        lines.append(f"| {name} | {params} | {options or '-'} | {grads} |")
    common = ", ".join(f"`{key}` ({meaning})" for key, meaning in COMMON_OPTIONS.items())
    lines.append("")
    lines.append(f"Every call also carries {common}.")
    return "\n".join(lines) + "\n"
