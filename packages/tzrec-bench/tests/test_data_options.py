"""The rules of ``--data`` and the options that go with it: one function
(:func:`check_data_options`), the same message from ``tzrec-bench train``, a run's settings
(:meth:`TrainConfig.check`) and :func:`load_dataset`."""

from __future__ import annotations

import re

import pytest

from tzrec_bench.cli import main
from tzrec_bench.data import load_dataset
from tzrec_bench.data.load import DATA_ENV, DataOptionError, check_data_options
from tzrec_bench.train.config import ConfigError, TrainConfig

SETS = ("synthetic, ml-100k, ml-1m, ml-20m, kuairand, amazon-games, amazon-beauty, "
        "amazon-sports")


@pytest.fixture
def log(tmp_path):
    path = tmp_path / "events.csv"
    path.write_text("user_id,item_id,timestamp\n1,2,3\n")
    return path


@pytest.fixture(autouse=True)
def no_data_env(monkeypatch):
    monkeypatch.delenv(DATA_ENV, raising=False)


def _rules(tmp_path, log):
    """(settings, option, message) of each rule, in the order they are checked."""
    return [
        (dict(data="ml-10m"), "--data",
         f"'ml-10m' is neither a data set ({SETS}) nor an existing file or folder"),
        (dict(data=str(log), columns="who=uid"), "--columns",
         "'who=uid' is not KEY=COLUMN with KEY one of user, item, time, rating, action"),
        (dict(data="ml-100k", columns="user=u"), "--columns",
         "ml-100k has its own format; column mappings are for event logs given by path"),
        (dict(data="synthetic", columns="user=u"), "--columns",
         "synthetic has its own format; column mappings are for event logs given by path"),
        (dict(data="synthetic", min_events=5), "--min-events",
         "the synthetic data set is generated; the k-core filter applies to data read from "
         "files"),
    ]


def _folder_rules(tmp_path, log):
    """The rules on where a named data set's files are (``folders=True``)."""
    return [
        (dict(data=str(log), data_dir=str(tmp_path)), "--data-dir",
         "an event log given by path (--data) reads no other folder"),
        (dict(data="synthetic", data_dir=str(tmp_path)), "--data-dir",
         "the synthetic data set is generated and reads no files"),
        (dict(data="ml-1m"), "--data-dir",
         f"--data ml-1m needs the folder of its files (or {DATA_ENV} set to a folder holding "
         "ml-1m/)"),
    ]


def _expect(option: str, message: str) -> str:
    return "^" + re.escape(f"{option}: {message}") + "$"


def test_each_rule_raises_its_message_naming_the_option(tmp_path, log):
    for settings, option, message in _rules(tmp_path, log) + _folder_rules(tmp_path, log):
        with pytest.raises(DataOptionError, match=_expect(option, message)) as info:
            check_data_options(**settings)
        assert info.value.field == option[2:].replace("-", "_")
        assert isinstance(info.value, ValueError)


def test_a_missing_folder_is_a_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match=_expect(
            "--data-dir", f"no such folder: {tmp_path / 'gone'}")):
        check_data_options("ml-100k", tmp_path / "gone")


def test_what_is_accepted(tmp_path, log, monkeypatch):
    check_data_options("synthetic")
    check_data_options(str(log), columns="user=user_id,item=item_id", min_events=2)
    check_data_options("ml-100k", tmp_path, min_events=5)
    monkeypatch.setenv(DATA_ENV, str(tmp_path))  # the folder comes from the environment
    check_data_options("ml-100k")


def test_without_folders_only_what_the_data_is_is_checked(tmp_path, log):
    for settings, _, _ in _folder_rules(tmp_path, log):
        check_data_options(**settings, folders=False)
    check_data_options("ml-100k", tmp_path / "gone", folders=False)
    for settings, option, message in _rules(tmp_path, log):
        with pytest.raises(DataOptionError, match=_expect(option, message)):
            check_data_options(**settings, folders=False)


def test_a_runs_settings_give_the_same_messages_as_config_errors(tmp_path, log):
    for settings, option, message in _rules(tmp_path, log):
        with pytest.raises(ConfigError, match=_expect(option, message)) as info:
            TrainConfig(**settings).check()
        assert info.value.option == option
    # where the files are is settled when the data is read (a run config's comes later)
    TrainConfig(data="ml-1m").check()


def test_load_dataset_gives_the_same_messages(tmp_path, log):
    for settings, option, message in _rules(tmp_path, log) + _folder_rules(tmp_path, log):
        settings = dict(settings)
        name = settings.pop("data")
        with pytest.raises(ValueError, match=_expect(option, message)):
            load_dataset(name, cache_dir=tmp_path / "cache", **settings)


def test_train_exits_2_with_the_same_messages(tmp_path, log, capsys):
    for settings, option, message in _rules(tmp_path, log) + _folder_rules(tmp_path, log):
        argv = ["train", "--out-dir", str(tmp_path / "run")]
        for key, value in settings.items():
            argv += [f"--{key.replace('_', '-')}", str(value)]
        with pytest.raises(SystemExit) as info:
            main(argv)
        err = capsys.readouterr().err
        assert info.value.code == 2, argv
        assert f"tzrec-bench train: error: {option}: {message} (" in err, err
    with pytest.raises(SystemExit) as info:
        main(["train", "--data", "ml-100k", "--data-dir", str(tmp_path / "gone")])
    assert info.value.code == 2
    assert f"error: --data-dir: no such folder: {tmp_path / 'gone'}" in capsys.readouterr().err


def test_evaluate_refuses_unknown_data_with_the_same_message(tmp_path, capsys):
    (tmp_path / "best.pt").write_bytes(b"")  # refused before it is read
    with pytest.raises(SystemExit) as info:
        main(["evaluate", str(tmp_path / "best.pt"), "--data", "ml-10m"])
    assert info.value.code == 2
    assert (f"tzrec-bench evaluate: error: --data: 'ml-10m' is neither a data set ({SETS}) "
            "nor an existing file or folder (") in capsys.readouterr().err
