"""Fake installed distributions with ``tzrec_ops`` entry points, for registry tests.

``importlib.metadata.entry_points()`` walks the module-level ``distributions()``; patching it
adds distributions whose entry points load real modules written to a temporary folder, so
discovery runs exactly as for a pip-installed plugin.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import pathlib
import sys
import textwrap
from typing import Dict, List, Optional, Sequence


class FakeDistribution(importlib.metadata.Distribution):
    """A distribution that exists only in memory: METADATA and entry_points.txt."""

    def __init__(self, name: str, version: str, entry_points: Dict[str, str]) -> None:
        lines = "".join(f"{ep} = {target}\n" for ep, target in entry_points.items())
        self._files = {
            "METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
            "entry_points.txt": f"[tzrec_ops]\n{lines}",
        }

    def read_text(self, filename: str) -> Optional[str]:
        return self._files.get(filename)

    def locate_file(self, path):  # required by the ABC; nothing is on disk
        return pathlib.Path(path)


class FakePlugins:
    """Write plugin modules and announce them through fake distributions."""

    def __init__(self, monkeypatch, folder: pathlib.Path) -> None:
        self._folder = folder
        self._dists: List[FakeDistribution] = []
        self._modules: List[str] = []
        monkeypatch.syspath_prepend(str(folder))
        real = importlib.metadata.distributions
        monkeypatch.setattr(
            importlib.metadata, "distributions", lambda **kw: [*real(**kw), *self._dists]
        )

    def add(self, dist: str, version: str, modules: Dict[str, str]) -> List[str]:
        """Install ``dist`` with one entry point per ``{entry point name: module source}``.

        Returns the module names (unique per test run), in order.
        """
        entry_points = {}
        for ep_name, source in modules.items():
            module = f"tzrec_fake_{dist.replace('-', '_')}_{ep_name}_{len(self._modules)}"
            (self._folder / f"{module}.py").write_text(textwrap.dedent(source))
            self._modules.append(module)
            entry_points[ep_name] = module
        importlib.invalidate_caches()
        self._dists.append(FakeDistribution(dist, version, entry_points))
        return list(entry_points.values())

    def cleanup(self) -> None:
        for module in self._modules:
            sys.modules.pop(module, None)


def toy_backends(*specs: Dict[str, object]) -> str:
    """Source of a plugin module registering toy backends.

    Each spec: ``name``, ``priority``, optional ``ops`` (default ``["toy_op"]``),
    ``unavailable`` (a reason) and ``reject_dtype`` (a dtype name it refuses). Every op of
    backend ``name`` is a function returning ``name``, so a test sees which one ran.
    """
    records = []
    functions = []
    for spec in specs:
        name = spec["name"]
        ops: Sequence[str] = spec.get("ops", ["toy_op"])  # type: ignore[assignment]
        functions.append(f"def run_{name}(*args, **kwargs):\n    return {name!r}\n")
        reject = spec.get("reject_dtype")
        supports = (
            f"lambda op, call: 'dtype ' + str(call['dtype']) + ' is not supported' "
            f"if call.get('dtype') == torch.{reject} else None"
            if reject
            else "lambda op, call: None"
        )
        records.append(
            f"Backend(name={name!r}, priority={spec['priority']}, "
            f"ops={{op: __name__ + ':run_{name}' for op in {list(ops)!r}}}, "
            f"availability=lambda: {spec.get('unavailable')!r}, supports={supports})"
        )
    return (
        "import torch\nimport tzrec_ops\nfrom tzrec_ops.registry import Backend\n\n"
        + "\n".join(functions)
        + "\n@tzrec_ops.hookimpl\ndef tzrec_ops_register_backends():\n"
        + "    return [\n        "
        + ",\n        ".join(records)
        + ",\n    ]\n"
    )
