"""tzrec_ops.ops.utils: contiguity helper, powers of two and the autotune sequence-length key."""

from __future__ import annotations

import pytest
import torch

from tzrec_ops.ops import utils


@pytest.fixture(autouse=True)
def _restore_autotune_state():
    static, runtime = list(utils._static_max_seq_lens), utils._use_runtime_max_seq_len
    yield
    utils.set_static_max_seq_lens(static)
    utils.set_use_runtime_max_seq_len(runtime)


@pytest.mark.parametrize(
    "n, expected", [(30, 16), (31, 16), (32, 32), (33, 32), (63, 32), (64, 64), (1, 1)]
)
def test_prev_power_of_2(n, expected):  # the values of the reference spec §1.1, plus 1
    assert utils.prev_power_of_2(n) == expected


@pytest.mark.parametrize("n, expected", [(1, 1), (2, 2), (3, 4), (31, 32), (32, 32), (33, 64)])
def test_next_power_of_2(n, expected):
    assert utils.next_power_of_2(n) == expected


@pytest.mark.parametrize("fn", [utils.prev_power_of_2, utils.next_power_of_2])
def test_power_of_2_rejects_non_positive(fn):
    with pytest.raises(ValueError, match=r"n must be >= 1, got 0"):
        fn(0)


def test_cdiv_is_ceil_division():
    assert [utils.cdiv(n, 4) for n in (0, 1, 3, 4, 5, 8, 9)] == [0, 1, 1, 1, 2, 2, 3]
    assert utils.cdiv(124463, 64) == -(-124463 // 64)


def test_switch_to_contiguous_if_needed():
    base = torch.randn(6, 8)
    rows = base[::2]  # row stride 16, last dimension contiguous: kept as is
    assert utils.switch_to_contiguous_if_needed(rows) is rows
    cols = base.t()  # last dimension strided: copied
    out = utils.switch_to_contiguous_if_needed(cols)
    assert out.is_contiguous() and torch.equal(out, cols)
    compiled = torch.compile(utils.switch_to_contiguous_if_needed, fullgraph=True)
    assert torch.equal(compiled(cols), cols)


def test_autotune_key_runtime_by_default():
    assert utils.autotune_max_seq_len(1000) == 512
    assert utils.autotune_max_seq_len(0) == 1


def test_autotune_key_static_list():
    utils.set_use_runtime_max_seq_len(False)
    utils.set_static_max_seq_lens([4096, 256, 1024])
    assert utils._static_max_seq_lens == [256, 1024, 4096]  # stored sorted
    assert utils.autotune_max_seq_len(100) == 256
    assert utils.autotune_max_seq_len(256) == 256
    assert utils.autotune_max_seq_len(300) == 1024
    assert utils.autotune_max_seq_len(9000) == 4096  # none is large enough: the largest
    utils.set_use_runtime_max_seq_len(True)  # runtime keys win over the list
    assert utils.autotune_max_seq_len(300) == 256
    utils.set_use_runtime_max_seq_len(False)
    utils.set_static_max_seq_lens([])  # empty list: back to runtime keys
    assert utils.autotune_max_seq_len(300) == 256


def test_static_max_seq_lens_rejects_non_positive():
    with pytest.raises(
        ValueError, match=r"static max sequence lengths must be >= 1, got \[128, 0\]"
    ):
        utils.set_static_max_seq_lens([128, 0])
