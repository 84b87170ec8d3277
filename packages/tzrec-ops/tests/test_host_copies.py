"""Host copies of index tensors: a jagged batch is read back and checked at most once.

Device reads are counted by spying on ``host_copies._snapshot`` (one copy of one tensor)
and on ``Tensor.cpu`` (the batched transfer). ``meta`` tensors stand in for device tensors
whose values cannot be read at all: a check that passes on one proves that nothing was read.
"""

from __future__ import annotations

from typing import Any, List, Optional

import pytest
import torch

from tzrec_ops.jagged import offsets_from_lengths
from tzrec_ops.ops import host_copies as HC
from tzrec_ops.ops import jagged_2d
from tzrec_ops.ops.hstu_attention import hstu_mha
from tzrec_ops.ops.truncation import apply_stu_truncation_plan, compute_stu_truncation_plan
from tzrec_ops.ops.validation import check_jagged, check_once, set_value_checks


@pytest.fixture(autouse=True)
def _value_checks_on():
    set_value_checks(True)
    yield
    set_value_checks(None)


@pytest.fixture
def snapshots(monkeypatch) -> List[torch.Tensor]:
    """The tensors copied to the host one by one, in order."""
    copied: List[torch.Tensor] = []
    real = HC._snapshot

    def spy(values: torch.Tensor) -> torch.Tensor:
        copied.append(values)
        return real(values)

    monkeypatch.setattr(HC, "_snapshot", spy)
    return copied


def _attention(offsets: torch.Tensor, num_targets: Optional[torch.Tensor]) -> torch.Tensor:
    """hstu_mha on a batch of lengths [2, 3]."""
    q = torch.zeros(5, 1, 2)
    return hstu_mha(4, 0.5, q, q, q, offsets, num_targets=num_targets, backend="pytorch")


def _copied(snapshots: List[torch.Tensor], t: torch.Tensor) -> int:
    return sum(s is t for s in snapshots)


def test_one_copy_per_batch_and_a_new_copy_per_new_tensor(snapshots):
    offsets, targets = offsets_from_lengths([2, 3]), torch.tensor([1, 0])
    for _ in range(3):
        _attention(offsets, targets)
    assert _copied(snapshots, offsets) == 1 and _copied(snapshots, targets) == 1
    same_values = offsets_from_lengths([2, 3])
    _attention(same_values, targets)
    assert _copied(snapshots, same_values) == 1 and len(snapshots) == 3


def test_a_check_runs_once_per_copy_and_again_after_an_in_place_change():
    runs: List[List[int]] = []
    offsets = offsets_from_lengths([2, 3])
    for _ in range(3):
        check_once("key", (offsets, None), lambda o, _: runs.append(o.tolist()))
    check_once("other key", (offsets, None), lambda o, _: runs.append(o.tolist()))
    assert runs == [[0, 2, 5], [0, 2, 5]]
    offsets[1] = 1  # bumps the version counter: the old copy and its checks are dropped
    check_once("key", (offsets, None), lambda o, _: runs.append(o.tolist()))
    assert runs[-1] == [0, 1, 5]


def test_offsets_kept_across_batches_remember_one_targets_copy():
    offsets = offsets_from_lengths([2, 3])
    for _ in range(4):
        _attention(offsets, torch.tensor([1, 0]))
    assert len(HC.known_host_copy(offsets).passed) == 1


def test_an_in_place_change_is_rechecked_and_a_now_bad_value_raises(snapshots):
    offsets, targets = offsets_from_lengths([2, 3]), torch.tensor([1, 0])
    _attention(offsets, targets)
    targets[1] = 4  # longer than sequence 1
    with pytest.raises(ValueError, match=r"got num_targets\[1\] = 4 for a length of 3"):
        _attention(offsets, targets)
    assert _copied(snapshots, targets) == 2 and _copied(snapshots, offsets) == 1


def test_remembered_values_are_not_read(snapshots):
    offsets = HC.remember_host_copy(offsets_from_lengths([2, 3]), torch.tensor([0, 2, 5]))
    snapshots.clear()
    _attention(offsets, None)
    assert snapshots == []


def test_to_device_keeps_the_values_on_the_host():
    offsets = HC.to_device(torch.tensor([0, 2, 5]), "meta")
    assert offsets.device.type == "meta"
    check_jagged("seq_offsets", offsets, total=5, max_seq_len=3)  # a read would raise
    with pytest.raises(ValueError, match=r"seq_offsets\[-1\] must equal .* \(4\), got 5"):
        check_jagged("seq_offsets", offsets, total=4)
    with pytest.raises(ValueError, match=r"must be <= max_seq_len \(2\), got 3 for sequence 1"):
        check_jagged("seq_offsets", offsets, total=5, max_seq_len=2)


def test_remember_host_copy_needs_the_same_shape():
    with pytest.raises(ValueError, match=r"values must have t's shape \(3,\), got \(2,\)"):
        HC.remember_host_copy(torch.zeros(3), torch.zeros(2))


def _lengths(offsets: torch.Tensor) -> torch.Tensor:
    return offsets[1:] - offsets[:-1]


def test_mirror_remembers_results_only_when_every_input_is_known():
    known = HC.to_device(torch.tensor([0, 2, 5]), "meta")
    lengths = HC.mirror(_lengths, known)
    assert lengths.device.type == "meta"
    assert HC.known_host_copy(lengths).values.tolist() == [2, 3]

    def shifted(offsets: torch.Tensor, by: int, extra: Any) -> Any:
        return offsets + by, None, _lengths(offsets)

    plus, none, diffs = HC.mirror(shifted, known, 1, extra=None)
    assert none is None and HC.known_host_copy(plus).values.tolist() == [1, 3, 6]
    assert HC.known_host_copy(diffs).values.tolist() == [2, 3]

    runs: List[torch.Tensor] = []

    def add(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        runs.append(a)
        return a + b

    known_cpu = HC.remember_host_copy(torch.tensor([2, 3]), torch.tensor([2, 3]))
    summed = HC.mirror(add, known_cpu, torch.tensor([1, 1]))  # the second is unknown
    assert HC.known_host_copy(summed) is None and len(runs) == 1


def test_host_copies_read_several_device_tensors_in_one_transfer(monkeypatch, snapshots):
    transfers: List[torch.Size] = []

    def fake_cpu(self: torch.Tensor) -> torch.Tensor:
        # a meta tensor has no data: the "transfer" returns made-up values of its shape
        transfers.append(self.shape)
        return torch.arange(self.numel(), dtype=self.dtype).reshape(self.shape)

    monkeypatch.setattr(torch.Tensor, "cpu", fake_cpu)
    a, b = torch.empty(3, dtype=torch.int32, device="meta"), torch.empty(2, device="meta")
    known = HC.to_device(torch.tensor([7, 8]), "meta")
    snapshots.clear()
    copies = HC.host_copies([a, None, known, b])
    assert transfers == [torch.Size([5])] and snapshots == []
    assert copies[1] is None and copies[2] is HC.known_host_copy(known)
    assert copies[0].values.tolist() == [0, 1, 2] and copies[3].values.tolist() == [3, 4]
    assert copies[0].values.dtype == copies[3].values.dtype == torch.int64
    assert HC.host_copies([a, b]) == [copies[0], copies[3]] and len(transfers) == 1


@pytest.mark.parametrize("how", ["set_value_checks", "env"])
def test_value_checks_off_copy_nothing(how, monkeypatch, snapshots):
    if how == "env":
        set_value_checks(None)
        monkeypatch.setenv("TZREC_OPS_VALUE_CHECKS", "0")
    else:
        set_value_checks(False)
    offsets = offsets_from_lengths([2, 3])
    hstu_mha(4, 0.5, *[torch.zeros(5, 1, 2)] * 3, offsets, backend="pytorch")
    check_jagged("seq_offsets", torch.tensor([1, 0]), total=7)  # bad, but not checked
    assert snapshots == []


def test_inference_tensors_are_copied_once(snapshots):
    with torch.inference_mode():
        offsets, targets = offsets_from_lengths([2, 3]), torch.tensor([1, 0])
        assert offsets.is_inference()
        for _ in range(2):
            _attention(offsets, targets)
        with pytest.raises(ValueError, match=r"num_targets\[b\] must be <= the length"):
            _attention(offsets, torch.tensor([3, 0]))
    assert _copied(snapshots, offsets) == 1 and _copied(snapshots, targets) == 1


def test_split_takes_the_left_total_from_the_host_copy(monkeypatch):
    seen = {}

    def fake_backend(op: str, backend: Any, **call: Any) -> Any:
        return lambda **args: seen.update(
            total_len_left=args["total_len_left"], total_len_right=args["total_len_right"]
        )

    monkeypatch.setattr(jagged_2d, "select_backend", fake_backend)
    left = HC.to_device(torch.tensor([0, 2, 5]), "meta")
    right = HC.to_device(torch.tensor([0, 1, 3]), "meta")
    values = torch.empty(8, 4, device="meta")
    jagged_2d.split_2D_jagged(5, values, offsets_left=left, offsets_right=right)
    assert seen == {"total_len_left": 5, "total_len_right": 3}


def test_truncation_plan_sizes_and_index_tensors_come_from_host_copies():
    offsets = HC.to_device(offsets_from_lengths([6, 3]), "meta")
    targets = HC.to_device(torch.tensor([1, 0]), "meta")
    plan = compute_stu_truncation_plan(
        offsets, targets, 6, truncate_tail_len=2, contextual_seq_len=1
    )  # on meta: any read would raise
    assert (plan.new_max_seq_len, plan.total_dropped, plan.total_kept) == (4, 2, 5)
    assert HC.known_host_copy(plan.new_x_offsets).values.tolist() == [0, 4, 7]
    for t in (plan.new_lengths, plan.offsets_head, plan.offsets_tail, plan.offsets_prefix):
        assert t.device.type == "meta" and HC.known_host_copy(t) is not None
    assert HC.known_host_copy(plan.offsets_rest).values.tolist() == [0, 5, 7]


def test_applying_a_plan_reads_nothing(snapshots):
    offsets, targets = offsets_from_lengths([6, 3]), torch.tensor([1, 0])
    plan = compute_stu_truncation_plan(
        offsets, targets, 6, truncate_tail_len=2, contextual_seq_len=1
    )
    snapshots.clear()
    kept = apply_stu_truncation_plan(torch.arange(9.0), plan, backend="pytorch")
    assert kept.tolist() == [0, 3, 4, 5, 6, 7, 8] and snapshots == []
