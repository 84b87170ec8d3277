"""Training batches reach the device without the host waiting for it (``staged``): on CUDA
through pinned memory, since a large copy from pageable memory first waits for every queued
kernel (a few kilobytes are staged by the driver either way). The GPU tests keep the stream
busy (``torch.cuda._sleep``) and check that a large staged copy, building a batch, and a
whole captured step return before the stream is done: the step reads nothing back."""

from __future__ import annotations

import pytest
import torch

from tzrec_bench.train.config import TrainConfig
from tzrec_bench.train.distributed import DistContext, close, init_distributed
from tzrec_bench.train.factory import make_task
from tzrec_bench.train.graphed_step import CapturedStep
from tzrec_bench.train.loop import Trainer, load_data
from tzrec_bench.train.strategies import Replicated
from tzrec_bench.train.task import staged
from tzrec_gr.features import UIH_LENGTHS
from tzrec_ops.jagged import known_host_copy

#: about a second of a busy stream on an H100 or H200 (its clock near 2 GHz)
BUSY_CYCLES = 2_000_000_000
TINY = dict(
    data="synthetic", synthetic_users=48, synthetic_items=120, max_seq_len=16,
    embedding_dim=16, num_layers=1, num_heads=2, num_negatives=16, batch_size=16,
    num_candidates=3, progress=False, plot=False, dropout=0.0,
)


def _task(tmp_path, device: str, **overrides):
    config = TrainConfig(**{**TINY, **overrides}, device=device, out_dir=str(tmp_path))
    ctx = DistContext(0, 0, 1, torch.device(device))
    return make_task(config, load_data(config, ctx), ctx)


def _flat(batch):
    """(name, tensor) of every tensor of a batch, nested feature dicts included."""
    for name, value in batch.items():
        if isinstance(value, dict):
            yield from _flat(value)
        else:
            yield name, value


def test_staged_on_the_cpu_is_the_tensor_and_an_index_keeps_its_host_copy():
    lengths = torch.tensor([3, 0, 5])
    assert staged(lengths, torch.device("cpu")) is lengths
    assert staged(lengths, torch.device("cpu"), index=True) is lengths


@pytest.mark.gpu
def test_on_cuda_a_large_staged_copy_is_queued_without_waiting():
    """8 MB, a copy that from pageable memory would first wait for the busy stream."""
    cuda = torch.device("cuda")
    values = torch.arange(1 << 20)
    staged(values, cuda)  # the pinned block is allocated once, then cached
    torch.cuda.synchronize()
    torch.cuda._sleep(BUSY_CYCLES)
    moved = staged(values, cuda)
    assert not torch.cuda.current_stream().query(), "the copy waited for the GPU"
    assert torch.equal(moved.cpu(), values)


@pytest.mark.gpu
@pytest.mark.parametrize("model", ["hstu-retrieval", "hstu-ranking"])
def test_on_cuda_a_batch_is_built_while_the_stream_is_busy(tmp_path, model):
    cpu = _task(tmp_path / "cpu", "cpu", model=model)
    cuda = _task(tmp_path / "cuda", "cuda", model=model)
    rows = cuda.train_rows[:16]
    cuda.batch(rows, 0)  # the first pinned blocks are allocated (a synchronizing call)
    torch.cuda.synchronize()
    torch.cuda._sleep(BUSY_CYCLES)
    batch = cuda.batch(rows, 1)
    assert not torch.cuda.current_stream().query(), "building the batch waited for the GPU"
    want = dict(_flat(cpu.batch(rows, 1)))
    for name, value in _flat(batch):
        assert value.device.type == "cuda"
        torch.testing.assert_close(value.cpu(), want[name], rtol=0, atol=0, msg=name)
    lengths = batch["lengths"] if model == "hstu-retrieval" else batch["features"][UIH_LENGTHS]
    assert known_host_copy(lengths) is not None  # the model checks it without a device read


@pytest.mark.gpu
def test_on_cuda_a_captured_step_returns_before_the_one_before_has_run(tmp_path):
    config = TrainConfig(**TINY, device="cuda", out_dir=str(tmp_path), max_steps=8)
    ctx = init_distributed("cuda")
    try:
        trainer = Trainer(config, ctx, Replicated)
        trainer.captured = CapturedStep(trainer, capture=True)
        rows = trainer.global_rows(0)
        for step in range(3):  # an eager step (the optimizer's state), the capture, a replay
            trainer.step = step
            trainer.train_step(rows)
        assert trainer.captured.graphs
        torch.cuda.synchronize()
        torch.cuda._sleep(BUSY_CYCLES)
        trainer.step = 3
        loss = trainer.train_step(rows)
        assert not torch.cuda.current_stream().query(), "the step waited for the GPU"
        assert torch.isfinite(loss).item()
    finally:
        close(ctx)
