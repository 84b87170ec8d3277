"""The attention benchmark's report of the autotuner's choices."""

from __future__ import annotations

import pytest

triton = pytest.importorskip("triton")
impl = pytest.importorskip("tzrec_ops.backends.triton.hstu_attention")

from tzrec_bench.kernels.hstu_attention import chosen_configs  # noqa: E402


def test_chosen_configs_names_tiles_and_query_halves(monkeypatch):
    chosen = {
        "_fwd_kernel": triton.Config({"BLOCK_M": 128, "BLOCK_N": 32, "Q_SPLITS": 2},
                                     num_warps=4, num_stages=3),
        "_bwd_dkdv_kernel": triton.Config({"BLOCK_M": 64, "BLOCK_N": 64}, num_warps=4,
                                          num_stages=2),
        "_bwd_dq_kernel": triton.Config({"BLOCK_M": 128, "BLOCK_N": 64}, num_warps=8,
                                        num_stages=3),
    }
    for attr, config in chosen.items():
        monkeypatch.setattr(getattr(impl, attr), "best_config", config, raising=False)
    assert chosen_configs() == (
        "fwd 128x32 halves w4 s3; dkdv 64x64 w4 s2; dq 128x64 w8 s3"
    )
    monkeypatch.setattr(impl._fwd_kernel, "best_config",
                        triton.Config({"BLOCK_M": 64, "BLOCK_N": 32, "Q_SPLITS": 1},
                                      num_warps=4, num_stages=2))
    assert chosen_configs().startswith("fwd 64x32 w4 s2; ")
