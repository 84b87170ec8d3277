"""The floors of tzrec-gr: serving stands on the models, never under them.

stu/ (layers, KV cache, serving cache) -> transducer -> models -> serving. A module outside
``tzrec_gr/serving/`` that imports ``tzrec_gr.serving`` (at the top, inside a function or
under ``TYPE_CHECKING``) would make serving a dependency of what it serves. Nor do two
modules import each other, even for types only: a helper names what it uses of its caller
(a ``Protocol``) instead of importing the caller's class.
"""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys
from typing import Dict, Iterator, List, Set, Tuple

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


def _import_graph() -> Dict[str, Set[str]]:
    """Each module of tzrec_gr -> the tzrec_gr modules it imports anywhere in its text (a
    package importing its own parent, as ``from tzrec_gr.serving import x`` does, is left out:
    that is the package's ``__init__``, not a loop between modules)."""
    files = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        files[name] = (path, ".".join(parts))
    graph = {}
    for name, (path, dotted) in files.items():
        tree = ast.parse(path.read_text(), str(path))
        graph[name] = {
            imported
            for _, imported in _imported(tree, dotted)
            if imported in files and imported != name and not name.startswith(imported + ".")
        }
    return graph


def _reach(graph: Dict[str, Set[str]], start: str) -> Set[str]:
    """Every module ``start`` imports, directly or through others."""
    reached, todo = set(), list(graph[start])
    while todo:
        module = todo.pop()
        if module not in reached:
            reached.add(module)
            todo.extend(graph[module])
    return reached


def _loops(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """The groups of modules that import each other, through any chain (each sorted)."""
    reach = {module: _reach(graph, module) for module in graph}
    loops: List[List[str]] = []
    for start in sorted(graph):
        if start in reach[start]:
            loop = sorted(m for m in reach[start] if start in reach[m])
            if loop not in loops:
                loops.append(loop)
    return loops


def test_no_two_modules_import_each_other():
    assert _loops(_import_graph()) == []


def test_the_loop_check_finds_a_type_only_loop():
    graph = {"a": {"b"}, "b": {"a"}, "c": {"a"}}
    assert _loops(graph) == [["a", "b"]]


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
