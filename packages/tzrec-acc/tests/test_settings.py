"""tzrec_acc.settings: every toggle's values, defaults and errors; TF32 applied explicitly."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest
import torch

from tzrec_acc import settings


def test_defaults_are_all_off():
    assert settings.read({}) == settings.Settings(
        enable_aot=False,
        enable_trt=False,
        quant_emb="fp32",
        quant_ec_emb="fp32",
        input_tile=0,
        tf32_matmul=False,
        tf32_cudnn=False,
    )


def test_values_are_parsed():
    env = {
        "ENABLE_AOT": "1",
        "ENABLE_TRT": "true",
        "QUANT_EMB": "INT4",
        "QUANT_EC_EMB": "1",
        "INPUT_TILE": "3",
        "TF32_MATMUL": "on",
        "TF32_CUDNN": "no",
    }
    assert settings.read(env) == settings.Settings(True, True, "int4", "int8", 3, True, False)
    assert settings.quant_emb({"QUANT_EMB": "0"}) == "fp32"
    assert settings.quant_emb({"QUANT_EMB": "fp16"}) == "fp16"


@pytest.mark.parametrize(
    "name, value, message",
    [
        ("ENABLE_AOT", "maybe", r"ENABLE_AOT must be 0 or 1 .* got 'maybe'"),
        ("ENABLE_TRT", "2", r"ENABLE_TRT must be 0 or 1 .* got '2'"),
        ("QUANT_EMB", "int3", r"QUANT_EMB must be one of FP32, FP16, INT8, INT4 .* got 'int3'"),
        ("QUANT_EC_EMB", "bf16", r"QUANT_EC_EMB must be one of .* got 'bf16'"),
        ("INPUT_TILE", "1", r"INPUT_TILE must be one of 0, 2, 3, got '1'"),
        ("INPUT_TILE", "x", r"INPUT_TILE must be one of 0, 2, 3, got 'x'"),
        ("TF32_CUDNN", "yes please", r"TF32_CUDNN must be 0 or 1"),
    ],
)
def test_bad_value_names_the_variable(name, value, message):
    with pytest.raises(ValueError, match=message):
        settings.read({name: value})


def test_accessors_read_os_environ_at_call_time(monkeypatch):
    monkeypatch.setenv("ENABLE_AOT", "1")
    assert settings.enable_aot()
    monkeypatch.setenv("ENABLE_AOT", "0")
    assert not settings.enable_aot()


def test_apply_tf32_sets_and_returns_previous(monkeypatch):
    before = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    try:
        monkeypatch.setenv("TF32_MATMUL", "1")
        monkeypatch.setenv("TF32_CUDNN", "0")
        assert settings.apply_tf32() == before
        assert torch.backends.cuda.matmul.allow_tf32 is True
        assert torch.backends.cudnn.allow_tf32 is False
        assert settings.apply_tf32(matmul=False, cudnn=True) == (True, False)
        assert torch.backends.cuda.matmul.allow_tf32 is False
        assert torch.backends.cudnn.allow_tf32 is True
    finally:
        settings.apply_tf32(*before)


def test_import_changes_no_torch_setting():
    code = (
        "import os, torch; os.environ['TF32_MATMUL'] = '1';"
        "before = torch.backends.cuda.matmul.allow_tf32;"
        "import tzrec_acc.settings;"
        "print(before == torch.backends.cuda.matmul.allow_tf32)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "True", out.stderr
    assert importlib.import_module("tzrec_acc.settings") is settings
