"""The gradient reduction of the captured step under torchrun (:class:`GradSync`), eager on
two gloo processes: the same gradients and weights as DDP (float64), a parameter unused on
one rank, and the trainer's padded step without DDP's hooks against the plain DDP step."""

from __future__ import annotations

import os
import socket
import traceback
from typing import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from tzrec_bench.train.distributed import close, init_distributed
from tzrec_bench.train.grad_sync import GradSync

WORLD = 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, port: int, body: Callable[[int], None], errors) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD))
    torch.set_num_threads(1)
    try:
        body(rank)
    except BaseException:  # reported by the parent, which asserts on it
        errors.put(f"rank {rank}: {traceback.format_exc()}")
        raise


def _spawn(body: Callable[[int], None]) -> None:
    """Runs ``body(rank)`` on two processes (torchrun's variables set; ``body`` joins the
    group itself); fails with the first rank's traceback."""
    context = mp.get_context("spawn")
    errors = context.SimpleQueue()
    port = _free_port()
    procs = [context.Process(target=_worker, args=(rank, port, body, errors))
             for rank in range(WORLD)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(timeout=180)
    for proc in procs:
        if proc.is_alive():  # hung: fail, and leave no process behind
            proc.kill()
    assert errors.empty(), errors.get()
    assert all(proc.exitcode == 0 for proc in procs), [proc.exitcode for proc in procs]


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(12, 6), nn.Linear(6, 5), nn.Tanh(),
                         nn.Linear(5, 1)).double()


def _step(module: nn.Module, params, optimizer, rank: int, step: int,
          sync: Callable[[], None] = lambda: None) -> None:
    g = torch.Generator().manual_seed(100 * step + rank)
    ids = torch.randint(0, 12, (4 + rank,), generator=g)  # ranks hold different shares
    # weighted by this rank's share of the global batch (4 + 5 rows), DDP's average
    # (sum / 2) is the gradient of the global-batch mean, as train_step weights its loss
    loss = module(ids).square().mean() * (4 + rank) * WORLD / 9
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    sync()
    torch.nn.utils.clip_grad_norm_(params, 0.5)
    optimizer.step()


def _same_as_ddp(rank: int) -> None:
    ddp_model, own_model = _model(), _model()
    ddp = DistributedDataParallel(ddp_model)
    ddp_opt = torch.optim.AdamW(ddp_model.parameters(), lr=0.05)
    own_opt = torch.optim.AdamW(own_model.parameters(), lr=0.05)
    sync = GradSync(own_model.parameters(), divisor=WORLD)
    assert sync.numel == sum(p.numel() for p in own_model.parameters())
    for step in range(3):
        _step(ddp, list(ddp_model.parameters()), ddp_opt, rank, step)
        grads = [p.grad.clone() for p in ddp_model.parameters()]
        _step(own_model, list(own_model.parameters()), own_opt, rank, step, sync)
        for got, want in zip([p.grad for p in own_model.parameters()], grads):
            torch.testing.assert_close(got, want, rtol=1e-14, atol=1e-15)
    for got, want in zip(own_model.parameters(), ddp_model.parameters()):
        torch.testing.assert_close(got, want, rtol=1e-13, atol=1e-14)


def _unused_on_one_rank(rank: int) -> None:
    used = nn.Parameter(torch.ones(3, dtype=torch.float64))
    extra = nn.Parameter(torch.ones(2, dtype=torch.float64))
    loss = used.sum() * (rank + 1)
    if rank == 0:
        loss = loss + (extra * torch.tensor([3.0, 5.0], dtype=torch.float64)).sum()
    loss.backward()
    if rank == 1:
        assert extra.grad is None
    GradSync([used, extra], divisor=WORLD)()
    torch.testing.assert_close(used.grad, torch.full((3,), 1.5, dtype=torch.float64))
    torch.testing.assert_close(extra.grad, torch.tensor([1.5, 2.5], dtype=torch.float64))


def _both(rank: int) -> None:
    # close(): a barrier and the DDP reducer's cycles freed before the group is left; a bare
    # destroy_process_group let gloo abort a rank at exit now and then
    ctx = init_distributed("cpu")
    try:
        _same_as_ddp(rank)
        _unused_on_one_rank(rank)
    finally:
        close(ctx)


def test_grad_sync_gives_ddps_gradients_and_weights_and_zeros_for_unused_float64():
    """Three AdamW steps with clipping against DDP (float64: the same sums, so equal to
    the last bits), and a parameter that rank 1 does not use."""
    _spawn(_both)


def _padded_step_without_hooks(rank: int) -> None:
    """The trainer's CapturedStep (eager: the CPU's mode) calls the module DDP wraps and
    reduces with GradSync; the plain DDP step is the reference."""
    import tempfile

    from tzrec_bench.train.config import TrainConfig
    from tzrec_bench.train.graphed_step import CapturedStep
    from tzrec_bench.train.loop import Trainer
    from tzrec_bench.train.strategies import Replicated

    tiny = dict(
        data="synthetic", synthetic_users=48, synthetic_items=120, max_seq_len=16,
        embedding_dim=16, num_layers=1, num_heads=2, num_negatives=16, batch_size=16,
        lr=1e-2, eval_batch_size=64, log_every=1, progress=False, plot=False, dropout=0.0,
        amp="off", backend="pytorch", device="cpu", cuda_graphs="off", max_steps=4,
        warmup_steps=2,
    )
    ctx = init_distributed("cpu")
    try:
        runs = []
        with tempfile.TemporaryDirectory() as work:
            for padded in (False, True):
                config = TrainConfig(**tiny, out_dir=f"{work}/{padded}-{rank}")
                torch.manual_seed(config.seed)
                trainer = Trainer(config, ctx, Replicated)
                if padded:
                    trainer.captured = CapturedStep(trainer, capture=False)
                    assert trainer.captured.sync is not None
                    assert not isinstance(trainer.captured.module, DistributedDataParallel)
                losses = []
                for step in range(4):
                    trainer.step = step
                    losses.append(float(trainer.train_step(trainer.global_rows(step))))
                runs.append((torch.tensor(losses), {
                    k: v.clone() for k, v in trainer.model.state_dict().items()}))
        (want_loss, want_state), (got_loss, got_state) = runs
        # the padded batch's rounding only (test_graphed_step's eager padded step, 1 process)
        torch.testing.assert_close(got_loss, want_loss, rtol=1e-5, atol=1e-6)
        for name, value in want_state.items():
            torch.testing.assert_close(got_state[name], value, rtol=1e-4, atol=1e-5)
        # every rank holds the same weights: the reduction reached both
        flat = torch.cat([v.flatten() for v in got_state.values()])
        other = flat.clone()
        dist.broadcast(other, src=0)
        assert torch.equal(flat, other)
    finally:
        close(ctx)


def test_the_padded_step_reduces_without_ddp_hooks_like_ddp():
    _spawn(_padded_step_without_hooks)
