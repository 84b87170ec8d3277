"""No package reaches into a sibling's private parts.

Every ``import`` in the packages' sources and tests that names another tzrec package must use
that package's public surface: no underscored module or name, a name listed in the module's
``__all__`` (a module imported from another package declares what it exports), and no
``*.testing`` module from production code. Read from the source text (``ast``), so the test
needs none of the packages' optional dependencies.
"""

from __future__ import annotations

import ast
import functools
import pathlib
from typing import Iterator, List, Optional, Tuple

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = {
    "tzrec_ops": ROOT / "packages" / "tzrec-ops",
    "tzrec_gr": ROOT / "packages" / "tzrec-gr",
    "tzrec_acc": ROOT / "packages" / "tzrec-acc",
    "tzrec_bench": ROOT / "packages" / "tzrec-bench",
}


def _module_path(module: str) -> Optional[pathlib.Path]:
    top = module.split(".")[0]
    base = PACKAGES[top] / "src" / pathlib.Path(*module.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


@functools.cache
def _exports(module: str) -> Optional[Tuple[str, ...]]:
    """The module's static ``__all__``, or ``None`` when it declares none."""
    path = _module_path(module)
    if path is None:
        return None
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):
                return tuple(ast.literal_eval(node.value))
    return None


def _imports(path: pathlib.Path) -> Iterator[Tuple[int, str, Optional[str]]]:
    """(line, module, imported name or None) of every absolute import in ``path``."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name, None
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            for alias in node.names:
                yield node.lineno, node.module, alias.name


def private_imports(owner: str, path: pathlib.Path, production: bool) -> List[str]:
    """Every import in ``path`` (a file of package ``owner``) of a sibling's private part."""
    found = []
    for line, module, name in _imports(path):
        top = module.split(".")[0]
        if top not in PACKAGES or top == owner:
            continue
        where = f"{path.relative_to(ROOT)}:{line}: {module}" + (f".{name}" if name else "")
        parts = module.split(".")[1:]
        if any(p.startswith("_") for p in parts):
            found.append(f"{where} (underscored module)")
        elif production and "testing" in parts:
            found.append(f"{where} (a testing module imported by production code)")
        elif name is not None and _module_path(f"{module}.{name}") is None:
            exports = _exports(module)
            if name.startswith("_"):
                found.append(f"{where} (underscored name)")
            elif exports is None:
                found.append(f"{where} ({module} declares no __all__)")
            elif name not in exports:
                found.append(f"{where} (not in {module}.__all__)")
        elif name is not None and name.startswith("_"):
            found.append(f"{where} (underscored module)")
    return found


def _files() -> Iterator[Tuple[str, pathlib.Path, bool]]:
    for owner, folder in PACKAGES.items():
        for path in sorted((folder / "src").rglob("*.py")):
            yield owner, path, "testing" not in path.relative_to(folder / "src").parts
        for path in sorted((folder / "tests").rglob("*.py")):
            yield owner, path, False


@pytest.mark.parametrize("owner", sorted(PACKAGES))
def test_no_private_cross_package_imports(owner: str) -> None:
    found = [
        line
        for pkg, path, production in _files()
        if pkg == owner
        for line in private_imports(pkg, path, production)
    ]
    assert not found, "private cross-package imports:\n" + "\n".join(found)


def test_the_check_finds_each_kind_of_private_import(tmp_path: pathlib.Path) -> None:
    source = tmp_path / "sample.py"
    source.write_text(
        "import tzrec_gr._backend\n"
        "from tzrec_ops.ops.validation import check_jagged\n"
        "from tzrec_ops.jagged import _offsets\n"
        "from tzrec_ops.jagged import not_exported\n"
        "from tzrec_ops.testing.generators import random_values\n"
        "from tzrec_ops.jagged import offsets_from_lengths\n"
        "from tzrec_gr import STULayer\n"
    )
    relocated = ROOT / "packages" / "tzrec-bench" / "src" / "tzrec_bench" / "_probe.py"
    # the walker reports paths relative to the repository: read the sample from there
    found = private_imports("tzrec_bench", _as_repo_file(source, relocated), True)
    reasons = [line.rsplit("(", 1)[1] for line in found]
    assert reasons == [
        "underscored module)",
        "tzrec_ops.ops.validation declares no __all__)",
        "underscored name)",
        "not in tzrec_ops.jagged.__all__)",
        "a testing module imported by production code)",
    ]


def _as_repo_file(source: pathlib.Path, target: pathlib.Path) -> pathlib.Path:
    class _Probe(type(target)):  # type: ignore[misc]
        def read_text(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN201
            return source.read_text()

    return _Probe(target)
