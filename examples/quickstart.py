"""tzrec-ops in one minute, on the CPU: jagged HSTU attention, a norm and a matmul.

    python examples/quickstart.py

Every op picks a backend per call (``backend=`` > ``TZREC_OPS_BACKEND`` > priority); on a
machine without a GPU that is the ``pytorch`` reference backend.
"""

from __future__ import annotations

import torch

from tzrec_ops.ops.hstu_attention import hstu_mha
from tzrec_ops.ops.layer_norm import layer_norm
from tzrec_ops.ops.mm import addmm
from tzrec_ops.registry import resolve_backend

torch.manual_seed(0)
heads, dim = 2, 16
lengths = torch.tensor([3, 5, 2])  # three user histories of different lengths
seq_offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
total = int(seq_offsets[-1])  # jagged: all tokens in one [L, ...] tensor, L = 10

# project the tokens to q, k, v with addmm: [L, D] @ [D, 3 * H * D] + bias
tokens = torch.randn(total, dim)
tokens = layer_norm(tokens, torch.ones(dim), torch.zeros(dim))
weight = torch.randn(dim, 3 * heads * dim) / dim**0.5
qkv = addmm(torch.zeros(3 * heads * dim), tokens, weight)
q, k, v = qkv.view(total, 3, heads, dim).unbind(1)

out = hstu_mha(
    max_seq_len=int(lengths.max()),
    alpha=1.0 / dim**0.5,
    q=q,
    k=k,
    v=v,
    seq_offsets=seq_offsets,
    causal=True,
    num_targets=torch.tensor([1, 2, 0]),  # the last tokens are candidates to score
)
print(f"backend for hstu_mha: {resolve_backend(op='hstu_mha').name}")
print(f"hstu_mha: q {list(q.shape)} with offsets {seq_offsets.tolist()} -> out {list(out.shape)}")

# causal: the first sequence's first token attends to itself only
first = torch.nn.functional.silu((q[0] * k[0]).sum(-1, keepdim=True) / dim**0.5) * v[0]
torch.testing.assert_close(out[0], first / int(lengths.max()))
print("first token checked against a hand computation: ok")
