"""The utilities every tzrec package shares: ``tzrec_ops.extras.require`` (optional
dependencies), ``tzrec_ops.measure`` (the benchmarks' timer) and ``tzrec_ops.aoti`` (loading
AOTInductor packages with the compiler's libstdc++ preloaded)."""

from __future__ import annotations

import sys
import time

import pytest
import torch

from tzrec_ops import aoti, measure
from tzrec_ops.extras import require


def test_require_names_the_feature_the_module_and_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "triton", None)  # "import triton" now raises ImportError
    with pytest.raises(
        ImportError,
        match=r"^the Triton backend needs the optional dependency triton, which is not "
        r"installed: pip install 'tzrec-ops\[triton\]'$",
    ) as info:
        require("triton", "tzrec-ops[triton]", "the Triton backend")
    assert info.value.name == "triton"
    assert isinstance(info.value.__cause__, ImportError)


def test_require_returns_an_installed_module():
    assert require("torch", "torch", "anything") is torch


def test_median_ms_on_the_cpu_is_the_median_of_timed_calls(monkeypatch):
    # calls of 1 ms, 1 ms, ..., with one slow call: a mean would move, the median does not
    durations = iter([0.0] + [0.001] * 3 + [0.2] + [0.001] * 100)
    calls = []

    def fn() -> None:
        calls.append(1)
        time.sleep(next(durations))

    ms = measure.median_ms(fn, "cpu", rep_ms=0.0, min_calls=5)
    assert len(calls) == 6  # one untimed warm-up call, then min_calls timed ones
    assert 1.0 <= ms < 50.0


def test_median_ms_times_for_at_least_rep_ms():
    calls = []
    started = time.perf_counter()
    measure.median_ms(lambda: calls.append(1), torch.device("cpu"), rep_ms=30.0, min_calls=1)
    assert (time.perf_counter() - started) * 1e3 >= 30.0
    assert len(calls) > 2


def test_median_ms_on_cuda_uses_do_bench_median(monkeypatch):
    triton_testing = pytest.importorskip("triton.testing")
    seen = {}

    def fake_do_bench(fn, warmup, rep, return_mode):
        seen.update(warmup=warmup, rep=rep, return_mode=return_mode)
        return 1.25

    monkeypatch.setattr(triton_testing, "do_bench", fake_do_bench)
    assert measure.median_ms(lambda: None, "cuda", rep_ms=200.0) == 1.25
    assert seen == {"warmup": 25, "rep": 200, "return_mode": "median"}


def test_preloaded_env_puts_the_compiler_libstdcxx_first(monkeypatch):
    monkeypatch.setattr(aoti, "compiler_libstdcxx", lambda: "/usr/lib/libstdc++.so.6")
    env = aoti.preloaded_env({"LD_PRELOAD": "/other.so", "PATH": "/bin"})
    assert env == {"LD_PRELOAD": "/usr/lib/libstdc++.so.6 /other.so", "PATH": "/bin"}
    assert aoti.preloaded_env({})["LD_PRELOAD"] == "/usr/lib/libstdc++.so.6"
    monkeypatch.setattr(aoti, "compiler_libstdcxx", lambda: None)
    assert aoti.preloaded_env({"PATH": "/bin"}) == {"PATH": "/bin"}


def test_run_in_fresh_process_rejects_an_unknown_kind():
    with pytest.raises(ValueError, match="kind must be one of aoti, program, got 'onnx'"):
        aoti.run_in_fresh_process("model.pt2", [], kind="onnx")


def test_run_in_fresh_process_reports_a_failed_load(tmp_path):
    with pytest.raises(RuntimeError, match="in a fresh process failed with exit code"):
        aoti.run_in_fresh_process(str(tmp_path / "missing.pt2"), [()], kind="program")
