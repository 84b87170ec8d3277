"""The training step captured in CUDA graphs (``--cuda-graphs``): the GPU stops waiting for
Python.

At small shapes (Amazon Games: E=64, 50 events, 128 users) an eager or compiled step spends
most of its time launching kernels. Here the whole step (forward, the loss over the
catalogue, backward, gradient clipping, AdamW) is recorded once per *bucket* and replayed:

* **Buckets.** A jagged batch's token count changes from batch to batch, a graph's shapes
  cannot. Each batch is padded up to the next multiple of a granule (``max tokens /``
  :data:`BUCKETS`) by a fixed number of padding users after its own (each at most
  ``max_seq_len`` long, so attention and positions stay in range), and the task's
  ``loss_mask`` leaves their tokens out of the loss's sum and count: the padded batch's loss
  is the batch's own (a test holds it, float64). The padding users attend only to
  themselves, so they change no real user's output. One graph per (users, bucket) seen.
* **Static inputs.** A batch is built and checked on the host as in eager mode, then copied
  into the bucket's input buffers (host copies of index tensors travel with them, so the
  model's checks need no device read during capture), and the graph replayed.
* **Optimizer.** AdamW is switched to ``capturable`` with its learning rate a device tensor,
  which the warm-up schedule fills in place; its state is created by one eager step (the
  run's first) before any capture, so no graph re-initialises it.
* **Randomness.** Dropout draws from the CUDA generator, which graphs advance on every
  replay (graph-safe Philox); the warm-up before a capture restores the generator, so the
  draws are those of the eager padded step. Negatives come from the task as in eager mode
  (seeded by ``(seed, step)`` on the host, the same on every rank) and are copied in.
* **Capture.** Two forward and backward passes on a side stream first (Triton autotuning,
  cuBLAS workspaces, torch.compile's graphs when ``--compile`` is on), then the capture;
  each bucket gets its own memory pool. The log names each captured bucket and its seconds.
* **Several processes (torchrun).** DDP reduces gradients from autograd hooks that a graph
  does not record (and with its wrapper built, capture fails on torch 2.11: "operation would make
  the legacy stream depend on a capturing blocking stream", torch 2.11), so a captured run
  builds no DDP wrapper (the strategy broadcasts rank 0's weights instead; a module that
  is wrapped anyway is unwrapped) and reduces the gradients itself inside the graph:
  :class:`~tzrec_bench.train.grad_sync.GradSync`, one NCCL all-reduce of a static flat
  buffer per dtype, divided as DDP divides. Its size is the parameters', so ranks in
  different buckets pair their collectives; each rank runs exactly one reduction per step
  (the first, eager step's and every replay's). The warm-up passes before a capture do not
  reduce: ranks capture at different steps, their gradients are discarded, and a collective
  there would pair with another rank's replay. The capture records the all-reduce without
  running it.

Under torchrun ``auto`` captures too (the README's train-speed section has the two-GPU
figures against eager DDP). Not supported (``--cuda-graphs on`` is then an error naming
the reason; ``auto`` steps eagerly): a CPU device, ``--sharding torchrec``, a model whose
registry record lacks ``graph_step``.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional

import numpy as np
import torch
from torch.nn.parallel import DistributedDataParallel

from tzrec_bench.train.config import ConfigError, TrainConfig
from tzrec_bench.train.distributed import DistContext
from tzrec_bench.train.grad_sync import GradSync
from tzrec_bench.train.task import Batch, autocast
from tzrec_gr.models.registry import get_model
from tzrec_ops.jagged import known_host_copy, remember_host_copy

#: a batch's most tokens (users x max_seq_len) is split into this many bucket sizes
BUCKETS = 16
#: forward and backward passes on a side stream before each capture
WARMUP_PASSES = 2


def refusal(config: TrainConfig, ctx: DistContext) -> Optional[str]:
    """Why the training step of ``config`` on ``ctx`` cannot be captured, or None."""
    record = get_model(config.model)
    if record.fitted or not record.graph_step:
        return f"{config.model}'s loss does not support a captured step"
    if config.sharding == "torchrec":
        return "the tables of --sharding torchrec are updated outside the step"
    if ctx.device.type != "cuda":
        return f"the run is on {ctx.device.type}, not a CUDA device"
    return None


def wanted(config: TrainConfig, ctx: DistContext) -> bool:
    """Whether the run captures its step: ``auto`` where :func:`refusal` finds nothing and
    ``--compile`` is off (with ``--compile`` only with ``--cuda-graphs on``).

    Raises:
        ConfigError: ``--cuda-graphs on`` where the step cannot be captured.
    """
    if config.cuda_graphs == "off":
        return False
    if config.cuda_graphs == "auto" and config.compile:
        # compile inside the captured step is measured (train-speed's compile+graph) but has
        # no GPU test of its losses yet: --compile alone keeps its own step
        return False
    reason = refusal(config, ctx)
    if reason is not None and config.cuda_graphs == "on":
        raise ConfigError("cuda_graphs", f"--cuda-graphs on cannot apply: {reason}; "
                          "expected --cuda-graphs auto or off")
    return reason is None


@dataclass(frozen=True)
class BucketPlan:
    """Token buckets of batches of ``users`` users: multiples of ``granule`` up to
    ``users * max_seq_len``, reached with ``padding_users`` users of at most ``max_seq_len``."""

    granule: int
    padding_users: int
    max_tokens: int

    @classmethod
    def of(cls, users: int, max_seq_len: int, buckets: int = BUCKETS) -> "BucketPlan":
        most = max(users * max_seq_len, 1)
        granule = max(1, math.ceil(most / buckets))
        return cls(granule, math.ceil((granule - 1) / max_seq_len), most)

    def bucket(self, tokens: int) -> int:
        """The padded size of a batch of ``tokens`` tokens (at least one granule)."""
        return max(1, math.ceil(tokens / self.granule)) * self.granule

    def describe(self) -> str:
        return (f"token buckets every {self.granule} up to {self.bucket(self.max_tokens)}, "
                f"{self.padding_users} padding users")


@dataclass
class _Graph:
    """One bucket's captured step: its input buffers, the graph and what it writes."""

    inputs: Batch
    scale: torch.Tensor
    graph: torch.cuda.CUDAGraph
    loss: torch.Tensor
    # the gradients the graph writes and its optimizer step reads: kept alive with it
    grads: List[Optional[torch.Tensor]]


class CapturedStep:
    """The step of :class:`~tzrec_bench.train.loop.Trainer` in CUDA graphs (module docstring).

    Args:
        trainer: the trainer (its ``strategy``, ``task``, ``config``, ``ctx``, ``amp``
            and ``log`` are used).
        capture: False steps eagerly on the same padded batches (the reference the tests
            compare the graphs with).
    """

    def __init__(self, trainer: Any, capture: bool = True) -> None:
        self.task = trainer.task
        self.config: TrainConfig = trainer.config
        self.ctx: DistContext = trainer.ctx
        self.device: torch.device = trainer.ctx.device
        self.amp = trainer.amp
        self.log: Callable[[str], None] = trainer.log
        module = trainer.strategy.module
        # under torchrun the gradients are reduced by self.sync, not by DDP's hooks
        self.module = module.module if isinstance(module, DistributedDataParallel) else module
        self.optimizer: torch.optim.Optimizer = trainer.strategy.optimizer
        self.clipped: List[torch.Tensor] = trainer.strategy.clipped
        self.params = [p for g in self.optimizer.param_groups for p in g["params"]]
        self.sync: Optional[GradSync] = (
            GradSync(self.params, trainer.strategy.averaged_over)
            if trainer.ctx.distributed else None
        )
        self.capture = capture
        self.plan = BucketPlan.of(self.config.batch_size, self.config.max_seq_len)
        self.graphs: Dict[tuple, _Graph] = {}
        self.capture_seconds = 0.0
        self._prepared = False

    def describe(self) -> str:
        """The header's line."""
        how = "captured in CUDA graphs" if self.capture else "eager on padded batches"
        sync = f"; gradients: {self.sync.describe()}" if self.sync is not None else ""
        return f"  training step {how} ({self.plan.describe()}{sync})"

    def _prepare_optimizer(self) -> None:
        """AdamW capturable, its lr a device tensor (the schedule fills it in place).

        Done at the first step, after a resumed run has loaded its optimizer state."""
        for group in self.optimizer.param_groups:
            group["capturable"] = True
            if not isinstance(group["lr"], torch.Tensor):
                group["lr"] = torch.tensor(float(group["lr"]), device=self.device)
        self._prepared = True

    def padded_batch(self, rows: np.ndarray, step: int) -> Batch:
        """The task's batch of ``rows`` padded to its bucket."""
        tokens = self.task.tokens(rows, step)
        return self.task.batch(rows, step,
                               padded=(self.plan.bucket(tokens), self.plan.padding_users))

    def _forward_backward(self, batch: Batch, scale: Any) -> torch.Tensor:
        with autocast(self.device, self.amp):
            loss = self.module(batch) * scale
        loss.backward()
        return loss.detach()

    def _body(self, batch: Batch, scale: Any) -> torch.Tensor:
        """The step itself (eager, or recorded by a capture)."""
        loss = self._forward_backward(batch, scale)
        if self.sync is not None:
            self.sync()
        if self.config.clip_grad_norm > 0:
            torch.nn.utils.clip_grad_norm_(self.clipped, self.config.clip_grad_norm)
        self.optimizer.step()
        return loss

    def __call__(self, rows: np.ndarray, step: int, scale: float) -> torch.Tensor:
        """One optimizer step on this rank's ``rows``; returns the (scaled) loss, which a
        later step's replay overwrites: read or copy it before the next call."""
        if self.capture and not self._prepared:
            self._prepare_optimizer()
        batch = self.padded_batch(rows, step)
        key = (len(rows), batch["item_ids"].shape[0])
        entry = self.graphs.get(key)
        if entry is None:
            if not self.capture or not self.optimizer.state:
                # the optimizer's state is made by an eager step, never inside a graph
                self.optimizer.zero_grad(set_to_none=True)
                return self._body(batch, scale)
            entry = self._capture(batch, key)
        for name, value in batch.items():
            buffer = entry.inputs.get(name)
            if buffer is None or buffer.shape != value.shape or buffer.dtype != value.dtype:
                raise ValueError(f"batch[{name!r}] is {tuple(value.shape)} {value.dtype}; the "
                                 f"captured bucket {key} expects it as its input buffer")
            buffer.copy_(value, non_blocking=True)
        entry.scale.fill_(scale)
        entry.graph.replay()
        return entry.loss

    def _capture(self, batch: Batch, key: tuple) -> _Graph:
        started = time.perf_counter()
        inputs = {name: value.clone() for name, value in batch.items()}
        for name, value in batch.items():
            # the model's checks read host copies: the capture must not read the device
            record = known_host_copy(value)
            if record is not None:
                remember_host_copy(inputs[name], record.values)
        scale = torch.ones((), device=self.device)
        rng = torch.cuda.get_rng_state(self.device)
        current = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(current)
        with torch.cuda.stream(side):
            # no gradient reduction here (module docstring: a collective would pair with
            # another rank's replay)
            for _ in range(WARMUP_PASSES):
                self.optimizer.zero_grad(set_to_none=True)
                self._forward_backward(inputs, scale)
        current.wait_stream(side)
        self.optimizer.zero_grad(set_to_none=True)
        torch.cuda.set_rng_state(rng, self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            loss = self._body(inputs, scale)
        entry = _Graph(inputs, scale, graph, loss, [p.grad for p in self.params])
        self.graphs[key] = entry
        seconds = time.perf_counter() - started
        self.capture_seconds += seconds
        users, tokens = key
        where = (f" on rank 0 of {self.ctx.world_size}, with its gradient all-reduce"
                 if self.sync is not None else "")
        self.log(f"CUDA graph captured{where}: {users} users + {self.plan.padding_users} "
                 f"padding, {tokens} tokens, in {seconds:.2f} s ({len(self.graphs)} "
                 f"bucket(s), {self.capture_seconds:.1f} s capturing so far)")
        return entry
