"""The floors of tzrec-gr: serving stands on the models, never under them.

stu/ (layers, KV cache, serving cache) -> transducer -> models -> serving. A module outside
``tzrec_gr/serving/`` that imports ``tzrec_gr.serving`` (at the top, inside a function or
under ``TYPE_CHECKING``) would make serving a dependency of what it serves.
"""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys
from typing import Iterator, Tuple

import tzrec_gr

PACKAGE = pathlib.Path(tzrec_gr.__file__).parent
SERVING = "tzrec_gr.serving"


def _imported(tree: ast.AST, module: str) -> Iterator[Tuple[int, str]]:
    """(line, module) of every import in ``tree``, relative ones resolved against
    ``module`` (the dotted name of the file)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = module.split(".")[: -node.level]
                base = ".".join([*parts, base] if base else parts)
            yield node.lineno, base
            for alias in node.names:  # ``from tzrec_gr import serving``
                yield node.lineno, f"{base}.{alias.name}"


def _serving_imports_below_serving() -> list:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE.parent)
        if relative.parts[:2] == ("tzrec_gr", "serving"):
            continue
        module = ".".join(relative.with_suffix("").parts)
        if path.name == "__init__.py":
            module += ".__init__"  # relative imports resolve from the package itself
        tree = ast.parse(path.read_text(), str(path))
        for line, name in _imported(tree, module):
            if name == SERVING or name.startswith(SERVING + "."):
                found.append(f"{relative}:{line} imports {name}")
    return found


def test_nothing_outside_serving_imports_serving():
    assert _serving_imports_below_serving() == []


def test_the_check_sees_every_form_of_import():
    tree = ast.parse(
        "import tzrec_gr.serving.session\n"
        "from tzrec_gr.serving import ServingSession\n"
        "from tzrec_gr import serving\n"
        "def f():\n"
        "    from ..serving.cache import ServingCache\n"
    )
    found = list(_imported(tree, "tzrec_gr.models.ranking"))
    lines = {line for line, n in found if n == SERVING or n.startswith(SERVING + ".")}
    assert lines == {1, 2, 3, 5}, found


def test_the_models_import_without_serving():
    code = (
        "import sys, tzrec_gr, tzrec_gr.models\n"
        "assert not any(m.startswith('tzrec_gr.serving') for m in sys.modules), "
        "sorted(m for m in sys.modules if m.startswith('tzrec_gr.serving'))\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
