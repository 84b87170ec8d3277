"""``tzrec-bench ops --show-configs``: the report of the autotuner's choices."""

from __future__ import annotations

import sys
import types

from tzrec_bench.opbench.triton_configs import chosen_configs


def _config(num_warps, num_stages, maxnreg=None, **kwargs):
    """What ``chosen_configs`` reads of a ``triton.Config``."""
    return types.SimpleNamespace(kwargs=kwargs, num_warps=num_warps, num_stages=num_stages,
                                 maxnreg=maxnreg)


def test_chosen_configs_names_tiles_and_query_halves(monkeypatch):
    kernels = types.SimpleNamespace(
        _fwd_kernel=types.SimpleNamespace(
            best_config=_config(4, 3, BLOCK_M=128, BLOCK_N=32, Q_SPLITS=2)),
        _bwd_dkdv_kernel=types.SimpleNamespace(best_config=_config(4, 2, BLOCK_M=64, BLOCK_N=64)),
        _bwd_dq_kernel=types.SimpleNamespace(best_config=_config(8, 3, BLOCK_M=128, BLOCK_N=64)),
    )
    # stands in for the Triton backend module, so the test needs no triton
    monkeypatch.setitem(sys.modules, "tzrec_ops.backends.triton.hstu_attention", kernels)
    assert chosen_configs() == "fwd 128x32 halves w4 s3; dkdv 64x64 w4 s2; dq 128x64 w8 s3"
    kernels._fwd_kernel.best_config = _config(4, 2, BLOCK_M=64, BLOCK_N=32, Q_SPLITS=1)
    assert chosen_configs().startswith("fwd 64x32 w4 s2; ")
    del kernels._bwd_dq_kernel.best_config  # not tuned yet: left out
    assert chosen_configs() == "fwd 64x32 w4 s2; dkdv 64x64 w4 s2"
    kernels._fwd_kernel.best_config = _config(4, 4, maxnreg=128, BLOCK_M=64, BLOCK_N=16,
                                              Q_SPLITS=1)
    assert chosen_configs() == "fwd 64x16 w4 s4 r128; dkdv 64x64 w4 s2"


def test_backward_kernel_benchmark_times_both_kernels_and_restores_the_choice(capsys):
    import os

    from tzrec_bench.kernels import attention_backward

    assert attention_backward.main(
        ["--backends", "pytorch", "--seq-lens", "16", "--batch", "2", "--heads", "1",
         "--dim", "8", "--dtype", "fp32", "--rep-ms", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[5] for line in lines[1:3]] == ["two_pass:", "one_pass:"]
    assert "one-pass / two-pass speed" in lines[3]
    assert attention_backward.BACKWARD_ENV not in os.environ
