"""Encoders, contextualized MLPs, postprocessors and the positional encoder against
closed-form torch references."""

from __future__ import annotations

import math

import pytest
import torch
from torch.nn import functional as F

from tzrec_gr import (
    MLP,
    HSTUPositionalEncoder,
    L2NormPostprocessor,
    LayerNormPostprocessor,
    MLPContentEncoder,
    PadContentEncoder,
    ParameterizedContextualizedMLP,
    SimpleActionEncoder,
    SimpleContextualizedMLP,
    SliceContentEncoder,
    TimestampLayerNormPostprocessor,
)
from tzrec_ops.jagged import offsets_from_lengths

PT = "pytorch"
UIH_LEN = torch.tensor([2, 3, 0])
CAND_LEN = torch.tensor([1, 1, 2])


def _jagged_cat(left, right, left_len, right_len):
    lo, ro = offsets_from_lengths(left_len), offsets_from_lengths(right_len)
    parts = []
    for b in range(len(left_len)):
        parts += [left[lo[b] : lo[b + 1]], right[ro[b] : ro[b + 1]]]
    return torch.cat(parts)


def _content_args(du, dt):
    uih = torch.randn(int(UIH_LEN.sum()), du, dtype=torch.float64)
    cand = torch.randn(int(CAND_LEN.sum()), dt, dtype=torch.float64)
    return uih, cand, (3, 2, offsets_from_lengths(UIH_LEN), offsets_from_lengths(CAND_LEN))


def test_slice_content_encoder():
    uih, cand, rest = _content_args(4, 6)
    out = SliceContentEncoder(4, 6, backend=PT)(uih, cand, *rest)
    torch.testing.assert_close(out, _jagged_cat(uih, cand[:, :4], UIH_LEN, CAND_LEN))


def test_pad_content_encoder():
    uih, cand, rest = _content_args(4, 6)
    enc = PadContentEncoder(4, 6, backend=PT)
    out = enc(uih, cand, *rest)
    padded = torch.cat([uih, enc.pad.detach().double().expand(uih.shape[0], -1)], dim=1)
    torch.testing.assert_close(out, _jagged_cat(padded, cand, UIH_LEN, CAND_LEN))
    assert enc.output_dim == 6


def test_mlp_content_encoder():
    uih, cand, rest = _content_args(4, 6)
    enc = MLPContentEncoder(
        MLP(4, [8, 5], backend=PT), MLP(6, [5], backend=PT), backend=PT
    ).double()
    out = enc(uih, cand, *rest)
    u = enc.uih_mlp.layers
    ref_u = F.silu(F.silu(uih @ u[0].weight + u[0].bias) @ u[2].weight + u[2].bias)
    t = enc.target_mlp.layers
    ref_t = F.silu(cand @ t[0].weight + t[0].bias)
    torch.testing.assert_close(out, _jagged_cat(ref_u, ref_t, UIH_LEN, CAND_LEN))


@pytest.mark.parametrize(
    "make, match",
    [
        (
            lambda: SliceContentEncoder(6, 4),
            r"target_embedding_dim \(4\) must be >= uih_embedding_dim \(6\)",
        ),
        (
            lambda: PadContentEncoder(4, 4),
            r"target_embedding_dim \(4\) must be > uih_embedding_dim \(4\)",
        ),
        (
            lambda: MLPContentEncoder(MLP(4, [3]), MLP(4, [5])),
            r"uih_mlp.output_dim \(3\) must equal",
        ),
        (lambda: MLP(4, []), "at least one layer"),
        (lambda: MLP(4, [3], activation="gelu"), "activation must be one of"),
    ],
)
def test_content_encoder_errors(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_action_encoder_matches_loop():
    enc = SimpleActionEncoder(
        3,
        [1, 2, 4],
        watchtime_to_action_thresholds=[10, 30],
        watchtime_to_action_weights=[8, 16],
        backend=PT,
    )
    actions = torch.tensor([1, 6, 0, 5, 2])
    watch = torch.tensor([0, 12, 40, 5, 31])
    out = enc(
        actions,
        3,
        offsets_from_lengths(UIH_LEN),
        2,
        offsets_from_lengths(CAND_LEN),
        int(CAND_LEN.sum()),
        watch,
    )
    table = enc.action_table.detach()
    rows = []
    for a, w in zip(actions.tolist(), watch.tolist()):
        a |= (8 if w >= 10 else 0) | (16 if w >= 30 else 0)
        rows.append(
            torch.cat(
                [table[i] if a & bit else torch.zeros(3) for i, bit in enumerate([1, 2, 4, 8, 16])]
            )
        )
    hist = torch.stack(rows)
    cand = enc.target_action_table.detach().expand(int(CAND_LEN.sum()), -1)
    torch.testing.assert_close(out, _jagged_cat(hist, cand, UIH_LEN, CAND_LEN))
    assert enc.output_dim == 15 and enc.need_watchtime


def test_action_encoder_errors():
    with pytest.raises(ValueError, match="watchtime_to_action_weights has 1 entries"):
        SimpleActionEncoder(3, [1], [10, 20], [2])
    enc = SimpleActionEncoder(3, [1], [10], [2])
    with pytest.raises(ValueError, match="seq_watchtimes is required"):
        enc(torch.tensor([1]), 1, torch.tensor([0, 1]), 0, torch.tensor([0, 0]), 0)
    with pytest.raises(ValueError, match="seq_watchtimes has 2 rows but seq_actions has 1"):
        enc(
            torch.tensor([1]),
            1,
            torch.tensor([0, 1]),
            0,
            torch.tensor([0, 0]),
            0,
            torch.tensor([1, 2]),
        )


def _ln(x, w, b, eps=1e-5):
    return F.layer_norm(x, (x.shape[-1],), w, b, eps)


def test_simple_contextualized_mlp():
    mlp = SimpleContextualizedMLP(4, 6, 8, backend=PT).double()
    x = torch.randn(5, 4, dtype=torch.float64)
    l1, sln, l2, ln = mlp.mlp
    h = x @ l1.weight + l1.bias
    h = h * torch.sigmoid(_ln(h, sln.weight, sln.bias))
    ref = _ln(h @ l2.weight + l2.bias, ln.weight, ln.bias)
    torch.testing.assert_close(mlp(x, torch.tensor([0, 2, 5]), 3, None), ref)


def test_parameterized_contextualized_mlp():
    mlp = ParameterizedContextualizedMLP(
        6, 4, 3, 5, contextual_dropout_ratio=0.0, backend=PT
    ).double()
    x = torch.randn(5, 4, dtype=torch.float64)
    ctx = torch.randn(2, 6, dtype=torch.float64)
    offsets = [0, 2, 5]
    out = mlp(x, torch.tensor(offsets), 3, ctx)
    for b in range(2):
        h = ctx[b] @ mlp.hidden.weight + mlp.hidden.bias
        w = _ln(
            h @ mlp.weight_proj.weight + mlp.weight_proj.bias,
            mlp.weight_norm.weight,
            mlp.weight_norm.bias,
        ).view(4, 3)
        l1, sln, l2 = mlp.bias_mlp
        r = h @ l1.weight + l1.bias
        r = r * torch.sigmoid(_ln(r, sln.weight, sln.bias))
        r = r @ l2.weight + l2.bias
        torch.testing.assert_close(
            out[offsets[b] : offsets[b + 1]], x[offsets[b] : offsets[b + 1]] @ w + r
        )


def test_parameterized_mlp_errors():
    with pytest.raises(ValueError, match="contextual_embedding_dim must be > 0"):
        ParameterizedContextualizedMLP(0, 4, 3, 5)
    mlp = ParameterizedContextualizedMLP(6, 4, 3, 5)
    with pytest.raises(ValueError, match="needs contextual_embeddings"):
        mlp(torch.randn(5, 4), torch.tensor([0, 2, 5]), 3, None)
    with pytest.raises(ValueError, match=r"contextual_embeddings must be \[B=2, 6\]"):
        mlp(torch.randn(5, 4), torch.tensor([0, 2, 5]), 3, torch.randn(3, 6))


def test_l2_and_layer_norm_postprocessors():
    x = torch.randn(4, 3, 6, dtype=torch.float64)
    x[0, 0] = 0.0
    out = L2NormPostprocessor()(x, None)
    torch.testing.assert_close(out, x / x.norm(dim=-1, keepdim=True).clamp(min=1e-6))
    pp = LayerNormPostprocessor(6, backend=PT).double()
    with torch.no_grad():
        pp.norm.weight.uniform_()
        pp.norm.bias.uniform_()
    torch.testing.assert_close(pp(x, None), _ln(x, pp.norm.weight, pp.norm.bias))


def test_timestamp_layer_norm_postprocessor_uses_pi():
    pp = TimestampLayerNormPostprocessor(4, [3600, 86400], [24, 7], backend=PT).double()
    x = torch.randn(2, 2, 4, dtype=torch.float64)
    ts = torch.tensor([[0, 3600 * 6], [86400 * 3 + 7200, 1_700_000_000]])
    out = pp(x, ts)
    assert out.shape == (2, 2, 4)
    feats = []
    for t in ts.flatten().tolist():
        row = []
        for period, units in ((3600, 24), (86400, 7)):
            phi = 2 * math.pi * ((t // period) % units) / units
            row += [math.cos(phi), math.sin(phi)]
        feats.append(row)
    feats = torch.tensor(feats, dtype=torch.float64).view(2, 2, 4)
    # 6 h is a quarter of a day: cos = 0 exactly up to float32 rounding, not cos(2 * 3.14 / 4)
    assert abs(pp.time_features(torch.tensor([3600 * 6]))[0, 0].item()) < 1e-6
    h = torch.cat([x, feats], -1) @ pp.proj.weight + pp.proj.bias
    torch.testing.assert_close(out, _ln(h, pp.norm.weight, pp.norm.bias), rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match=r"seq_timestamps must have shape \(2, 2\)"):
        pp(x, ts[0])
    with pytest.raises(ValueError, match="time_duration_period_units has 1 entries"):
        TimestampLayerNormPostprocessor(4, [3600], [24, 7])


def test_positional_encoder_without_time():
    enc = HSTUPositionalEncoder(4, 6, backend=PT).double()
    lengths = torch.tensor([3, 5])
    targets = torch.tensor([1, 2])
    x = torch.randn(8, 4, dtype=torch.float64)
    out = enc(6, lengths, offsets_from_lengths(lengths), None, x, targets)
    table = enc.position_embeddings_weight
    rows = []
    for n, t in zip(lengths.tolist(), targets.tolist()):
        rows += [table[min(p, n - t, 5)] for p in range(n)]
    torch.testing.assert_close(out, 2.0 * x + torch.stack(rows))


def test_positional_encoder_with_time():
    enc = HSTUPositionalEncoder(
        4,
        16,
        num_time_buckets=20,
        use_time_encoding=True,
        contextual_seq_len=1,
        time_bucket_increments=60.0,
        backend=PT,
    ).double()
    lengths = torch.tensor([4, 5])
    targets = torch.tensor([1, 2])
    ts = torch.tensor([0, 100, 700, 4000, 0, 60, 3000, 9000, 20000])
    x = torch.randn(9, 4, dtype=torch.float64)
    out = enc(8, lengths, offsets_from_lengths(lengths), ts, x, targets)
    pos_t, time_t = enc.position_embeddings_weight, enc.timestamp_embeddings_weight
    rows, s = [], 0
    for n, t in zip(lengths.tolist(), targets.tolist()):
        high = n - t
        query = ts[s + n - 1].item()
        for p in range(n):
            pos = p if p < 1 else min(high - min(p, high) + 1, 15)
            g = math.sqrt(max(query - ts[s + p].item(), 1e-6) / 60.0)
            rows.append(pos_t[pos] + time_t[int(min(max(g, 0), 20))])
        s += n
    torch.testing.assert_close(out, 2.0 * x + torch.stack(rows))


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"num_position_buckets": 0}, "num_position_buckets must be > 0"),
        ({"use_time_encoding": True}, "num_time_buckets must be > 0"),
        ({"time_bucket_fn": "cube"}, "time_bucket_fn must be"),
        ({"time_bucket_increments": 0.0}, "time_bucket_increments must be > 0"),
    ],
)
def test_positional_encoder_errors(kw, match):
    args = {"embedding_dim": 4, "num_position_buckets": 8}
    args.update(kw)
    with pytest.raises(ValueError, match=match):
        HSTUPositionalEncoder(**args)


def test_positional_encoder_call_errors():
    enc = HSTUPositionalEncoder(4, 8, num_time_buckets=4, use_time_encoding=True)
    lengths = torch.tensor([2, 1])
    with pytest.raises(ValueError, match="seq_timestamps is required"):
        enc(2, lengths, offsets_from_lengths(lengths), None, torch.randn(3, 4), None)
    with pytest.raises(ValueError, match="seq_timestamps has 2 rows but seq_embeddings has 3"):
        offsets = offsets_from_lengths(lengths)
        enc(2, lengths, offsets, torch.tensor([1, 2]), torch.randn(3, 4), None)
