"""``tzrec-bench ops --show-configs``: the report of the autotuner's choices."""

from __future__ import annotations

import sys
import types

import pytest

from tzrec_bench.benchmarks.opbench.triton_configs import KERNELS, chosen_configs


def _config(num_warps, num_stages, maxnreg=None, **kwargs):
    """What ``chosen_configs`` reads of a ``triton.Config``."""
    return types.SimpleNamespace(kwargs=kwargs, num_warps=num_warps, num_stages=num_stages,
                                 maxnreg=maxnreg)


def test_chosen_configs_names_tiles_and_query_halves(monkeypatch):
    fwd = types.SimpleNamespace(best_config=_config(4, 3, BLOCK_M=128, BLOCK_N=32, Q_SPLITS=2))
    dkdv = types.SimpleNamespace(best_config=_config(4, 2, BLOCK_M=64, BLOCK_N=64))
    dq = types.SimpleNamespace(best_config=_config(8, 3, BLOCK_M=128, BLOCK_N=64))
    asked = []

    def attention_kernels(wide=False):
        asked.append(wide)
        return {"hstu_attention_fwd": fwd, "hstu_attention_bwd_dkdv": dkdv,
                "hstu_attention_bwd_dq": dq}

    # stands in for the Triton backend module, so the test needs no triton
    backend = types.SimpleNamespace(attention_kernels=attention_kernels)
    monkeypatch.setitem(sys.modules, "tzrec_ops.backends.triton.hstu_attention", backend)
    assert chosen_configs() == "fwd 128x32 halves w4 s3; dkdv 64x64 w4 s2; dq 128x64 w8 s3"
    assert asked == [False]  # the kernels of head dims up to 128
    fwd.best_config = _config(4, 2, BLOCK_M=64, BLOCK_N=32, Q_SPLITS=1)
    assert chosen_configs().startswith("fwd 64x32 w4 s2; ")
    del dq.best_config  # not tuned yet: left out
    assert chosen_configs() == "fwd 64x32 w4 s2; dkdv 64x64 w4 s2"
    fwd.best_config = _config(4, 4, maxnreg=128, BLOCK_M=64, BLOCK_N=16, Q_SPLITS=1)
    assert chosen_configs() == "fwd 64x16 w4 s4 r128; dkdv 64x64 w4 s2"



def test_chosen_configs_names_the_kernels_tzrec_ops_publishes():
    """The labels' kernel names are those of tzrec-ops' ``attention_kernels()``, in its
    order, and the real backend module answers (an untuned kernel is left out)."""
    pytest.importorskip("triton")
    from tzrec_ops.backends.triton.hstu_attention import attention_kernels

    assert [name for _, name in KERNELS] == list(attention_kernels())
    assert not chosen_configs().startswith("unknown")
