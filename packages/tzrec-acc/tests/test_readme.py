"""The README's Python examples run as written, in order, in one namespace (later blocks use
the model and program of the first)."""

from __future__ import annotations

import importlib.util
import pathlib
import re

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)


def test_readme_python_examples_run(capsys):
    assert len(BLOCKS) >= 5
    exec(compile("\n".join(BLOCKS), str(README), "exec"), {"__name__": "readme"})
    out = capsys.readouterr().out
    assert out.count("float32  max abs err") == 2 and "MISMATCH" not in out
    assert "['model.item_embeddings']" in out
    assert "{'aten.silu.default': " in out
    assert "QuantizedEmbedding(1000, 16, dtype=int8)" in out and "torch.float32" in out
    missing = "pip install 'tzrec-acc[tensorrt]'"
    assert (missing in out) == (importlib.util.find_spec("torch_tensorrt") is None)
    assert "quant_emb='int8'" in out and "tf32_matmul=True" in out
