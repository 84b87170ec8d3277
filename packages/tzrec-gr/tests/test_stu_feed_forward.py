"""STULayer's optional feed-forward block (``ffn_dim``) and HSTURetrieval's ``ffn_dim``:
the layer against a float64 reference (forward) and finite differences (backward), serving
against the forward, and the refusals."""

from __future__ import annotations

import pytest
import torch
from _models import NUM_ITEMS, gpu_test, history_user, retrieval_batch, retrieval_model
from _reference import stu_layer as ref_stu_layer

from tzrec_gr.serving import server_for
from tzrec_gr.stu import STULayer
from tzrec_ops.testing.tolerances import assert_close


def _layer(ffn_dim: int, dropout: float = 0.0, **kw) -> STULayer:
    torch.manual_seed(0)
    kw = {"backend": "pytorch", **kw}
    layer = STULayer(
        embedding_dim=8, num_heads=2, hidden_dim=4, attention_dim=4, ffn_dim=ffn_dim,
        output_dropout_ratio=dropout, scaling_seqlen=6, **kw,
    )
    with torch.no_grad():  # biases and norms away from their identity start
        for p in layer.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return layer.double()


def test_forward_matches_the_float64_reference():
    layer = _layer(ffn_dim=12).eval()
    x = torch.randn(9, 8, dtype=torch.float64)
    offsets = [0, 4, 4, 9]
    out, _, _ = layer(x, torch.tensor(offsets), max_seq_len=6)
    assert_close(out, ref_stu_layer(layer, x, offsets, 6), torch.float64, name="out")


def test_backward_matches_finite_differences():
    layer = _layer(ffn_dim=6).eval()
    x = torch.randn(5, 8, dtype=torch.float64, requires_grad=True)
    offsets = torch.tensor([0, 2, 5])
    params = [layer.ffn.in_weight, layer.ffn.out_bias, layer.ffn.norm_weight, layer._uvqk_weight]

    def f(x, *_):
        return layer(x, offsets, max_seq_len=6).out

    assert torch.autograd.gradcheck(f, (x, *params), eps=1e-6, atol=1e-7)


def test_without_ffn_dim_the_layer_has_no_new_parameters():
    names = {n for n, _ in _layer(ffn_dim=0).named_parameters()}
    assert not any(n.startswith("ffn.") for n in names)
    assert len(names) == 7
    assert {n for n, _ in _layer(ffn_dim=4).named_parameters()} - names == {
        "ffn.norm_weight", "ffn.norm_bias", "ffn.in_weight", "ffn.in_bias",
        "ffn.out_weight", "ffn.out_bias",
    }


def test_dropout_applies_in_training_only():
    layer = _layer(ffn_dim=16, dropout=0.5)
    x = torch.randn(6, 8, dtype=torch.float64)
    offsets = torch.tensor([0, 6])
    layer.eval()
    first = layer(x, offsets, max_seq_len=6).out
    assert torch.equal(first, layer(x, offsets, max_seq_len=6).out)
    layer.train()
    torch.manual_seed(3)
    assert not torch.allclose(layer(x, offsets, max_seq_len=6).out, first)


@pytest.mark.parametrize("bad", [-1, 2.0, True])
def test_bad_ffn_dim_is_refused_by_name(bad):
    with pytest.raises(ValueError, match="ffn_dim"):
        STULayer(embedding_dim=8, num_heads=2, hidden_dim=4, attention_dim=4, ffn_dim=bad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_retrieval_serving_with_ffn_gives_what_forward_gives(dtype):
    model = retrieval_model(ffn_dim=24).to(dtype).eval()
    assert all(layer.ffn_dim == 24 for layer in model.transducer.stu.stu_layers)
    torch.manual_seed(2)
    users = [history_user(9) for _ in range(3)]
    server = server_for(model)
    first = [{k: v[:4] for k, v in u.items()} for u in users]
    rest = [{k: v[4:] for k, v in u.items()} for u in users]
    cache = server.prefill(*retrieval_batch(first, "cpu"))
    out, cache = server.extend(cache, *retrieval_batch(rest, "cpu"))
    full = model(*retrieval_batch(users, "cpu"))
    rows = torch.cat([torch.arange(9 * b + 4, 9 * b + 9) for b in range(3)])
    assert_close(out, full[rows].double(), dtype, name="extended rows")
    candidates = torch.randint(0, NUM_ITEMS, (3, 5))
    expected = torch.einsum(
        "be,bte->bt", full[[8, 17, 26]].double(), model.item_embedding(candidates).double()
    )
    assert_close(server.score(cache, candidates), expected, dtype, name="scores")


@gpu_test
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_default_backend_on_the_gpu_matches_the_float64_reference(dtype):
    layer = _layer(ffn_dim=12, backend=None).eval()  # the best backend available
    x = torch.randn(9, 8, dtype=torch.float64)
    offsets = [0, 4, 4, 9]
    want = ref_stu_layer(layer, x, offsets, 6)
    gpu = layer.to("cuda", torch.float32)  # parameters cast to the input dtype per call
    out, _, _ = gpu(x.to("cuda", dtype), torch.tensor(offsets, device="cuda"), max_seq_len=6)
    assert_close(out.cpu(), want, dtype, name="out")
