"""The torchrec adapters: a clear error without torchrec; conversion when it is installed."""

from __future__ import annotations

import importlib.util
import sys

import pytest
import torch

from tzrec_gr import torchrec_adapters


def test_missing_torchrec_names_the_extra(monkeypatch):
    # hide the submodule too: another test may have imported it already
    for module in ("torchrec", "torchrec.sparse.jagged_tensor"):
        monkeypatch.setitem(sys.modules, module, None)
    with pytest.raises(
        ImportError,
        match=r"^torchrec inputs needs the optional dependency torchrec\.sparse\.jagged_tensor, "
        r"which is not installed: pip install 'tzrec-gr\[torchrec\]'$",
    ):
        torchrec_adapters.features_from_jagged_tensors({})
    with pytest.raises(ImportError, match=r"tzrec-gr\[torchrec\]"):
        torchrec_adapters.features_from_kjt(object())


@pytest.mark.skipif(
    importlib.util.find_spec("torchrec") is None, reason="torchrec is not installed"
)
def test_jagged_tensor_conversion():
    from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor

    values = torch.randn(5, 4)
    jt = JaggedTensor(values=values, lengths=torch.tensor([2, 3]))
    out = torchrec_adapters.features_from_jagged_tensors(
        {"uih": jt, "contextual": torch.ones(2, 3)}
    )
    assert out["uih.sequence"] is values and out["uih.sequence_length"].tolist() == [2, 3]
    kjt = KeyedJaggedTensor.from_lengths_sync(
        ["uih_timestamp"], torch.arange(5), torch.tensor([2, 3])
    )
    assert torchrec_adapters.features_from_kjt(kjt)["uih_timestamp.sequence"].tolist() == [
        0,
        1,
        2,
        3,
        4,
    ]
