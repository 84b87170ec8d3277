"""Small calls of every declared op, each with its float64 oracle: the numerical part of the
conformance suite (:mod:`tzrec_ops.testing.conformance`).

A :class:`Case` builds the keyword arguments of one public op call on the CPU in a given float
dtype (index tensors stay integer) and knows the float64 oracle of that call
(:mod:`.ops_oracle`, :mod:`.attention_oracle`). The cases cover the jagged edge cases (an
empty sequence, a one-token sequence, a sequence at ``max_seq_len``, targets, contextual
prefixes, windows, dense sides, fused q/k/v views) and every call option of the op's
declaration, so a backend either refuses an option (a reason) or is checked on it.

Legend as in the ops: L = tokens, B = batch, D/E = features, H = heads, A = q/k dim, V = value
dim.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from tzrec_ops.contract import OPS
from tzrec_ops.jagged import offsets_from_lengths
from tzrec_ops.ops.hstu_attention_utils import build_sla_func_tensor
from tzrec_ops.testing import ops_oracle
from tzrec_ops.testing.attention_oracle import delta_hstu_mha_oracle, hstu_mha_oracle
from tzrec_ops.testing.generators import make_attention_inputs

Args = Dict[str, Any]
Outputs = Tuple[Optional[torch.Tensor], ...]

# lengths of the jagged batches: an empty sequence, one token, a full one (max_seq_len 4)
LENGTHS = (0, 1, 4, 3)
TARGETS = (0, 1, 2, 1)
MAX_SEQ_LEN = 4


@dataclasses.dataclass(frozen=True)
class Case:
    """One call of ``op``.

    Attributes:
        op: the op's name (a key of :data:`tzrec_ops.contract.OPS`).
        name: short id of the case.
        build: ``build(dtype)`` -> the public op's keyword arguments (no ``backend``), on
            the CPU, float tensors in ``dtype``.
        oracle: ``oracle(args)`` -> the expected outputs, given float64 copies of the float
            tensors of ``build``'s arguments (the others unchanged). An output may be
            ``None`` where the backend may return ``None`` (the fused path's k and v).
    """

    op: str
    name: str
    build: Callable[[torch.dtype], Args]
    oracle: Callable[[Args], Outputs]


def _draw(shape: Sequence[int], seed: int, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(tuple(shape), generator=g, dtype=torch.float64) * scale).to(dtype)


def _ints(t: Optional[torch.Tensor]) -> Optional[List[int]]:
    return None if t is None else [int(x) for x in t.tolist()]


def as_outputs(out: Any) -> Outputs:
    """An op's result as a tuple of tensors (or ``None``)."""
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


# ------------------------------------------------------------------------------ attention


def _attention(
    name: str,
    layout: str = "contiguous",
    targets: bool = False,
    lengths: Sequence[int] = LENGTHS,
    sla: bool = False,
    **options: Any,
) -> Case:
    def build(dtype: torch.dtype) -> Args:
        inp = make_attention_inputs(
            lengths, heads=2, attn_dim=8, hidden_dim=4, dtype=dtype, seed=len(name),
            layout=layout, num_targets=TARGETS if targets else None, max_seq_len=MAX_SEQ_LEN,
        )
        args: Args = dict(
            max_seq_len=MAX_SEQ_LEN, alpha=0.4, q=inp.q, k=inp.k, v=inp.v,
            seq_offsets=inp.seq_offsets, num_targets=inp.num_targets, **options,
        )
        if sla:
            args["attn_func"] = build_sla_func_tensor(
                2, 1, 2, inp.seq_offsets, sum(lengths), inp.num_targets
            )
        return args

    def oracle(a: Args) -> Outputs:
        return (
            hstu_mha_oracle(
                a["max_seq_len"], a["alpha"], a["q"], a["k"], a["v"], a["seq_offsets"],
                causal=a.get("causal", True), num_targets=a["num_targets"],
                max_attn_len=a.get("max_attn_len", 0),
                contextual_seq_len=a.get("contextual_seq_len", 0),
                min_full_attn_seq_len=a.get("min_full_attn_seq_len", 0),
                attn_func=a.get("attn_func"), scaling_seqlen=a.get("scaling_seqlen", -1),
            ),
        )

    return Case("hstu_mha", name, build, oracle)


def _attention_cases() -> List[Case]:
    return [
        _attention("plain"),
        _attention("targets", targets=True),
        _attention("fused_qkv_views", layout="fused", targets=True),
        _attention("bidirectional", causal=False),
        _attention(
            "window_prefix", lengths=(1, 2, 4, 3), targets=True, max_attn_len=2,
            contextual_seq_len=1,
        ),
        _attention("full_tail", max_attn_len=1, min_full_attn_seq_len=2),
        _attention("arbitrary_mask", targets=True, sla=True),
        _attention("scaling_seqlen", scaling_seqlen=7),
        _attention("dropout_in_eval", dropout_pr=0.3, training=False),
        _attention("sort_by_length", sort_by_length=True),
    ]


def _cached(name: str, split: bool, delta: int = 1, targets: bool = True, **options: Any) -> Case:
    lengths = (2, 4, 3, 2)  # every sequence holds its D <= 2 new tokens

    def full(dtype: torch.dtype) -> Any:
        return make_attention_inputs(
            lengths, heads=2, attn_dim=8, hidden_dim=4, dtype=dtype, seed=11,
            num_targets=TARGETS if targets else None, max_seq_len=MAX_SEQ_LEN,
        )

    def build(dtype: torch.dtype) -> Args:
        inp = full(dtype)
        starts = inp.seq_offsets.tolist()[:-1]
        new = [s + n - delta + d for s, n in zip(starts, lengths) for d in range(delta)]
        args: Args = dict(
            max_seq_len=MAX_SEQ_LEN, alpha=0.4, delta_q=inp.q[new], num_targets=inp.num_targets,
            **options,
        )
        if split:
            cached = [s + p for s, n in zip(starts, lengths) for p in range(n - delta)]
            args.update(
                k=inp.k[cached], v=inp.v[cached],
                seq_offsets=offsets_from_lengths([n - delta for n in lengths]),
                delta_k=inp.k[new], delta_v=inp.v[new],
            )
        else:
            args.update(k=inp.k, v=inp.v, seq_offsets=inp.seq_offsets)
        return args

    def oracle(a: Args) -> Outputs:
        k, v, offsets = a["k"], a["v"], a["seq_offsets"]
        if split:  # each sequence: its cached rows, then its D new ones
            spans = ops_oracle.spans(offsets)
            k = torch.cat([p for b, (s, e) in enumerate(spans)
                           for p in (k[s:e], a["delta_k"][b * delta:(b + 1) * delta])])
            v = torch.cat([p for b, (s, e) in enumerate(spans)
                           for p in (v[s:e], a["delta_v"][b * delta:(b + 1) * delta])])
            offsets = offsets_from_lengths(list(lengths))
        return (
            delta_hstu_mha_oracle(
                a["max_seq_len"], a["alpha"], a["delta_q"], k, v, offsets,
                num_targets=a["num_targets"], max_attn_len=a.get("max_attn_len", 0),
                contextual_seq_len=a.get("contextual_seq_len", 0),
                scaling_seqlen=a.get("scaling_seqlen", -1),
            ),
        )

    return Case("delta_hstu_mha", name, build, oracle)


def _cached_cases() -> List[Case]:
    return [
        _cached("concatenated", split=False),
        _cached("split_kv", split=True),
        _cached("window", split=False, targets=False, max_attn_len=2, delta=2),
    ]


# ------------------------------------------------------------------------------ addmm, norms


def _addmm(name: str, rows: int, full_bias: bool) -> Case:
    def build(dtype: torch.dtype) -> Args:
        return dict(
            input=_draw((rows, 6) if full_bias else (6,), 1, dtype),
            mat1=_draw((rows, 16), 2, dtype),
            mat2=_draw((16, 6), 3, dtype),
        )

    return Case(
        "addmm", name, build, lambda a: (ops_oracle.addmm(a["input"], a["mat1"], a["mat2"]),)
    )


def _norm(op: str, name: str, rows: int = 5, affine: bool = True) -> Case:
    with_bias = op != "rms_norm"

    def build(dtype: torch.dtype) -> Args:
        args: Args = dict(x=_draw((rows, 8), 1, dtype, 2.0), eps=1e-5)
        args["weight"] = _draw((8,), 2, dtype) if affine else None
        if with_bias:
            args["bias"] = _draw((8,), 3, dtype) if affine else None
        return args

    oracle_fn = getattr(ops_oracle, op)
    return Case(op, name, build, lambda a: (oracle_fn(**a),))


def _norm_mul(op: str, name: str, concat_ux: bool = False, **options: Any) -> Case:
    heads = 2 if op == "group_norm_mul_dropout" else None

    def build(dtype: torch.dtype) -> Args:
        params = 8 if heads is None else heads
        args: Args = dict(
            x=_draw((5, 8), 1, dtype, 2.0), u=_draw((5, 8), 2, dtype),
            weight=_draw((params,), 3, dtype), bias=_draw((params,), 4, dtype), eps=1e-5,
            dropout_ratio=0.0, training=True, concat_ux=concat_ux,
        )
        args.update(options)
        if heads is not None:
            args["num_heads"] = heads
        return args

    def oracle(a: Args) -> Outputs:
        return (
            ops_oracle.norm_mul(
                a["x"], a["u"], a["weight"], a["bias"], a["eps"], a["concat_ux"], heads
            ),
        )

    return Case(op, name, build, oracle)


# ------------------------------------------------------------------------------ jagged


def _concat(name: str, dense_right: bool) -> Case:
    left, right = (0, 1, 3, 2), (2, 0, 1, 1)

    def build(dtype: torch.dtype) -> Args:
        rows_right = 2 * len(left) if dense_right else sum(right)
        return dict(
            values_left=_draw((sum(left), 3), 1, dtype),
            values_right=_draw((rows_right, 3), 2, dtype),
            max_len_left=3, max_len_right=2, offsets_left=offsets_from_lengths(left),
            offsets_right=None if dense_right else offsets_from_lengths(right),
        )

    def oracle(a: Args) -> Outputs:
        spans_right = (
            ops_oracle.dense_spans(len(left), 2) if dense_right else ops_oracle.spans(
                a["offsets_right"])
        )
        return (
            ops_oracle.concat_2D_jagged(
                a["values_left"], a["values_right"], ops_oracle.spans(a["offsets_left"]),
                spans_right,
            ),
        )

    return Case("concat_2D_jagged", name, build, oracle)


def _split(name: str) -> Case:
    left, right = (0, 1, 3, 2), (2, 0, 1, 1)

    def build(dtype: torch.dtype) -> Args:
        return dict(
            max_seq_len=5, values=_draw((sum(left) + sum(right), 3), 1, dtype),
            total_len_left=sum(left), offsets_left=offsets_from_lengths(left),
            offsets_right=offsets_from_lengths(right),
        )

    return Case(
        "split_2D_jagged", name, build,
        lambda a: ops_oracle.split_2D_jagged(a["values"], left, right),
    )


def _bmm(name: str) -> Case:
    lengths = (0, 1, 3, 2)

    def build(dtype: torch.dtype) -> Args:
        return dict(
            max_seq_len=3, seq_offsets=offsets_from_lengths(lengths),
            jagged=_draw((sum(lengths), 4), 1, dtype), dense=_draw((4, 4, 3), 2, dtype),
            bias=_draw((4, 3), 3, dtype),
        )

    def oracle(a: Args) -> Outputs:
        return (
            ops_oracle.jagged_dense_bmm_broadcast_add(
                a["seq_offsets"], a["jagged"], a["dense"], a["bias"]
            ),
        )

    return Case("jagged_dense_bmm_broadcast_add", name, build, oracle)


# ------------------------------------------------------------------------------ position


def _position(name: str, targets: bool, interleave: bool = False) -> Case:
    lengths = (0, 1, 4, 3)

    def build(dtype: torch.dtype) -> Args:
        return dict(
            alpha=0.7, max_seq_len=MAX_SEQ_LEN,
            position_embeddings_weight=_draw((3, 5), 1, dtype),  # 3 rows: indices clamp
            seq_offsets=offsets_from_lengths(lengths), seq_lengths=torch.tensor(lengths),
            seq_embeddings=_draw((sum(lengths), 5), 2, dtype),
            num_targets=torch.tensor((0, 0, 2, 1)) if targets else None,
            interleave_targets=interleave,
        )

    def oracle(a: Args) -> Outputs:
        return (
            ops_oracle.add_positional_embeddings(
                a["alpha"], a["position_embeddings_weight"], a["seq_offsets"],
                a["seq_embeddings"], _ints(a["num_targets"]), a["interleave_targets"],
            ),
        )

    return Case("add_positional_embeddings", name, build, oracle)


def _timestamp(name: str, fn: str = "sqrt", query_time: bool = False) -> Case:
    lengths = (0, 1, 4, 3)

    def build(dtype: torch.dtype) -> Args:
        times = torch.tensor([0, 0, 100, 4000, 9000, 10, 800, 20000])
        return dict(
            alpha=0.7, max_seq_len=MAX_SEQ_LEN, max_contextual_seq_len=1,
            position_embeddings_weight=_draw((6, 5), 1, dtype),
            timestamp_embeddings_weight=_draw((5, 5), 2, dtype),
            seq_offsets=offsets_from_lengths(lengths), seq_lengths=torch.tensor(lengths),
            seq_embeddings=_draw((sum(lengths), 5), 3, dtype), timestamps=times,
            num_targets=torch.tensor((0, 1, 1, 1)), interleave_targets=False,
            time_bucket_fn=fn, time_bucket_increments=60.0,
            query_time=torch.tensor([50, 60, 12000, 30000]) if query_time else None,
        )

    def oracle(a: Args) -> Outputs:
        qt = a["query_time"]
        return (
            ops_oracle.add_timestamp_positional_embeddings(
                a["alpha"], a["max_contextual_seq_len"], a["position_embeddings_weight"],
                a["timestamp_embeddings_weight"], a["seq_offsets"], a["seq_embeddings"],
                a["timestamps"], _ints(a["num_targets"]), a["interleave_targets"],
                a["time_bucket_fn"], a["time_bucket_increments"],
                None if qt is None else [float(x) for x in qt.tolist()],
            ),
        )

    return Case("add_timestamp_positional_embeddings", name, build, oracle)


# ------------------------------------------------------------------------------ STU blocks

_H, _A, _V, _E = 2, 3, 2, 8


def _uqvk_args(dtype: torch.dtype, rows: int) -> Args:
    width = 2 * _H * (_V + _A)
    return dict(
        x=_draw((rows, _E), 1, dtype), norm_weight=_draw((_E,), 2, dtype),
        norm_bias=_draw((_E,), 3, dtype), norm_eps=1e-5, num_heads=_H, attn_dim=_A,
        hidden_dim=_V, uvqk_weight=_draw((_E, width), 4, dtype, 0.4),
        uvqk_bias=_draw((width,), 5, dtype, 0.1),
    )


def _uqvk_oracle(a: Args) -> Outputs:
    return ops_oracle.hstu_compute_uqvk(
        a["x"], a["norm_weight"], a["norm_bias"], a["norm_eps"], a["num_heads"], a["attn_dim"],
        a["hidden_dim"], a["uvqk_weight"], a["uvqk_bias"],
    )


def _uqvk(name: str, **options: Any) -> Case:
    return Case(
        "hstu_compute_uqvk", name, lambda dtype: {**_uqvk_args(dtype, 6), **options},
        _uqvk_oracle,
    )


def _output(name: str, concat_ux: bool = False, group_norm: bool = False, **options: Any) -> Case:
    hv = _H * _V

    def build(dtype: torch.dtype) -> Args:
        params = _H if group_norm else hv
        args: Args = dict(
            attn=_draw((6, hv), 1, dtype), u=_draw((6, hv), 2, dtype), x=_draw((6, _E), 3, dtype),
            norm_weight=_draw((params,), 4, dtype), norm_bias=_draw((params,), 5, dtype),
            norm_eps=1e-5, output_weight=_draw((3 * hv if concat_ux else hv, _E), 6, dtype, 0.4),
            num_heads=_H, linear_dim=_V, dropout_ratio=0.0, training=True, concat_ux=concat_ux,
            group_norm=group_norm, recompute_y_in_backward=False,
        )
        args.update(options)
        return args

    def oracle(a: Args) -> Outputs:
        return (
            ops_oracle.hstu_compute_output(
                a["attn"], a["u"], a["x"], a["norm_weight"], a["norm_bias"], a["norm_eps"],
                a["output_weight"], a["num_heads"], a["concat_ux"], a["group_norm"],
            ),
        )

    return Case("hstu_compute_output", name, build, oracle)


def _preprocess(name: str, targets: bool = True, **options: Any) -> Case:
    def build(dtype: torch.dtype) -> Args:
        args: Args = dict(
            **_uqvk_args(dtype, sum(LENGTHS)), max_seq_len=MAX_SEQ_LEN,
            seq_offsets=offsets_from_lengths(LENGTHS), attn_alpha=0.5, causal=True,
            num_targets=torch.tensor(TARGETS) if targets else None, max_attn_len=0,
            contextual_seq_len=0, recompute_uvqk_in_backward=False,
            recompute_normed_x_in_backward=False, sort_by_length=False,
        )
        args.update(options)
        return args

    def oracle(a: Args) -> Outputs:
        u, q, k, v = _uqvk_oracle(a)
        attn = hstu_mha_oracle(
            a["max_seq_len"], a["attn_alpha"], q, k, v, a["seq_offsets"], causal=a["causal"],
            num_targets=a["num_targets"], max_attn_len=a["max_attn_len"],
            contextual_seq_len=a["contextual_seq_len"],
        )
        return u, attn.reshape(attn.shape[0], -1), k, v

    return Case("hstu_preprocess_and_attention", name, build, oracle)


def _all_cases() -> List[Case]:
    cases = [*_attention_cases(), *_cached_cases()]
    cases += [_addmm("row_bias", 5, False), _addmm("full_bias", 5, True),
              _addmm("no_rows", 0, False)]
    for op in ("layer_norm", "rms_norm", "swish_layer_norm"):
        cases += [_norm(op, "affine"), _norm(op, "no_affine", affine=False),
                  _norm(op, "no_rows", rows=0)]
    for op in ("layer_norm_mul_dropout", "group_norm_mul_dropout"):
        cases += [_norm_mul(op, "plain"), _norm_mul(op, "concat_ux", concat_ux=True),
                  _norm_mul(op, "dropout_in_eval", training=False, dropout_ratio=0.3)]
    cases += [_concat("both_jagged", False), _concat("dense_right", True), _split("both_jagged"),
              _bmm("plain")]
    cases += [_position("no_targets", False), _position("targets", True),
              _position("interleaved", True, interleave=True)]
    cases += [_timestamp("sqrt"), _timestamp("log", fn="log"),
              _timestamp("query_time", query_time=True)]
    cases += [_uqvk("plain"), _uqvk("recompute", recompute_normed_x_in_backward=True,
                                    recompute_uvqk_in_backward=True)]
    cases += [_output("layer_norm"), _output("group_norm_concat", concat_ux=True,
                                             group_norm=True),
              _output("recompute", recompute_y_in_backward=True),
              _output("dropout_in_eval", training=False, dropout_ratio=0.3)]
    cases += [_preprocess("targets"), _preprocess("window_prefix", max_attn_len=2,
                                                  contextual_seq_len=1, targets=False),
              _preprocess("bidirectional", causal=False, targets=False)]
    return cases


CASES: Dict[str, List[Case]] = {op: [] for op in OPS}
for _case in _all_cases():
    CASES[_case.op].append(_case)
del _case


def float64_copies(args: Args, grads: Sequence[str]) -> Args:
    """``args`` with every float tensor as a detached float64 CPU copy (requiring grad when
    its name is in ``grads``), the others as they are."""
    out: Args = {}
    for key, value in args.items():
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            value = value.detach().cpu().to(torch.float64).requires_grad_(key in grads)
        elif isinstance(value, torch.Tensor):
            value = value.cpu()
        out[key] = value
    return out
