"""``tzrec-bench ops``: every op on the pytorch backend at tiny CPU shapes, its CSV and plot,
the FLOP formulas, option errors (exit 2, one line), and the attention table without triton."""

from __future__ import annotations

import csv
import math
import sys

import pytest
import torch

import tzrec_ops
from tzrec_bench.benchmarks.opbench.cases import CASES, FORWARD_ONLY, SDPA, Case
from tzrec_bench.benchmarks.opbench.shapes import Shape, attention_flops, gemm_flops, jagged_batch
from tzrec_bench.cli import main
from tzrec_ops.registry import backends, get_backend

TINY = ["--device", "cpu", "--dtype", "fp32", "--batch", "2", "--heads", "2", "--dim", "8",
        "--embedding", "16", "--rep", "1", "--no-progress"]


def _rows(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_every_registered_op_has_benchmark_inputs():
    registered = {op for backend in backends() for op in backend.ops}
    assert registered <= set(CASES), registered - set(CASES)
    assert all(callable(getattr(tzrec_ops, op)) for op in CASES)


def test_attention_and_gemm_flops_by_hand():
    # lengths 2 and 3: sum of squares 13; H=1, A=V=1 -> fwd 1*2*13, bwd 1*13*(3+2)
    lengths = torch.tensor([2, 3])
    assert attention_flops(lengths, 1, 1, 1, "fwd") == 26
    assert attention_flops(lengths, 1, 1, 1, "bwd") == 65
    assert attention_flops(lengths, 4, 128, 64, "fwd") == 4 * 192 * 13
    assert gemm_flops(3, 4, 5, "fwd") == 120 and gemm_flops(3, 4, 5, "bwd") == 240


def test_every_op_on_pytorch_writes_csv_and_plot(tmp_path, capsys):
    out_csv, png = tmp_path / "ops.csv", tmp_path / "ops.png"
    code = main(["ops", "--op", "all", "--backends", "pytorch", "--seq-lens", "16,24", *TINY,
                 "--csv", str(out_csv), "--plot", str(png)])
    printed = capsys.readouterr().out
    assert code == 0, printed
    rows = _rows(out_csv)
    pytorch = get_backend("pytorch")
    expected = {(op, "pytorch", mode, n) for op in CASES if op in pytorch.ops
                for mode in ("fwd", "bwd") if mode == "fwd" or op not in FORWARD_ONLY
                for n in ("16", "24")}
    expected |= {("hstu_mha", SDPA, mode, n) for mode in ("fwd", "bwd") for n in ("16", "24")}
    got = {(r["op"], r["provider"], r["mode"], r["max_seq_len"]) for r in rows}
    assert got == expected and len(rows) == len(expected)
    for r in rows:
        assert r["error"] == "" and float(r["ms"]) > 0
        assert (r["device"], r["torch"], r["dtype"], r["value_checks"]) == (
            "cpu", torch.__version__, "fp32", "on")
        assert r["peak_mib"] == ""  # not measured on the CPU
        assert (r["tflops"] == "") != (r["gbps"] == "")  # one throughput per row
    # the attention rows' TFLOP/s are the §6 FLOPs of the batch over the time
    for r in rows:
        if r["op"] == "hstu_mha" and r["provider"] == "pytorch":
            n = int(r["max_seq_len"])
            flops = attention_flops(jagged_batch(Shape(2, n, 2, 8, 8, 16)).lengths, 2, 8, 8,
                                    r["mode"])
            assert float(r["tflops"]) == pytest.approx(flops / float(r["ms"]) / 1e9, rel=1e-4)
    assert "skipped: backend pytorch does not implement hstu_preprocess_and_attention" in printed
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_value_checks_both_and_rows_are_appended(tmp_path, capsys):
    out_csv = tmp_path / "ops.csv"
    argv = ["ops", "--op", "layer_norm", "--backends", "pytorch", "--seq-lens", "8", *TINY,
            "--value-checks", "both", "--csv", str(out_csv)]
    assert main(argv) == 0
    first = capsys.readouterr().out
    assert main(argv) == 0
    second = capsys.readouterr().out
    assert "pytorch[off]" in first
    rows = _rows(out_csv)  # one header, then both runs' rows
    assert [(r["value_checks"], r["mode"]) for r in rows] == [
        ("on", "fwd"), ("on", "bwd"), ("off", "fwd"), ("off", "bwd")] * 2
    # where the rows go, before the sweep (the first table line) and after it
    for out in (first, second):
        assert out.index(f"csv: rows will be appended to {out_csv}\n") < out.index("layer_norm")
    assert first.endswith(f"csv: 4 rows appended to {out_csv} (a new file)\n")
    assert second.endswith(f"csv: 4 rows appended to {out_csv}\n")


def test_default_csv_path_is_printed_with_its_folder(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    argv = ["ops", "--op", "layer_norm", "--backends", "pytorch", "--seq-lens", "8",
            "--mode", "fwd", *TINY]
    assert main(argv) == 0
    out = capsys.readouterr().out
    where = f"tzrec-bench-runs/ops.csv (under {tmp_path})"
    assert f"csv: rows will be appended to {where}\n" in out
    assert out.endswith(f"csv: 1 row appended to {where} (a new file)\n")
    assert len(_rows(tmp_path / "tzrec-bench-runs" / "ops.csv")) == 1
    assert main([*argv, "--no-csv"]) == 0
    assert "csv:" not in capsys.readouterr().out


def test_a_failing_point_is_a_row_with_its_error(tmp_path, monkeypatch, capsys):
    def broken(inputs, backend):
        def call(x):
            raise RuntimeError("planted failure")
        return Case(call, [inputs.rand(4, 4)])

    monkeypatch.setitem(CASES, "layer_norm", broken)
    out_csv = tmp_path / "ops.csv"
    code = main(["ops", "--op", "layer_norm,rms_norm", "--backends", "pytorch", "--mode", "fwd",
                 "--seq-lens", "8", *TINY, "--csv", str(out_csv)])
    assert code == 1
    rows = {r["op"]: r for r in _rows(out_csv)}
    assert rows["layer_norm"]["error"] == "RuntimeError: planted failure"
    assert rows["layer_norm"]["ms"] == "" and float(rows["rms_norm"]["ms"]) > 0
    assert "1 of 2 points failed" in capsys.readouterr().out


def _triton_unavailable():
    return get_backend("triton").unavailable_reason() is not None


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--op", "no_such_op"], "--op: unknown op 'no_such_op'"),
        (["--op", "hstu_mha", "--backends", "no_such_backend"],
         "--backends no_such_backend: unknown backend 'no_such_backend'"),
        (["--op", "hstu_mha", "--mode", "sideways"], "--mode: unknown mode 'sideways'"),
        (["--op", "hstu_mha", "--dtype", "fp8"], "--dtype: unknown value 'fp8'"),
        (["--op", "hstu_mha", "--seq-lens", "16,x"], "--seq-lens: expected comma-separated"),
        (["--op", "hstu_mha", "--batch", "0"], "--batch: must be >= 1, got 0"),
        pytest.param(["--op", "hstu_mha", "--backends", "triton"],
                     "--backends triton: unavailable on this machine",
                     marks=pytest.mark.skipif(not _triton_unavailable(),
                                              reason="triton runs here")),
        pytest.param(["--op", "hstu_mha", "--device", "cuda"], "--device cuda: no CUDA device",
                     marks=pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA here")),
    ],
)
def test_bad_options_exit_2_with_one_line(argv, message, capsys, tmp_path):
    assert main(["ops", *argv, "--csv", str(tmp_path / "x.csv")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tzrec-bench ops: error: " + message), err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert not (tmp_path / "x.csv").exists()


def test_plot_without_matplotlib_names_the_extra(monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    code = main(["ops", "--op", "layer_norm", "--backends", "pytorch", "--seq-lens", "8", *TINY,
                 "--no-csv", "--plot", str(tmp_path / "p.png")])
    assert code == 2
    assert "pip install 'tzrec-bench[plot]'" in capsys.readouterr().err


def test_attention_table_runs_without_triton(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "triton", None)  # as on a machine without it
    code = main(["ops", "--op", "hstu_mha", "--backends", "pytorch", "--batch", "2",
                 "--seq-lens", "16", "--heads", "2", "--dim", "8", "--hidden-dim", "8",
                 "--dtype", "fp32", "--backend-max-seq-len", "pytorch=512", "--rep", "1",
                 "--no-progress", "--csv", str(tmp_path / "a.csv")])
    assert code == 0
    rows = _rows(tmp_path / "a.csv")
    assert {(r["op"], r["provider"], r["mode"]) for r in rows} == {
        ("hstu_mha", p, m) for p in ("pytorch", SDPA) for m in ("fwd", "bwd")}
    assert all(math.isfinite(float(r["tflops"])) for r in rows)


def test_stu_stack_runs_on_cpu_without_triton(monkeypatch, capsys):
    from tzrec_bench.benchmarks.modules import stu_stack

    monkeypatch.setitem(sys.modules, "triton", None)
    code = stu_stack.main(["--providers", "pytorch", "--batch", "2", "--max-seq-len", "16",
                           "--embedding-dim", "16", "--heads", "2", "--head-dim", "8",
                           "--layers", "1", "--cache-len", "12", "--delta", "2",
                           "--dtype", "fp32"])
    out = capsys.readouterr().out
    assert code == 0
    assert "triton not installed" in out and "train       pytorch:" in out
    assert out.count("full recompute") == 2  # score and append, eager only on the CPU


@pytest.mark.gpu
def test_attention_on_cuda_measures_memory_and_the_sdpa_line(tmp_path):
    out_csv = tmp_path / "ops.csv"
    code = main(["ops", "--op", "hstu_mha,layer_norm", "--backends", "pytorch,triton",
                 "--seq-lens", "256", "--batch", "8", "--rep", "20", "--no-progress",
                 "--csv", str(out_csv), "--plot", str(tmp_path / "ops.png")])
    assert code == 0
    rows = _rows(out_csv)
    assert {(r["op"], r["provider"]) for r in rows} == {
        ("hstu_mha", "pytorch"), ("hstu_mha", "triton"), ("hstu_mha", SDPA),
        ("layer_norm", "pytorch"), ("layer_norm", "triton")}
    for r in rows:
        assert r["device"] == torch.cuda.get_device_name() and r["dtype"] == "bf16"
        assert float(r["ms"]) > 0 and float(r["peak_mib"]) >= 0
    bwd = [r for r in rows if r["mode"] == "bwd" and r["op"] == "hstu_mha"]
    assert all(float(r["peak_mib"]) > 0 for r in bwd)  # gradients at least


def test_a_plugin_backend_is_timed_by_its_name(monkeypatch, tmp_path, capsys):
    from tzrec_ops.registry import Backend, get_registry

    pytorch = get_backend("pytorch")
    plugin = Backend(name="plugin_x", priority=-1, ops={"layer_norm": pytorch.ops["layer_norm"]})
    monkeypatch.setitem(get_registry().backends, "plugin_x", plugin)
    out_csv = tmp_path / "ops.csv"
    code = main(["ops", "--op", "layer_norm,rms_norm", "--backends", "plugin_x", "--mode", "fwd",
                 "--seq-lens", "8", *TINY, "--csv", str(out_csv)])
    assert code == 0
    assert [(r["op"], r["provider"]) for r in _rows(out_csv)] == [("layer_norm", "plugin_x")]
    assert "skipped: backend plugin_x does not implement rms_norm" in capsys.readouterr().out
