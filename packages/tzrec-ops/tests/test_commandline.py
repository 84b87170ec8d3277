"""tzrec_ops.commandline.ArgumentParser: one-line errors for every tzrec command line."""

from __future__ import annotations

import pytest

from tzrec_ops.commandline import ArgumentParser


def _parser() -> ArgumentParser:
    parser = ArgumentParser(prog="tool")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run")
    run.add_argument("--n", type=int, required=True)
    return parser


@pytest.mark.parametrize("argv, line", [
    (["run", "--n", "x"], "tool run: error: argument --n: invalid int value: 'x' "
                          "(tool run --help lists the options)"),
    (["run"], "tool run: error: the following arguments are required: --n "
              "(tool run --help lists the options)"),
    ([], "tool: error: the following arguments are required: command "
         "(tool --help lists the options)"),
])
def test_errors_are_one_line_with_status_2(capsys, argv, line):
    with pytest.raises(SystemExit) as info:
        _parser().parse_args(argv)
    assert info.value.code == 2
    assert capsys.readouterr().err == line + "\n"


def test_help_is_unchanged(capsys):
    with pytest.raises(SystemExit) as info:
        _parser().parse_args(["run", "--help"])
    assert info.value.code == 0
    assert capsys.readouterr().out.startswith("usage: tool run [-h] --n N")


def test_python_dash_m_tzrec_ops_errors_in_one_line(capsys):
    from tzrec_ops.__main__ import main

    with pytest.raises(SystemExit) as info:
        main(["nope"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("python -m tzrec_ops: error: ") and "invalid choice: 'nope'" in err
    assert err.endswith(" (python -m tzrec_ops --help lists the options)\n")
    assert err.count("\n") == 1
