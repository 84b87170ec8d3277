"""The captured training step's logic on the CPU: buckets, padding users masked out of the
loss (float64: the padded batch's loss and gradients are the batch's own), the eager padded
step against the plain step, and where ``--cuda-graphs`` applies. The capture itself is
tested on a GPU (``test_on_cuda_*``, ``-m gpu``; two processes on two GPUs in
``test_on_two_gpus_*``). The gradient reduction of several processes: test_grad_sync."""

from __future__ import annotations

import json
import types

import pytest
import torch
from _torchrun import FIELDS, torchrun_train

from tzrec_bench.baselines import SASRec
from tzrec_bench.train.config import ConfigError, TrainConfig
from tzrec_bench.train.distributed import close, init_distributed
from tzrec_bench.train.graphed_step import BucketPlan, CapturedStep, wanted
from tzrec_bench.train.loop import Trainer, train
from tzrec_bench.train.retrieval import pad_batch
from tzrec_bench.train.strategies import Replicated
from tzrec_gr.models import HSTURetrieval

MAX_LEN, ITEMS, DIM = 8, 40, 16
TINY = dict(
    data="synthetic", synthetic_users=48, synthetic_items=120, max_seq_len=16,
    embedding_dim=16, num_layers=1, num_heads=2, num_negatives=16, batch_size=16, lr=1e-2,
    eval_batch_size=64, log_every=1, progress=False, plot=False, dropout=0.0, amp="off",
    backend="pytorch",
)


def _batch(lengths):
    g = torch.Generator().manual_seed(0)
    lengths = torch.tensor(lengths, dtype=torch.int64)
    total = int(lengths.sum())
    return (torch.randint(0, ITEMS, (total,), generator=g), lengths,
            torch.arange(total, dtype=torch.int64))


def test_buckets_cover_every_batch_with_few_padding_users():
    plan = BucketPlan.of(users=128, max_seq_len=50, buckets=16)
    assert (plan.granule, plan.padding_users, plan.max_tokens) == (400, 8, 6400)
    assert [plan.bucket(t) for t in (0, 1, 400, 401, 6400)] == [400, 400, 400, 800, 6400]
    for tokens in range(0, 6401, 37):  # every pad fits the padding users
        assert 0 <= plan.bucket(tokens) - tokens <= plan.padding_users * 50


def test_pad_batch_fills_padding_users_in_order_and_masks_their_tokens():
    item_ids, lengths, timestamps = _batch([3, 5])
    ids, lens, times, mask = pad_batch(item_ids, lengths, timestamps, 8 + 19, 3, MAX_LEN)
    assert lens.tolist() == [3, 5, 8, 8, 3]
    assert ids.shape == times.shape == mask.shape == (27,)
    assert mask[:8].all() and not mask[8:].any() and (ids[8:] == 0).all()
    assert pad_batch(item_ids, lengths, timestamps, 8, 3, MAX_LEN)[1].tolist() == [3, 5, 0, 0, 0]
    with pytest.raises(ValueError, match="tokens=7"):
        pad_batch(item_ids, lengths, timestamps, 7, 3, MAX_LEN)
    with pytest.raises(ValueError, match="tokens=33"):
        pad_batch(item_ids, lengths, timestamps, 33, 3, MAX_LEN)


@pytest.mark.parametrize("model_class", [HSTURetrieval, SASRec])
def test_a_padded_batch_has_the_loss_and_gradients_of_the_batch_float64(model_class):
    torch.manual_seed(0)
    kwargs = dict(num_heads=2, dropout_ratio=0.0, num_negatives=ITEMS, max_seq_len=MAX_LEN)
    if model_class is HSTURetrieval:
        kwargs["backend"] = "pytorch"
        model = HSTURetrieval(ITEMS, DIM, **kwargs).double()
    else:
        model = SASRec(ITEMS, DIM, **kwargs).double()
    negatives = torch.arange(ITEMS)
    item_ids, lengths, timestamps = _batch([3, 1, 8, 5])

    def loss_and_grads(*inputs, **extra):
        model.zero_grad()
        loss = model.loss(*inputs, MAX_LEN, negatives=negatives, **extra)
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters()]

    loss, grads = loss_and_grads(item_ids, lengths, timestamps)
    padded = pad_batch(item_ids, lengths, timestamps, 17 + 13, 2, MAX_LEN)
    padded_loss, padded_grads = loss_and_grads(*padded[:3], loss_mask=padded[3])
    torch.testing.assert_close(padded_loss, loss, rtol=1e-12, atol=1e-12)
    for got, want in zip(padded_grads, grads):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    # without the mask the padding users would count
    unmasked = model.loss(*padded[:3], MAX_LEN, negatives=negatives).detach()
    assert not torch.allclose(unmasked, loss)


def test_the_eager_padded_step_trains_like_the_plain_step(tmp_path):
    """CapturedStep without capture (the CPU's only mode): padded batches, the loss mask,
    clipping and the warm-up schedule: the plain run's losses."""
    config = TrainConfig(**TINY, out_dir=str(tmp_path / "padded"), max_steps=4,
                         warmup_steps=3, device="cpu", cuda_graphs="off")
    plain = train(config.replaced(out_dir=str(tmp_path / "plain")))
    ctx = init_distributed("cpu")
    try:
        torch.manual_seed(config.seed)
        trainer = Trainer(config, ctx, Replicated)
        trainer.captured = CapturedStep(trainer, capture=False)
        losses = []
        for step in range(4):
            trainer.step = step
            losses.append(float(trainer.train_step(trainer.global_rows(step))))
    finally:
        close(ctx)
    want = torch.tensor([r["loss"] for r in plain.history["train"]])
    torch.testing.assert_close(torch.tensor(losses), want, rtol=1e-5, atol=1e-6)


def test_cuda_graphs_auto_is_off_on_the_cpu_and_on_is_refused_naming_the_option():
    ctx = init_distributed("cpu")
    try:
        assert not wanted(TrainConfig(**TINY, device="cpu"), ctx)
        with pytest.raises(ConfigError, match="cuda.graphs.*CUDA device"):
            wanted(TrainConfig(**TINY, device="cpu", cuda_graphs="on"), ctx)
        with pytest.raises(ConfigError, match="does not support a captured step"):
            wanted(TrainConfig(**{**TINY, "model": "hstu-ranking"}, device="cpu",
                               cuda_graphs="on"), ctx)
        with pytest.raises(ConfigError, match="torchrec"):
            wanted(TrainConfig(**TINY, device="cpu", cuda_graphs="on", sharding="torchrec"),
                   ctx)
    finally:
        close(ctx)
    with pytest.raises(ConfigError, match="cuda.graphs"):
        TrainConfig(**TINY, cuda_graphs="sometimes").check()


@pytest.mark.gpu
@pytest.mark.parametrize("model", ["hstu-retrieval", "sasrec"])
@pytest.mark.parametrize("negatives", [16, 1000], ids=["sampled", "full-softmax"])
def test_on_cuda_the_captured_step_gives_the_eager_losses(tmp_path, model, negatives):
    """Eight steps (warm-up schedule, clipping, several buckets): captured in graphs against
    the plain eager step, fp32 (amp off) so only the padded shapes' rounding differs."""
    options = dict(TINY, model=model, max_steps=8, warmup_steps=4, amp="off", batch_size=24,
                   device="cuda", backend=None, num_negatives=negatives)
    eager = train(TrainConfig(**options, out_dir=str(tmp_path / "eager"), cuda_graphs="off"))
    graphs = train(TrainConfig(**options, out_dir=str(tmp_path / "graphs"), cuda_graphs="on"))
    want = torch.tensor([r["loss"] for r in eager.history["train"]])
    got = torch.tensor([r["loss"] for r in graphs.history["train"]])
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.gpu
def test_on_cuda_captured_dropout_draws_the_eager_padded_masks(tmp_path):
    """With dropout on, replays draw from the CUDA generator as the eager padded step does."""
    config = TrainConfig(**{**TINY, "dropout": 0.3, "backend": None}, device="cuda",
                         out_dir=str(tmp_path), max_steps=6, cuda_graphs="off")
    runs = []
    for capture in (False, True):
        ctx = init_distributed("cuda")
        try:
            torch.manual_seed(config.seed)
            trainer = Trainer(config.replaced(out_dir=str(tmp_path / str(capture))), ctx,
                              Replicated)
            trainer.captured = CapturedStep(trainer, capture=capture)
            losses = []
            for step in range(6):
                trainer.step = step
                # once captured, a step reads nothing back from the device
                torch.cuda.set_sync_debug_mode("error" if capture and step >= 2 else 0)
                try:
                    loss = trainer.train_step(trainer.global_rows(step))
                finally:
                    torch.cuda.set_sync_debug_mode(0)
                losses.append(float(loss))
            assert bool(trainer.captured.graphs) == capture
            runs.append(torch.tensor(losses))
        finally:
            close(ctx)
    assert torch.isfinite(runs[1]).all()
    torch.testing.assert_close(runs[1], runs[0], rtol=2e-2, atol=1e-3)


def test_auto_captures_on_a_cuda_device_but_leaves_a_compiled_step_alone():
    cuda = types.SimpleNamespace(device=torch.device("cuda"), distributed=False)
    assert wanted(TrainConfig(**TINY), cuda)
    assert not wanted(TrainConfig(**TINY, compile=True), cuda)
    assert wanted(TrainConfig(**TINY, compile=True, cuda_graphs="on"), cuda)
    # under torchrun too: the captured step reduces its gradients itself (test_grad_sync)
    torchrun = types.SimpleNamespace(device=torch.device("cuda"), distributed=True)
    assert wanted(TrainConfig(**TINY), torchrun)
    assert not wanted(TrainConfig(**TINY, cuda_graphs="off"), torchrun)


def _torchrun_losses(out_dir, model: str, cuda_graphs: str) -> tuple:
    """A two-process run of TINY on two GPUs: its losses (the global-batch means) and log."""
    run = torchrun_train(
        TINY, "--model", model, "--data", "synthetic", "--device", "cuda", "--amp", "off",
        "--dropout", "0", "--max-steps", "8", "--warmup-steps", "4", "--batch-size", "24",
        "--cuda-graphs", cuda_graphs, "--out-dir", str(out_dir), "--no-progress", "--no-plot",
        fields=[f for f in FIELDS if f != "batch_size"], timeout=300,
    )
    history = json.loads((out_dir / "history.json").read_text())
    return torch.tensor([r["loss"] for r in history["train"]]), run.stdout


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
@pytest.mark.parametrize("model", ["hstu-retrieval", "sasrec"])
def test_on_two_gpus_the_captured_step_gives_the_losses_of_eager_ddp(tmp_path, model):
    """torchrun, two processes on two GPUs, NCCL: the captured step (its own all-reduce in
    the graph) against eager DDP, eight steps, fp32 (amp off), dropout off: the tolerances of
    the one-GPU test, where only the padded shapes' rounding differs."""
    want, eager_log = _torchrun_losses(tmp_path / "eager", model, "off")
    got, graphs_log = _torchrun_losses(tmp_path / "graphs", model, "on")
    assert "2 processes" in graphs_log and "CUDA graph captured" not in eager_log
    assert "CUDA graph captured on rank 0 of 2" in graphs_log, graphs_log[-2000:]
    print(f"{model}: eager DDP losses {want.tolist()}\ncaptured losses {got.tolist()}")
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
