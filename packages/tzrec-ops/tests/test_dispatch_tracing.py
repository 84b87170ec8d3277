"""Backend dispatch inside torch.compile: choices made while tracing one frame."""

import torch

import tzrec_ops
from tzrec_ops import registry


def test_two_ops_chosen_for_the_first_time_in_one_compiled_frame():
    registry.reset_registry()  # nothing chosen yet: both choices happen during tracing

    def f(x, w, b):
        y = tzrec_ops.layer_norm(x, w, b, backend="pytorch")
        return tzrec_ops.rms_norm(y, w, backend="pytorch")

    x, w, b = torch.randn(4, 8), torch.rand(8) + 0.5, torch.randn(8)
    compiled = torch.compile(f, fullgraph=True, backend="eager")
    torch.testing.assert_close(compiled(x, w, b), f(x, w, b))
