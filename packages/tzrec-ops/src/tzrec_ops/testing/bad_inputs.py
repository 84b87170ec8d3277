"""The bad-input matrix: every public op that takes a jagged batch, with one argument of a
tiny good batch (lengths [2, 3], num_targets [1, 1]) spoiled at a time, must raise an error
naming that argument before any backend implementation is looked up.

:data:`CASES` holds the ops (and paths of ops) with their good batch and defects;
:func:`assert_rejected_first` runs one defect with every backend lookup replaced by a
function that fails, so a check that came after the lookup, or only inside a backend, shows
up as a failure. tzrec-ops' own tests and the conformance suite
(:mod:`tzrec_ops.testing.conformance`) run it; pytest is needed only by the latter.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from tzrec_ops import registry
from tzrec_ops.contract import Backend
from tzrec_ops.ops import (
    hstu_attention,
    hstu_attention_utils,
    hstu_compute,
    jagged_2d,
    position,
    truncation,
)
from tzrec_ops.ops.hstu_attention_utils import build_sla_func_tensor

Args = Dict[str, Any]
# a defect: the arguments it replaces, and the argument the error must name
Defect = Tuple[Callable[[], Args], str]

LENGTHS = [2, 3]
TOTAL = sum(LENGTHS)


def _offsets(values: List[float], dtype: torch.dtype = torch.int64) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype)


def _good_offsets() -> torch.Tensor:
    return _offsets([0, 2, 5])


def _targets() -> torch.Tensor:
    return torch.tensor([1, 1])


def _offsets_defects(name: str, ends_at_total: bool = True) -> Dict[str, Defect]:
    """Offsets that do not start at 0, decrease, do not end at the token count, are float
    or live on another device (``ends_at_total``: the op knows the token count)."""
    defects: Dict[str, Defect] = {
        f"{name}_not_from_0": (lambda: {name: _offsets([1, 2, 5])}, name),
        f"{name}_decreasing": (lambda: {name: _offsets([0, 6, 5])}, name),
        f"{name}_float": (lambda: {name: _offsets([0, 2, 5], torch.float32)}, name),
        f"{name}_on_meta": (lambda: {name: _good_offsets().to("meta")}, name),
    }
    if ends_at_total:
        defects[f"{name}_short_of_total"] = (lambda: {name: _offsets([0, 2, 4])}, name)
    return defects


def _targets_defects(too_long: List[int]) -> Dict[str, Defect]:
    """num_targets longer than its sequence, of the wrong batch size, negative, float or
    on another device."""
    name = "num_targets"
    return {
        "num_targets_too_long": (lambda: {name: torch.tensor(too_long)}, name),
        "num_targets_wrong_size": (lambda: {name: torch.tensor([1])}, name),
        "num_targets_negative": (lambda: {name: torch.tensor([-1, 1])}, name),
        "num_targets_float": (lambda: {name: torch.tensor([1.0, 1.0])}, name),
        "num_targets_on_meta": (lambda: {name: _targets().to("meta")}, name),
    }


def _max_defect(name: str, value: int) -> Dict[str, Defect]:
    """A max length below one of the sequences."""
    return {f"{name}_below_a_length": (lambda: {name: value}, name)}


@dataclasses.dataclass(frozen=True)
class OpCase:
    """One public op (or one path of it) in the matrix.

    Attributes:
        call: runs the op on keyword arguments with a backend request (``None`` for an
            op without one).
        good: a valid batch's arguments (fresh tensors each time).
        defects: id -> :data:`Defect`.
        needs: (registry op, call options) pairs a backend must run for this path.
        module: where the op's plain-torch work starts, to be forbidden (ops without a
            backend only): (object, attribute).
    """

    call: Callable[[Args, Any], Any]
    good: Callable[[], Args]
    defects: Dict[str, Defect]
    needs: Tuple[Tuple[str, Args], ...] = ()
    module: Optional[Tuple[Any, str]] = None


def _attention_args() -> Args:
    return dict(
        max_seq_len=3,
        alpha=0.5,
        q=torch.zeros(TOTAL, 2, 4),
        k=torch.zeros(TOTAL, 2, 4),
        v=torch.zeros(TOTAL, 2, 4),
        seq_offsets=_good_offsets(),
        num_targets=_targets(),
    )


def _sla_attention_args() -> Args:
    args = _attention_args()
    args["attn_func"] = build_sla_func_tensor(2, 1, 1, args["seq_offsets"], TOTAL, _targets())
    return args


def _delta_args() -> Args:
    """D = 1 new query per sequence, concatenated form (full lengths 2 and 3)."""
    args = _attention_args()
    args["delta_q"] = torch.zeros(2, 2, 4)
    del args["q"]
    return args


def _split_args() -> Args:
    """Cached lengths 2 and 3 plus D = 1 new token each: full lengths 3 and 4."""
    args = _delta_args()
    args.update(max_seq_len=4, delta_k=torch.zeros(2, 2, 4), delta_v=torch.zeros(2, 2, 4))
    return args


def _preprocess_args(prefill: bool) -> Callable[[], Args]:
    def good() -> Args:
        return dict(
            x=torch.zeros(TOTAL, 4),
            norm_weight=torch.ones(4),
            norm_bias=torch.zeros(4),
            norm_eps=1e-5,
            num_heads=1,
            attn_dim=2,
            hidden_dim=2,
            uvqk_weight=torch.zeros(4, 8),
            uvqk_bias=torch.zeros(8),
            max_seq_len=3,
            seq_offsets=_good_offsets(),
            attn_alpha=0.5,
            causal=True,
            num_targets=_targets(),
            max_attn_len=0,
            contextual_seq_len=0,
            recompute_uvqk_in_backward=False,
            recompute_normed_x_in_backward=False,
            sort_by_length=False,
            prefill=prefill,
        )

    return good


def _concat_args() -> Args:
    return dict(
        values_left=torch.zeros(TOTAL, 3),
        values_right=torch.zeros(3, 3),
        max_len_left=3,
        max_len_right=2,
        offsets_left=_good_offsets(),
        offsets_right=_offsets([0, 1, 3]),
    )


def _split_2d_args() -> Args:
    return dict(
        max_seq_len=5,
        values=torch.zeros(TOTAL + 3, 3),
        total_len_left=TOTAL,
        offsets_left=_good_offsets(),
        offsets_right=_offsets([0, 1, 3]),
    )


def _bmm_args() -> Args:
    return dict(
        max_seq_len=3,
        seq_offsets=_good_offsets(),
        jagged=torch.zeros(TOTAL, 2),
        dense=torch.zeros(2, 2, 3),
        bias=torch.zeros(2, 3),
    )


def _position_args() -> Args:
    return dict(
        alpha=1.0,
        max_seq_len=3,
        position_embeddings_weight=torch.zeros(4, 3),
        seq_offsets=_good_offsets(),
        seq_lengths=torch.tensor(LENGTHS),
        seq_embeddings=torch.zeros(TOTAL, 3),
        num_targets=_targets(),
        interleave_targets=False,
    )


def _timestamp_args() -> Args:
    args = _position_args()
    args.update(
        max_contextual_seq_len=0,
        timestamp_embeddings_weight=torch.zeros(4, 3),
        timestamps=torch.arange(TOTAL),
    )
    return args


def _sla_args() -> Args:
    return dict(
        nheads=2,
        sla_k1=1,
        sla_k2=1,
        seq_offsets=_good_offsets(),
        total_q=TOTAL,
        num_targets=_targets(),
    )


def _plan_args() -> Args:
    return dict(
        x_offsets=_good_offsets(), num_targets=_targets(), max_seq_len=3, truncate_tail_len=1
    )


def _with_backend(fn: Callable[..., Any]) -> Callable[[Args, Any], Any]:
    return lambda args, backend: fn(**args, backend=backend)


def _without_backend(fn: Callable[..., Any]) -> Callable[[Args, Any], Any]:
    return lambda args, backend: fn(**args)


_ATTENTION_DEFECTS = {
    **_offsets_defects("seq_offsets"),
    **_targets_defects(too_long=[3, 1]),
    **_max_defect("max_seq_len", 2),
}
_POSITION_DEFECTS = {
    **_ATTENTION_DEFECTS,
    "seq_lengths_not_offsets_diffs": (lambda: {"seq_lengths": torch.tensor([3, 2])}, "seq_lengths"),
    "interleaved_num_targets_too_long": (
        lambda: {"interleave_targets": True, "num_targets": torch.tensor([2, 1])},
        "num_targets",
    ),
}
_ATTENTION = (("hstu_mha", {"attn_func": False}),)

CASES: Dict[str, OpCase] = {
    "hstu_mha": OpCase(
        _with_backend(hstu_attention.hstu_mha), _attention_args, _ATTENTION_DEFECTS, _ATTENTION
    ),
    "hstu_mha_sla": OpCase(
        _with_backend(hstu_attention.hstu_mha),
        _sla_attention_args,
        {
            **_ATTENTION_DEFECTS,
            "attn_func_wrong_length": (
                lambda: {"attn_func": torch.zeros(2, 3, TOTAL - 1, dtype=torch.int32)},
                "attn_func",
            ),
        },
        (("hstu_mha", {"attn_func": True}),),
    ),
    "delta_hstu_mha_concatenated": OpCase(
        _with_backend(hstu_attention.delta_hstu_mha),
        _delta_args,
        {
            **_ATTENTION_DEFECTS,
            # D = 3 new queries per sequence, more than the first sequence holds
            "sequence_shorter_than_D": (lambda: {"delta_q": torch.zeros(6, 2, 4)}, "seq_offsets"),
        },
        (("delta_hstu_mha", {}),),
    ),
    "delta_hstu_mha_split": OpCase(
        _with_backend(hstu_attention.delta_hstu_mha),
        _split_args,
        {
            **_offsets_defects("seq_offsets"),
            **_targets_defects(too_long=[4, 1]),  # the full length of sequence 0 is 3
            **_max_defect("max_seq_len", 3),  # the full length of sequence 1 is 4
        },
        (("delta_hstu_mha", {"split_kv": True}),),
    ),
    "preprocess_and_attention_fused": OpCase(
        _with_backend(hstu_compute.hstu_preprocess_and_attention),
        _preprocess_args(prefill=False),
        _ATTENTION_DEFECTS,
        (("hstu_preprocess_and_attention", {"attn_func": False}),),
    ),
    "preprocess_and_attention_prefill": OpCase(
        _with_backend(hstu_compute.hstu_preprocess_and_attention),
        _preprocess_args(prefill=True),
        _ATTENTION_DEFECTS,
        (("hstu_compute_uqvk", {}), *_ATTENTION),
    ),
    "build_sla_func_tensor": OpCase(
        _without_backend(hstu_attention_utils.build_sla_func_tensor),
        _sla_args,
        {**_offsets_defects("seq_offsets"), **_targets_defects(too_long=[3, 1])},
        module=(torch, "repeat_interleave"),
    ),
    "concat_2D_jagged": OpCase(
        _with_backend(jagged_2d.concat_2D_jagged),
        _concat_args,
        {
            **_offsets_defects("offsets_left"),
            **_offsets_defects("offsets_right"),
            **_max_defect("max_len_left", 2),
        },
        (("concat_2D_jagged", {}),),
    ),
    "split_2D_jagged": OpCase(
        _with_backend(jagged_2d.split_2D_jagged),
        _split_2d_args,
        {
            **_offsets_defects("offsets_left"),
            **_offsets_defects("offsets_right"),
            **_max_defect("max_seq_len", 4),  # left + right of sequence 1 is 5
        },
        (("split_2D_jagged", {}),),
    ),
    "jagged_dense_bmm_broadcast_add": OpCase(
        _with_backend(jagged_2d.jagged_dense_bmm_broadcast_add),
        _bmm_args,
        {**_offsets_defects("seq_offsets"), **_max_defect("max_seq_len", 2)},
        (("jagged_dense_bmm_broadcast_add", {}),),
    ),
    "add_positional_embeddings": OpCase(
        _with_backend(position.add_positional_embeddings),
        _position_args,
        _POSITION_DEFECTS,
        (("add_positional_embeddings", {}),),
    ),
    "add_timestamp_positional_embeddings": OpCase(
        _with_backend(position.add_timestamp_positional_embeddings),
        _timestamp_args,
        _POSITION_DEFECTS,
        (
            (
                "add_timestamp_positional_embeddings",
                {"time_bucket_fn": "sqrt", "query_time": False},
            ),
        ),
    ),
    "compute_stu_truncation_plan": OpCase(
        _without_backend(truncation.compute_stu_truncation_plan),
        _plan_args,
        {
            # the plan is not given the token count, so there is no end to check
            **_offsets_defects("x_offsets", ends_at_total=False),
            **_targets_defects(too_long=[3, 1]),
            **_max_defect("max_seq_len", 2),
            # sequence 0: 2 prefix tokens + 1 target in a length of 2
            "contextual_prefix_and_targets_too_long": (
                lambda: {"contextual_seq_len": 2},
                "contextual_seq_len",
            ),
        },
        module=(truncation, "mirror"),
    ),
}


def forbid_backends(monkeypatch: Any, case: OpCase) -> None:
    """Fail the test if any backend implementation is looked up or imported, or if an op
    without a backend starts its work."""
    for module in (registry, hstu_attention, hstu_compute, jagged_2d, position):
        for name in ("select_backend", "find_implementation"):
            if hasattr(module, name):
                monkeypatch.setattr(module, name, lookup_forbidden)
    monkeypatch.setattr(Backend, "implementation", lookup_forbidden)
    if case.module is not None:
        monkeypatch.setattr(*case.module, lookup_forbidden)


def lookup_forbidden(*args: Any, **kwargs: Any) -> Any:
    raise AssertionError("reached a backend (or the op's work) before the arguments were checked")


def to_device(args: Args, device: torch.device) -> Args:
    """Every CPU tensor of ``args`` on ``device`` (a ``meta`` tensor stays the odd one out)."""
    return {
        k: v.to(device) if isinstance(v, torch.Tensor) and v.device.type == "cpu" else v
        for k, v in args.items()
    }


def assert_rejected_first(
    op: str, request: Any, defect: str, monkeypatch: Any, device: torch.device
) -> None:
    """Run ``defect`` of :data:`CASES` ``[op]`` on ``device`` with backend ``request``, every
    backend lookup forbidden; the error must name the spoiled argument and say what it must be.
    ``monkeypatch`` is pytest's fixture."""
    import pytest

    case = CASES[op]
    spoil, argument = case.defects[defect]
    args = to_device({**case.good(), **spoil()}, device)
    forbid_backends(monkeypatch, case)
    with pytest.raises((ValueError, TypeError), match=rf"\b{argument}\b") as err:
        case.call(args, request)
    assert "must" in str(err.value)  # says what was expected
