"""tzrec_ops.devices.resolve_device: the --device rule every command shares."""

from __future__ import annotations

import pytest
import torch

from tzrec_ops.devices import DeviceError, resolve_device


def test_auto_is_the_cpu_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == torch.device("cpu")
    assert resolve_device("cpu", local_rank=3) == torch.device("cpu")


def test_cuda_without_a_gpu_is_an_error_naming_the_option(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for name in ("cuda", "cuda:1"):
        with pytest.raises(DeviceError, match=f"^{name}: no CUDA device"):
            resolve_device(name)


def test_a_bare_cuda_is_the_local_ranks_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_device("auto", local_rank=1) == torch.device("cuda", 1)
    assert resolve_device("cuda", local_rank=2) == torch.device("cuda", 2)
    assert resolve_device("cuda:0", local_rank=2) == torch.device("cuda", 0)


def test_a_name_that_is_no_device_is_a_value_error():
    with pytest.raises(ValueError, match="^'gpu' is not a device"):
        resolve_device("gpu")


def test_the_device_option_resolves_as_parsed_and_refuses_in_one_line(monkeypatch, capsys):
    from tzrec_ops.commandline import ArgumentParser
    from tzrec_ops.devices import add_device_option

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    parser = ArgumentParser(prog="cmd")
    add_device_option(parser, "cpu")
    assert parser.parse_args([]).device == torch.device("cpu")
    assert parser.parse_args(["--device", "auto"]).device == torch.device("cpu")
    with pytest.raises(SystemExit) as info:
        parser.parse_args(["--device", "cuda:1"])
    assert info.value.code == 2
    assert capsys.readouterr().err == ("cmd: error: argument --device: cuda:1: no CUDA device "
                                       "is visible to this process (cmd --help lists the "
                                       "options)\n")
