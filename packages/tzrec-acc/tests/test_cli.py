"""``python -m tzrec_acc export / run`` end to end on the CPU, and every error path.

The AOTInductor test compiles one package (about a minute on two CPU cores); the others
save exported programs, which load in a fresh process in seconds.
"""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys

import pytest
import torch
from _models import RANKING, RETRIEVAL, ranking, retrieval
from test_checkpoint import bench_checkpoint

from tzrec_acc.cli import _auc, main


def _ok_lines(out: str) -> int:
    return sum(
        1 for line in out.splitlines() if line.strip().startswith("output ") and "ok" in line
    )


def test_aoti_package_from_a_bench_checkpoint_round_trips(tmp_path, capsys):
    bench_checkpoint(tmp_path / "best.pt")
    package = str(tmp_path / "ranking.pt2")
    code = main(
        [
            "export",
            "--model",
            str(tmp_path / "best.pt"),
            "--format",
            "aoti",
            "--output",
            package,
            "--batch",
            "3",
            "--max-batch",
            "8",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    assert _ok_lines(out) == 2 and "MISMATCH" not in out  # two batch sizes, one output each
    assert main(["run", package]) == 0
    out = capsys.readouterr().out
    assert "output 0: shape [" in out and ", 2] float32" in out and "ok" in out


def _state_dict_and_config(tmp_path, model, kwargs, name):
    torch.save(model.state_dict(), tmp_path / "weights.pt")
    (tmp_path / "model.json").write_text(json.dumps({"model": name, "kwargs": kwargs}))
    return ["--model", str(tmp_path / "weights.pt"), "--config", str(tmp_path / "model.json")]


def test_fx_serving_step_with_int8_embeddings_from_quant_emb(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("QUANT_EMB", "INT8")  # the default of --quantize; no --format: fx
    source = _state_dict_and_config(tmp_path, ranking(), RANKING, "HSTURanking")
    package = str(tmp_path / "ranking.pt2")
    code = main(["export", *source, "--form", "serving", "--history", "8", "--output", package])
    out = capsys.readouterr().out
    assert code == 0, out
    assert _ok_lines(out) == 2 and "MISMATCH" not in out and "(fx)" in out
    assert "package vs the eager --quantize emb-int8 model (the packaging)" in out
    assert "--quantize emb-int8 eager model vs the float32 model on the same batches" in out
    assert 0 < _float_error(out) < 0.5  # int8 rows: close to float, but not equal
    tasks = re.findall(r"task (\d): probability max abs err \S+; AUC change ([-+.\d]+)", out)
    assert [t for t, _ in tasks] == ["0", "1"] and all(-1 <= float(c) <= 0 for _, c in tasks)
    sample = torch.load(package + ".sample.pt", weights_only=False)
    assert sample["kind"] == "program" and sample["imports"] == []
    assert main(["run", package]) == 0
    assert "package vs the eager outputs stored at export" in capsys.readouterr().out


def test_fx_program_in_bf16(tmp_path, capsys):
    source = _state_dict_and_config(tmp_path, ranking(), RANKING, "HSTURanking")
    package = str(tmp_path / "ranking.pt2")
    code = main(["export", *source, "--format", "fx", "--output", package, "--precision", "bf16"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert _ok_lines(out) == 2 and "MISMATCH" not in out
    assert "--precision bf16 eager model vs the float32 model" in out
    assert 0 < _float_error(out) < 0.5


def _float_error(out: str) -> float:
    """The max abs error of output 0 in export's lossy-vs-float32 lines."""
    (err,) = re.findall(r"error of output 0: shape \[\d+, \d+\]  max abs err (\S+)", out)
    return float(err)


def test_auc_counts_pairs_and_ties_by_half():
    gen = torch.Generator().manual_seed(0)
    scores = torch.randint(0, 5, (40,), generator=gen).float()  # many ties
    labels = torch.rand(40, generator=gen) > 0.6
    pos, neg = scores[labels], scores[~labels]
    pairs = (pos[:, None] > neg[None, :]).double() + 0.5 * (pos[:, None] == neg[None, :])
    assert _auc(scores, labels) == pytest.approx(float(pairs.mean()))
    assert _auc(scores, torch.ones(40, dtype=torch.bool)) is None


def test_bf16_serving_step_takes_its_cache_in_bf16(tmp_path, capsys):
    source = _state_dict_and_config(tmp_path, ranking(), RANKING, "HSTURanking")
    package = str(tmp_path / "serving.pt2")
    argv = ["export", *source, "--format", "fx", "--form", "serving", "--history", "8"]
    code = main([*argv, "--precision", "bf16", "--output", package])
    out = capsys.readouterr().out
    assert code == 0, out
    assert _ok_lines(out) == 2 and "MISMATCH" not in out
    keys, values = torch.load(package + ".sample.pt", weights_only=False)["batches"][0][:2]
    # held as a bf16 model's prefill stores it, so the package never converts the cache
    assert {t.dtype for t in [*keys, *values]} == {torch.bfloat16}
    assert main(["run", package]) == 0


def test_settings_choose_trt_and_bad_values_exit_2(tmp_path, capsys, monkeypatch):
    bench_checkpoint(tmp_path / "best.pt")
    argv = ["export", "--model", str(tmp_path / "best.pt"), "--output", str(tmp_path / "m.pt2")]
    monkeypatch.setenv("QUANT_EMB", "int3")
    assert main(argv) == 2
    assert "QUANT_EMB must be one of FP32, FP16, INT8, INT4" in capsys.readouterr().err
    if importlib.util.find_spec("torch_tensorrt") is None:
        monkeypatch.setenv("QUANT_EMB", "0")
        monkeypatch.setenv("ENABLE_TRT", "1")  # no --format: trt
        assert main(argv) == 2
        assert "pip install 'tzrec-acc[tensorrt]'" in capsys.readouterr().err


def test_static_retrieval_serving_step(tmp_path, capsys):
    source = _state_dict_and_config(tmp_path, retrieval(), RETRIEVAL, "HSTURetrieval")
    package = str(tmp_path / "retrieval.pt2")
    code = main(
        [
            "export",
            *source,
            "--format",
            "fx",
            "--form",
            "serving",
            "--dynamic",
            "none",
            "--history",
            "6",
            "--new",
            "3",
            "--output",
            package,
        ]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    assert _ok_lines(out) == 1  # a static program runs the example's shapes only


def test_module_entry_point_prints_usage():
    out = subprocess.run(
        [sys.executable, "-m", "tzrec_acc", "--help"], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0 and "export" in out.stdout and "run" in out.stdout


@pytest.mark.parametrize(
    "options, message",
    [
        (["--quantize", "dense-int8"], "dense-int8 uses torch's dynamic int8 quantization"),
        (["--quantize", "emb-int8", "--precision", "bf16"], "cannot be combined"),
        (["--output", "model.so"], "--output must end with .pt2, got 'model.so'"),
        (["--batch", "8", "--max-batch", "8"], r"--batch \(8\) must be < --max-batch \(8\)"),
        (["--new", "0"], "--new must be >= 1"),
    ],
)
def test_bad_options_exit_2(tmp_path, capsys, options, message):
    source = _state_dict_and_config(tmp_path, ranking(), RANKING, "HSTURanking")
    argv = ["export", *source, "--format", "fx", "--output", str(tmp_path / "m.pt2"), *options]
    if "--output" in options:
        argv = ["export", *source, "--format", "fx", *options]
    assert main(argv) == 2
    assert pytest.importorskip("re").search(message, capsys.readouterr().err)


def test_bad_dynamic_value_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as info:
        main(["export", "--model", "x", "--output", "m.pt2", "--dynamic", "batch"])
    assert info.value.code == 2
    assert "--dynamic takes 'none' or a comma list of users, tokens, got 'batch'" in (
        capsys.readouterr().err
    )


def test_unsupported_model_and_missing_files(tmp_path, capsys):
    bench_checkpoint(tmp_path / "ok.pt")
    payload = torch.load(tmp_path / "ok.pt", weights_only=True)
    sasrec = {"model": "SASRec", "kwargs": {}}
    torch.save({**payload, "model_config": sasrec}, tmp_path / "s.pt")
    out = str(tmp_path / "m.pt2")
    assert main(["export", "--model", str(tmp_path / "s.pt"), "--output", out]) == 2
    assert "model must be one of HSTURanking, HSTURetrieval, got 'SASRec'" in (
        capsys.readouterr().err
    )
    assert main(["export", "--model", str(tmp_path / "none.pt"), "--output", out]) == 2
    assert "no checkpoint or state dict at" in capsys.readouterr().err
    assert main(["run", str(tmp_path / "none.pt2")]) == 2
    assert "no file at" in capsys.readouterr().err


@pytest.mark.parametrize("keep", [0, 100, 0.5, -1])  # bytes or a fraction of the file kept
def test_truncated_checkpoint_exits_2_naming_it(tmp_path, capsys, keep):
    bench_checkpoint(tmp_path / "full.pt")
    data = (tmp_path / "full.pt").read_bytes()
    cut = int(len(data) * keep) if isinstance(keep, float) else keep % len(data)
    (tmp_path / "best.pt").write_bytes(data[:cut])
    out = str(tmp_path / "m.pt2")
    assert main(["export", "--model", str(tmp_path / "best.pt"), "--output", out]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {tmp_path / 'best.pt'}: cannot be loaded (")
    assert err.endswith("expected a checkpoint.pt or best.pt written by `tzrec-bench train`\n")
    assert err.count("\n") == 1 and "Traceback" not in err
    assert not (tmp_path / "m.pt2").exists()


@pytest.mark.skipif(
    importlib.util.find_spec("torch_tensorrt") is not None, reason="torch-tensorrt is installed"
)
def test_trt_without_torch_tensorrt_names_the_extra(tmp_path, capsys):
    bench_checkpoint(tmp_path / "best.pt")
    argv = [
        "export",
        "--model",
        str(tmp_path / "best.pt"),
        "--format",
        "trt",
        "--output",
        str(tmp_path / "m.pt2"),
    ]
    assert main(argv) == 2
    assert "pip install 'tzrec-acc[tensorrt]'" in capsys.readouterr().err
