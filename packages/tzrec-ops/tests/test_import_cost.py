"""What importing tzrec_ops costs: no plugin discovery, no torch._dynamo, no triton.

Each check runs in a fresh interpreter, since this test process has long since imported
everything. The checks look at ``sys.modules`` and the registry, not at timings (flaky);
``python -X importtime -c "import tzrec_ops"`` shows where the time goes.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
from typing import Dict, Optional

import pytest

needs_triton = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None,
    reason="triton is not installed (the tzrec-ops[triton] extra); its library cannot load",
)

# Records every importlib.metadata.entry_points() call from here on (the registry looks the
# function up at call time, so the spy sees plugin discovery).
_SPY = """
import importlib.metadata as _md
import sys

SEEN = []
_real_entry_points = _md.entry_points


def _spy(*args, **kwargs):
    SEEN.append(kwargs.get("group", args[0] if args else None))
    return _real_entry_points(*args, **kwargs)


_md.entry_points = _spy
"""


def _run(*snippets: str, env: Optional[Dict[str, str]] = None) -> str:
    """Run the snippets, one after the other, in a fresh interpreter; fail with its output
    if it fails."""
    code = "\n".join(textwrap.dedent(snippet) for snippet in snippets)
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def _env(**overrides: Optional[str]) -> Dict[str, str]:
    env = dict(os.environ)
    env.pop("TZREC_OPS_BACKEND", None)
    for name, value in overrides.items():
        if value is None:
            env.pop(name, None)
        else:
            env[name] = value
    return env


def test_import_discovers_no_plugins_and_loads_neither_dynamo_nor_triton():
    _run(
        """
        import sys
        import torch
        """,
        _SPY,
        """
        before = set(sys.modules)
        import tzrec_ops
        import tzrec_ops.registry as registry

        loaded = set(sys.modules) - before
        assert not {"torch._dynamo", "triton"} & loaded, sorted(loaded)
        assert SEEN == [], SEEN
        assert registry._REGISTRY is None
        """,
        env=_env(),
    )


def test_deferred_constant_marker_is_the_one_torch_sets():
    """``registry.assume_constant_result`` sets dynamo's marker itself while dynamo is not
    loaded; a torch release that marks constants differently must fail here."""
    _run(
        """
        import sys
        import tzrec_ops.registry as registry

        assert "torch._dynamo" not in sys.modules
        ours = dict(vars(registry._selection_key))
        import torch

        def probe():
            pass

        torch.compiler.assume_constant_result(probe)
        assert ours == vars(probe), (ours, vars(probe))
        """,
        env=_env(),
    )


def test_choice_is_baked_into_a_graph_compiled_before_any_eager_call():
    """Imported before dynamo, selection still runs eagerly while tracing: tracing into it
    would meet plugin discovery, which a fullgraph compile cannot trace."""
    _run(
        """
        import sys
        import torch
        import tzrec_ops
        from tzrec_ops import registry

        assert "torch._dynamo" not in sys.modules and registry._REGISTRY is None

        def f(x, w, b):
            return tzrec_ops.layer_norm(x, w, b)

        x, w, b = torch.randn(4, 8), torch.rand(8) + 0.5, torch.randn(8)
        compiled = torch.compile(f, fullgraph=True, backend="eager")
        torch.testing.assert_close(compiled(x, w, b), f(x, w, b))
        assert "pytorch:layer_norm" in vars(registry._Chosen)
        """,
        env=_env(),
    )


_LIBRARY = (
    """
    import torch
    """,
    _SPY,
    """
    import tzrec_ops.backends.triton.library
    import tzrec_ops.registry as registry

    assert registry._REGISTRY is None, "importing the library built the registry"
    assert "tzrec_ops" not in SEEN, SEEN
    for op in (
        "hstu_mha_triton",
        "hstu_compute_output_triton",
        "concat_2D_jagged_triton",
        "layer_norm_triton",
        "addmm_triton",
        "add_positional_embeddings_triton",
    ):
        getattr(torch.ops.tzrec_ops, op)  # raises if the op is not registered
    """,
)


@needs_triton
def test_triton_library_registers_ops_without_building_the_registry_interpreter():
    _run(*_LIBRARY, env=_env(TRITON_INTERPRET="1"))


@needs_triton
def test_triton_library_registers_ops_without_building_the_registry():
    _run(*_LIBRARY, env=_env(TRITON_INTERPRET=None))
