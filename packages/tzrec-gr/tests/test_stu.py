"""STULayer / STUStack against a float64 loop reference, KV cache, truncation, errors."""

from __future__ import annotations

import pytest
import torch
from _reference import stu_layer as ref_stu_layer
from _reference import truncate as ref_truncate

from tzrec_gr import KVCache, STULayer, STUStack
from tzrec_gr.stu.kv_cache import prefix_kv_cache
from tzrec_ops.jagged import offsets_from_lengths

E, H, A, V = 16, 2, 8, 4


def _layer(**kw) -> STULayer:
    kw.setdefault("output_dropout_ratio", 0.0)
    layer = STULayer(E, H, V, A, backend="pytorch", **kw)
    with torch.no_grad():  # non-trivial norms and biases
        for p in layer.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return layer.eval()


@pytest.mark.parametrize(
    "kw, targets",
    [
        ({}, None),
        ({}, [1, 2, 0]),
        ({"contextual_seq_len": 2}, [1, 1, 1]),
        ({"max_attn_len": 2}, [1, 2, 0]),
        ({"use_group_norm": True, "scaling_seqlen": 16}, [2, 1, 1]),
        ({"target_aware": False}, [1, 2, 1]),
        ({"causal": False}, None),
    ],
)
def test_stu_layer_matches_reference(kw, targets):
    layer = _layer(**kw)
    lengths = [4, 7, 3]
    offsets = offsets_from_lengths(torch.tensor(lengths))
    x = torch.randn(sum(lengths), E, dtype=torch.float64)
    nt = torch.tensor(targets) if targets is not None else None
    out = layer(x, offsets, 8, nt).out
    expected = ref_stu_layer(layer, x, offsets.tolist(), 8, targets)
    torch.testing.assert_close(out, expected, rtol=1e-9, atol=1e-9)


def test_stu_layer_float32_and_grad():
    layer = _layer()
    lengths = [5, 2]
    offsets = offsets_from_lengths(torch.tensor(lengths))
    x = torch.randn(7, E, requires_grad=True)
    out = layer(x, offsets, 5).out
    torch.testing.assert_close(
        out.double(), ref_stu_layer(layer, x.detach(), [0, 5, 7], 5), rtol=1e-5, atol=1e-5
    )
    out.sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()
    assert all(p.grad is not None for p in layer.parameters())


def _stack(n_layers: int, **kw) -> STUStack:
    return STUStack([_layer(scaling_seqlen=32, **kw) for _ in range(n_layers)])


@pytest.mark.parametrize("n_layers", [1, 2, 3])
def test_prefill_then_cached_forward_equals_full_forward(n_layers):
    """Spec contract: prime the cache on all but the last Δ tokens, then the Δ targets."""
    stack = _stack(n_layers, contextual_seq_len=1)
    delta = 2
    lengths = torch.tensor([6, 4, 9])
    targets = torch.tensor([2, 1, 2])
    offsets = offsets_from_lengths(lengths)
    x = torch.randn(int(lengths.sum()), E, dtype=torch.float64)
    with torch.inference_mode():
        full = stack(x, offsets, 12, targets).x
        caches = stack(
            x,
            offsets,
            12,
            targets,
            kv_caching_lengths=lengths - delta,
            max_kv_caching_len=12 - delta,
            total_kv_caching_len=int((lengths - delta).sum()),
        ).kv_caches
        rows = torch.cat([torch.arange(int(e) - delta, int(e)) for e in offsets[1:]])
        out, new_caches = stack.cached_forward(x[rows], caches, targets)
    torch.testing.assert_close(out, full[rows], rtol=1e-9, atol=1e-9)
    assert len(new_caches) == n_layers
    assert new_caches[0].offsets.tolist() == offsets.tolist()


def test_incremental_decoding_several_steps():
    """Causal generation: roll the cache forward Δ tokens at a time; each step equals the
    last Δ rows of a full forward over everything seen so far."""
    stack = _stack(2, target_aware=False)
    delta, steps = 2, 3
    prime = torch.tensor([3, 5])
    total_len = prime + delta * steps
    xs = [torch.randn(int(n), E, dtype=torch.float64) for n in total_len]
    with torch.inference_mode():
        cat = torch.cat([s[: int(n)] for s, n in zip(xs, prime)])
        caches = stack(
            cat,
            offsets_from_lengths(prime),
            16,
            kv_caching_lengths=prime,
            total_kv_caching_len=int(prime.sum()),
        ).kv_caches
        for step in range(steps):
            start = prime + delta * step
            delta_x = torch.cat([s[int(a) : int(a) + delta] for s, a in zip(xs, start)])
            out, caches = stack.cached_forward(delta_x, caches)
            seen = start + delta
            offsets = offsets_from_lengths(seen)
            full = stack(torch.cat([s[: int(n)] for s, n in zip(xs, seen)]), offsets, 16).x
            rows = torch.cat([torch.arange(int(e) - delta, int(e)) for e in offsets[1:]])
            torch.testing.assert_close(out, full[rows], rtol=1e-9, atol=1e-9)


def test_cached_forward_keeps_old_cache_for_new_candidates():
    """Target-aware scoring of successive candidate sets against one fixed cache."""
    stack = _stack(2)
    history = torch.tensor([4, 6])
    hist_x = torch.randn(10, E, dtype=torch.float64)
    with torch.inference_mode():
        caches = stack(
            hist_x,
            offsets_from_lengths(history),
            16,
            kv_caching_lengths=history,
            total_kv_caching_len=10,
        ).kv_caches
        for _ in range(2):
            cand = torch.randn(2 * 3, E, dtype=torch.float64)
            nt = torch.tensor([3, 3])
            out, _ = stack.cached_forward(cand, caches, nt)
            full_x = torch.cat([hist_x[:4], cand[:3], hist_x[4:], cand[3:]])
            full = stack(full_x, offsets_from_lengths(history + 3), 16, nt).x
            torch.testing.assert_close(
                out, torch.cat([full[4:7], full[13:16]]), rtol=1e-9, atol=1e-9
            )


def _primed(stack: STUStack, lengths: torch.Tensor, delta: int, targets, max_len: int = 16):
    """Full forward, the caches of all but the last ``delta`` tokens, and those tokens."""
    offsets = offsets_from_lengths(lengths)
    x = torch.randn(int(lengths.sum()), E, dtype=torch.float64)
    full = stack(x, offsets, max_len, targets).x
    caches = stack(
        x,
        offsets,
        max_len,
        targets,
        kv_caching_lengths=lengths - delta,
        max_kv_caching_len=max_len - delta,
        total_kv_caching_len=int((lengths - delta).sum()),
    ).kv_caches
    rows = torch.cat([torch.arange(int(e) - delta, int(e)) for e in offsets[1:]])
    return full, caches, x[rows], rows


@pytest.mark.parametrize(
    "kw, targets",
    [({"contextual_seq_len": 2}, [3, 1, 3]), ({"max_attn_len": 2}, [1, 2, 0]), ({}, None)],
)
def test_cached_forward_without_cache_update_equals_with_and_full_forward(kw, targets):
    """update_cache=False (scoring) gives the same outputs as update_cache=True and as the
    full forward's last Δ rows, for one layer and for the stack, and returns no cache."""
    stack = _stack(3, **kw)
    lengths = torch.tensor([7, 3, 10])  # the second sample's cache holds no history token
    nt = torch.tensor(targets) if targets is not None else None
    with torch.inference_mode():
        full, caches, delta_x, rows = _primed(stack, lengths, 3, nt)
        scored, none = stack.cached_forward(delta_x, caches, nt, update_cache=False)
        appended, new_caches = stack.cached_forward(delta_x, caches, nt)
        layer = stack.stu_layers[0]
        layer_scored, layer_none = layer.cached_forward(delta_x, caches[0], nt, update_cache=False)
        layer_appended, _ = layer.cached_forward(delta_x, caches[0], nt, update_cache=True)
    assert none is None and layer_none is None
    assert len(new_caches) == 3
    assert torch.equal(scored, appended)
    assert torch.equal(layer_scored, layer_appended)
    torch.testing.assert_close(scored, full[rows], rtol=1e-9, atol=1e-9)


def test_cached_forward_rejects_trimming_without_cache_update():
    layer = _layer(scaling_seqlen=8)
    cache = KVCache(torch.randn(5, H * A), torch.randn(5, H * V), torch.tensor([0, 2, 5]), 3)
    with pytest.raises(
        ValueError, match=r"kv_caching_lengths trims the returned cache, but update_cache=False"
    ):
        layer.cached_forward(
            torch.randn(4, E), cache, kv_caching_lengths=torch.tensor([3, 4]), update_cache=False
        )


def test_cached_forward_trims_cache_with_kv_caching_lengths():
    layer = _layer(scaling_seqlen=8)
    cache = KVCache(torch.randn(5, H * A), torch.randn(5, H * V), torch.tensor([0, 2, 5]), 3)
    with torch.inference_mode():
        _, new = layer.cached_forward(
            torch.randn(4, E), cache, kv_caching_lengths=torch.tensor([3, 4])
        )
    assert new.offsets.tolist() == [0, 3, 7]
    torch.testing.assert_close(new.k[:2], cache.k[:2])
    torch.testing.assert_close(new.k[3:6], cache.k[2:5])


@pytest.mark.parametrize(
    "lengths, targets, context, tail",
    [([5, 9, 3], None, 0, 4), ([8, 12], [3, 5], 0, 2), ([6, 12, 20], [1, 2, 4], 3, 4)],
)
@pytest.mark.parametrize("sync_free", [False, True])
def test_stack_truncation_matches_reference(lengths, targets, context, tail, sync_free):
    layers = [_layer(contextual_seq_len=context, scaling_seqlen=32) for _ in range(3)]
    stack = STUStack(layers, truncate_split_layer=2, truncate_tail_len=tail)
    offsets = offsets_from_lengths(torch.tensor(lengths))
    x = torch.randn(sum(lengths), E, dtype=torch.float64)
    nt = torch.tensor(targets) if targets is not None else None
    kept = ref_truncate(lengths, targets, context, tail)
    sizes = {}
    if sync_free:
        sizes = {"truncated_total_len": sum(map(len, kept)), "truncated_max_seq_len": 32}
    out = stack(x, offsets, 32, nt, **sizes)
    # reference: two full layers, keep rows, one more layer
    h = x
    for layer in layers[:2]:
        h = ref_stu_layer(layer, h, offsets.tolist(), 32, targets)
    rows = torch.cat(
        [torch.tensor(k, dtype=torch.int64) + int(offsets[b]) for b, k in enumerate(kept)]
    )
    new_offsets = offsets_from_lengths(torch.tensor([len(k) for k in kept]))
    expected = ref_stu_layer(layers[2], h[rows], new_offsets.tolist(), 32, targets)
    assert out.x_offsets.tolist() == new_offsets.tolist()
    assert out.plan is not None
    torch.testing.assert_close(out.x, expected, rtol=1e-9, atol=1e-9)


def test_sla_mask_is_shared_between_layers_with_equal_signature():
    layers = [_layer(sla_k1=2, sla_k2=1) for _ in range(2)] + [_layer(sla_k1=3, sla_k2=1)]
    offsets = torch.tensor([0, 4, 9])
    x = torch.randn(9, E, dtype=torch.float64)
    first = layers[0](x, offsets, 8)
    same = layers[1](
        x, offsets, 8, prev_attn_func=first.attn_func, prev_attn_func_sig=layers[0].attn_func_sig
    )
    other = layers[2](
        x, offsets, 8, prev_attn_func=first.attn_func, prev_attn_func_sig=layers[1].attn_func_sig
    )
    assert same.attn_func is first.attn_func
    assert other.attn_func is not first.attn_func
    assert torch.isfinite(STUStack(layers)(x, offsets, 8).x).all()


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"embedding_dim": 0}, "embedding_dim must be a positive int"),
        ({"num_heads": -1}, "num_heads must be a positive int"),
        ({"output_dropout_ratio": 1.0}, "output_dropout_ratio"),
        ({"max_attn_len": -1}, "max_attn_len must be >= 0"),
        ({"contextual_seq_len": -2}, "contextual_seq_len must be >= 0"),
        ({"scaling_seqlen": 0}, "scaling_seqlen must be -1 or > 0"),
        ({"attn_alpha": -1.0}, "attn_alpha must be > 0"),
    ],
)
def test_stu_layer_constructor_errors(kw, match):
    args = {"embedding_dim": E, "num_heads": H, "hidden_dim": V, "attention_dim": A}
    args.update(kw)
    with pytest.raises(ValueError, match=match):
        STULayer(backend="pytorch", **args)


def test_unknown_backend_is_rejected():
    from tzrec_ops.registry import BackendError

    with pytest.raises(BackendError, match="unknown backend 'nope'"):
        STULayer(E, H, V, A, backend="nope")


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"truncate_split_layer": -1}, "non-negative"),
        ({"truncate_split_layer": 1}, "both be > 0"),
        ({"truncate_tail_len": 4}, "both be > 0"),
        (
            {"truncate_split_layer": 2, "truncate_tail_len": 4},
            r"must be < the number of layers \(2\)",
        ),
    ],
)
def test_stack_constructor_errors(kw, match):
    with pytest.raises(ValueError, match=match):
        STUStack([_layer(), _layer()], **kw)


def test_stack_rejects_mixed_widths_and_empty():
    with pytest.raises(ValueError, match="same embedding_dim"):
        STUStack([_layer(), STULayer(8, H, V, A, backend="pytorch")])
    with pytest.raises(ValueError, match="at least one STU layer"):
        STUStack([])


def test_forward_input_errors():
    layer = _layer()
    with pytest.raises(ValueError, match=r"x must be \[L, embedding_dim=16\]"):
        layer(torch.randn(5, 8), torch.tensor([0, 5]), 5)
    with pytest.raises(ValueError, match=r"num_targets must have shape \[B\] = \[2\]"):
        layer(torch.randn(5, E), torch.tensor([0, 2, 5]), 5, torch.tensor([1, 1, 1]))
    with pytest.raises(ValueError, match=r"kv_caching_lengths must have shape \[B\] = \[2\]"):
        layer(torch.randn(5, E), torch.tensor([0, 2, 5]), 5, kv_caching_lengths=torch.tensor([1]))


def test_prefix_kv_cache_of_whole_sequences_keeps_every_row():
    """A prefill keeps every row: the cache is k and v themselves (contiguous), as the
    split of all but the last row per sample shows for the rows it keeps; lengths that sum
    to the rows but exceed a sample's, offsets that end elsewhere and a v of other rows
    are refused."""
    offsets = torch.tensor([0, 2, 2, 7])
    lengths = offsets[1:] - offsets[:-1]
    qkv = torch.randn(7, 3 * H * A)
    k, v = qkv[:, : H * A], qkv[:, H * A : 2 * H * A]  # strided views, as a projection's
    whole = prefix_kv_cache(k, v, offsets, 5, lengths, 0, 7, "pytorch")
    assert torch.equal(whole.k, k) and torch.equal(whole.v, v)
    assert whole.k.is_contiguous() and whole.v.is_contiguous()
    assert torch.equal(whole.offsets, offsets) and whole.max_len == 5
    shorter = prefix_kv_cache(k, v, offsets, 5, (lengths - 1).clamp(min=0), 0, None, "pytorch")
    assert torch.equal(shorter.k, k[[0, 2, 3, 4, 5]]) and torch.equal(shorter.v, v[[0, 2, 3, 4, 5]])
    message = r"kv_caching_lengths\[1\] \(2\) must be at most sequence 1's length \(0\)"
    with pytest.raises(ValueError, match=message):
        prefix_kv_cache(k, v, offsets, 5, torch.tensor([0, 2, 5]), 0, 7, "pytorch")
    with pytest.raises(ValueError, match=r"offsets\[-1\] \(7\) must equal the rows of k \(6\)"):
        prefix_kv_cache(k[:6], v[:6], offsets, 5, torch.tensor([2, 0, 4]), 0, 6, "pytorch")
    with pytest.raises(ValueError, match="v has 6 rows but k has 7; they must match"):
        prefix_kv_cache(k, v[:6], offsets, 5, lengths, 0, 7, "pytorch")


def test_cached_forward_errors():
    stack = STUStack([_layer(), _layer()], truncate_split_layer=1, truncate_tail_len=2)
    cache = KVCache(torch.randn(4, H * A), torch.randn(4, H * V), torch.tensor([0, 1, 4]), 3)
    with pytest.raises(NotImplementedError, match="truncation"):
        stack.cached_forward(torch.randn(2, E), [cache, cache])
    with pytest.raises(NotImplementedError, match="truncation"):
        stack(
            torch.randn(4, E), torch.tensor([0, 1, 4]), 3, kv_caching_lengths=torch.tensor([1, 1])
        )
    layer = _layer()
    with pytest.raises(ValueError, match=r"multiple of the cache's batch size B \(2\)"):
        layer.cached_forward(torch.randn(3, E), cache)
    with pytest.raises(ValueError, match="one cache per layer"):
        STUStack([_layer(), _layer()]).cached_forward(torch.randn(2, E), [cache])
