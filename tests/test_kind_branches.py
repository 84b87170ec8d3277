"""No code outside the model registry and the serving servers branches on a model's kind.

A branch is a comparison with the task labels, a dict keyed by them, an ``isinstance`` against
a model, server, serving-step or task class, or a comparison with a model class's name (the
count the tzrec-gr README gives as a grep). Code asks the model's record, server, ``Limits``
or ``TaskFacts`` instead, so a registered plugin model is never told apart from the built-in
ones.
"""

from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
BRANCH = re.compile(
    r'(==|!=|\bin)\s*\(?"(ranking|retrieval)"|"(ranking|retrieval)"\s*(==|!=|if\b|else\b)'
    r'|"(ranking|retrieval)":|isinstance\([^)]*(HSTU|SASRec|Retrieval|Ranking|Server|Step|Task)'
    r'|(==|!=)\s*"(HSTU|SASRec)[A-Za-z]*"'
)
ALLOWED = re.compile(r"models/registry\.py|serving/(ranking|retrieval)\.py")


def kind_branches(root: pathlib.Path) -> list:
    found = []
    for path in sorted(root.glob("packages/*/src/**/*.py")):
        relative = path.relative_to(root).as_posix()
        if ALLOWED.search(relative):
            continue
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if BRANCH.search(line):
                found.append(f"{relative}:{number}: {line.strip()}")
    return found


def test_no_code_outside_the_registry_and_the_servers_branches_on_a_models_kind():
    assert kind_branches(ROOT) == []


def test_the_count_finds_each_form_of_branch(tmp_path):
    source = tmp_path / "packages" / "p" / "src" / "p"
    source.mkdir(parents=True)
    (source / "m.py").write_text(
        'if task == "ranking":\n'
        '    pass\n'
        'FLOORS = {"retrieval": 1}\n'
        "ok = isinstance(model, HSTURanking)\n"
        'same = name == "HSTURetrieval"\n'
        'fine = task_facts(name).key_metric\n'
    )
    (source / "models").mkdir()
    (source / "models" / "registry.py").write_text('x = task == "ranking"\n')
    assert [line.split(":")[1] for line in kind_branches(tmp_path)] == ["1", "3", "4", "5"]
